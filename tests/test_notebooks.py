"""Every notebook executes without error (offline, CPU); notebook 1's numbers are the ones its text states.

The kernel runs without the thread variables the suite sets (tests/conftest.py sets OMP_NUM_THREADS=1 for the
processes it starts): a user who opens a notebook has none, so each notebook sets what it needs itself.
"""

import json
import os
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.slow


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def execute(path: Path):
    nb = nbformat.read(path, as_version=4)
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}  # what a user's kernel sees
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute(
        env=env
    )
    return nb, time.perf_counter() - start


def stdout_of(nb) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.get("name") == "stdout"
    )


def test_every_tutorial_is_listed_in_the_tutorials_page():
    assert len(NOTEBOOKS) >= 6
    page = (ROOT / "docs" / "tutorials.md").read_text()
    table = [line for line in page.splitlines() if line.startswith("| [`notebooks/")]
    assert len(table) == len(NOTEBOOKS)  # one row each
    for path in NOTEBOOKS:
        assert f"](../notebooks/{path.name})" in page
    assert "docs/tutorials.md" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, record_property):
    nb, seconds = execute(path)
    record_property("seconds", round(seconds, 1))
    print(f"{path.name}: {seconds:.1f} s")
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            continue
        assert all(out.output_type != "error" for out in cell.outputs)
    # Markdown before every code cell.
    kinds = [c.cell_type for c in nb.cells]
    assert kinds[0] == "markdown" and all(
        a == "markdown" for a, b in zip(kinds, kinds[1:], strict=False) if b == "code"
    )
    if path.name.startswith("01_"):
        line = next(line for line in stdout_of(nb).splitlines() if line.startswith("{"))
        results = json.loads(line)
        assert results["per_example_grads"] == [1.0, 1.0, 1.0, -7.0]
        assert results["big_batch"] == 1.25
        assert results["weighted"] == {"4": 1.25, "2+2": 1.25, "1+1+1+1": 1.25, "3+1": 1.25}
        assert results["mean_of_means_3_1"] == 1.75
        assert results["four_steps"] == pytest.approx(2.31640625)
    if path.name.startswith("06_"):  # the pair as the unit: its table of measured errors
        rows = [line.split("|") for line in stdout_of(nb).splitlines() if line.startswith(("DPO ", "DPO + NLL"))]
        errors = {(r[0].strip(), r[1].strip()): (float(r[2]), float(r[3])) for r in rows}
        assert len(errors) == 8 and all(ours <= 1e-6 for _, ours in errors.values())
        assert errors[("DPO", "3 x 3")][0] > 1e-2  # ragged: the mean of micro-batch means is off
        assert all(errors[("DPO + NLL", split)][0] > 1e-2 for split in ("2 x 4", "1 x 8", "3 x 3"))
    if path.name.startswith("07_"):
        out = stdout_of(nb)
        rows = [line.split() for line in out.splitlines() if re.match(r"^\d x \d ", line)]
        assert len(rows) == 4
        for row in rows:  # "bs x GA  hfacc-error  per-micro-batch-error"
            exact, usual = float(row[3]), float(row[4])
            assert exact <= 1e-6 and (usual > 0.05 or row[:3] == ["8", "x", "1"])
    if path.name.startswith("08_"):  # the student token as the unit: every split, and the stored top-K
        out = stdout_of(nb)
        rows = [line.split() for line in out.splitlines() if re.match(r"^\d x \d ", line)]
        assert len(rows) == 4
        for row in rows:  # "bs x GA  hfacc-error  per-micro-batch-error"
            exact, usual = float(row[3]), float(row[4])
            assert exact <= 1e-6 and (usual > 0.05 or row[:3] == ["8", "x", "1"])
        assert float(re.search(r"top-64 stored.*update (\S+)", out).group(1)) <= 1e-6
        assert float(re.search(r"\((\d+)x too small\)", out).group(1)) > 10
    if path.name.startswith("05_"):
        out = stdout_of(nb)
        assert "no_sync around forward and backward  : 1 all-reduce" in out
        assert "no_sync around backward only         : 4 all-reduce" in out
    if path.name.startswith("09_"):  # KTO's reference point: each micro-batch's own z0 vs the step's, measured
        rows = [line.split("|") for line in stdout_of(nb).splitlines() if re.match(r"^\dx\d", line)]
        errors = {r[0].strip(): (float(r[1]), float(r[2])) for r in rows}
        assert len(errors) == 4 and all(ours <= 1e-5 for _, ours in errors.values())
        assert errors["2x4"][0] > 1e-3 and errors["3x3"][0] > 1e-3  # even the even split is off
