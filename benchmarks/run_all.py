"""One speed table, every family against its baseline: runs each family's benchmark, in this process, one after the
other, and prints hfacc's throughput and peak memory as ratios to the baselines measured beside it in the same run.

    python benchmarks/run_all.py --rounds 3          # the table in benchmarks/README.md (TRL installed: about 2 h)
    python benchmarks/run_all.py --quick             # tiny sizes, one round: that it runs (the figures mean nothing)

Each family's own script measures its contenders side by side, interleaved round by round, and prints a ratio per
contender (the median of the per-round ratios, on the clock the script names): benchmarks/throughput.py (SFT vs
stock Trainer and TRL's SFTTrainer, padded and padding-free; process CPU time), dpo.py (TRL's DPOTrainer; wall),
reward_kto.py (TRL's RewardTrainer and KTOTrainer; CPU time and wall), distill.py (TRL's DistillationTrainer and
GKDTrainer; CPU time) and grpo.py (TRL's GRPOTrainer; training and sampling tokens/s, wall). A ratio to a baseline
other than the script's reference is the quotient of the two printed ratios. Memory is each script's peak for one
micro-batch's forward and backward (grpo.py: one whole step). Without TRL only the stock Trainer row is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import platform
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (family, script, its arguments, hfacc's row, [(baseline, its row)], throughput column, unit)
FAMILIES = [
    ("SFT", "throughput", ["--threads", "1", "--clock", "cpu", "--contenders", "stock,trl,trl_pf,hfacc"], "hfacc",
     [("stock Trainer", "stock"), ("TRL SFTTrainer", "trl"), ("TRL SFTTrainer padding_free", "trl_pf")],
     "target tokens/s", "CPU"),
    ("DPO", "dpo", ["--threads", "1"], "hfacc", [("TRL DPOTrainer", "trl")], "pairs/s", "wall"),
    ("reward model", "reward_kto", ["--threads", "1", "--only", "reward"], "hfacc", [("TRL RewardTrainer", "trl")],
     "pairs/s", "CPU"),
    ("KTO", "reward_kto", ["--threads", "1", "--only", "kto"], "hfacc", [("TRL KTOTrainer", "trl")], "rows/s", "CPU"),
    ("distillation", "distill", ["--threads", "1"], "hfacc",
     [("TRL DistillationTrainer", "trl DistillationTrainer"), ("TRL GKDTrainer", "trl GKDTrainer")],
     "student tokens/s", "CPU"),
    ("GRPO", "grpo", [], "hfacc", [("TRL GRPOTrainer", "trl")], "completion tokens/s trained",
     "wall"),
]  # fmt: skip


def markdown_rows(text):
    """``{contender: [cells]}`` of every markdown table row in ``text`` (later tables win)."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|---") and not line.startswith("| contender"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def number(text):
    match = re.search(r"[-+]?\d+(\.\d+)?", text or "")
    return float(match.group()) if match else None


def summarize(script, text):
    """``{contender: (throughput ratio to the script's reference, peak memory ratio to it)}`` from a run's output."""
    if script == "grpo":  # a plain-text table: contender, train tok/s, gen tok/s, s/step, gen share, peak MiB
        values = {}
        for line in text.splitlines():
            parts = line.split()
            if parts and parts[0] in ("trl", "hfacc") and len(parts) == 6 and number(parts[1]) is not None:
                values[parts[0]] = (float(parts[1]), float(parts[5]))
        reference = values.get("trl") or values.get("hfacc")
        return {k: (v[0] / reference[0], v[1] / reference[1] if reference[1] else None) for k, v in values.items()}
    out = {}
    for name, cells in markdown_rows(text).items():
        ratios = [number(c) for c in cells if c.endswith("x")]
        if ratios:  # the first "x" column is throughput's ratio, the last one memory's
            out[name] = (ratios[0], ratios[-1] if len(ratios) > 1 else None)
    return out


def run(script, argv):
    spec = importlib.util.spec_from_file_location(f"benchmark_{script}", HERE / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    buffer = io.StringIO()
    start, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(buffer):
        module.main(argv)
    return buffer.getvalue(), time.perf_counter() - start, time.process_time() - cpu


def cpu_name():
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cell(value):
    return "-" if value is None else f"{value:.2f}x"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="each benchmark's --quick run")
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--log", default="", help="also write every benchmark's full output to this file")
    cli = parser.parse_args(argv)
    wanted = set(cli.families.split(",")) - {""}
    lines = [
        "| family | hfacc vs | throughput | peak memory | clock | run s (wall / CPU) |",
        "|---|---|---|---|---|---|",
    ]
    log = []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for family, script, extra, ours, baselines, unit, clock in FAMILIES:
        if wanted and family not in wanted:
            continue
        argv = [*extra, *(["--quick"] if cli.quick else [])]
        if not cli.quick:
            argv += (
                ["--steps", "5", "--rounds", str(cli.rounds)] if script == "grpo" else ["--rounds", str(cli.rounds)]
            )
        text, wall, cpu = run(script, argv)
        log.append(f"## {family}: python benchmarks/{script}.py {' '.join(argv)}\n{text}")
        ratios = summarize(script, text)
        print(f"{family}: {ratios}", file=sys.stderr, flush=True)
        mine = ratios.get(ours)
        for name, row in baselines:
            theirs = ratios.get(row)
            if mine is None or theirs is None:
                lines.append(f"| {family} | {name} | not measured | | {clock} | {wall:.0f} / {cpu:.0f} |")
                continue
            speed = mine[0] / theirs[0] if theirs[0] else None
            memory = mine[1] / theirs[1] if mine[1] is not None and theirs[1] else None
            lines.append(
                f"| {family} | {name} | {cell(speed)} ({unit}) | {cell(memory)} | {clock} | {wall:.0f} / {cpu:.0f} |"
            )
    header = (
        f"{cpu_name()}, {os.cpu_count()} cores, load average {load:.1f} at the start; "
        f"{'--quick' if cli.quick else f'{cli.rounds} rounds'}; ratios > 1x: hfacc faster (throughput) or larger "
        "(memory)"
    )
    table = header + "\n\n" + "\n".join(lines) + "\n"
    if cli.log:
        Path(cli.log).write_text("\n\n".join(log))
    print(table)
    return table


if __name__ == "__main__":
    main()
