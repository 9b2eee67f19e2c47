"""Every benchmark script runs on the trainers' current signatures: each one's ``--quick`` mode (tiny sizes, one round,
TRL's contenders only where TRL is installed, which CI does not) runs here, in this process, so that a changed
signature or a renamed hfacc name cannot break a benchmark unseen (benchmarks/distill.py's on-policy part once
stopped with a TypeError after its throughput table: the trainer's ``sample`` had gained an argument). The figures
of a quick run mean nothing and are not asserted; what a run computes exactly (the update errors) is."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "common")


def load_benchmark(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def table_rows(text):
    """The markdown table rows a run printed (header and rule lines left out)."""
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")]


def run_quick(name, capsys, *extra):
    result = load_benchmark(name).main(["--quick", *extra])
    return result, capsys.readouterr().out


@pytest.mark.parametrize("name", ["distill", "dpo", "reward_kto"])
def test_the_side_by_side_benchmarks_run_quick_and_their_update_errors_stay_exact(name, capsys):
    """The throughput table, the memory table and the update errors of hfacc's rows (TRL's where installed)."""
    errors, out = run_quick(name, capsys)
    assert errors and all(e <= 2e-6 for e in errors.values() if e is not None), errors
    rows = [row for row in table_rows(out) if row.startswith("| hfacc")]
    assert rows, out
    # The speed table's hfacc row has a positive throughput (not nan, not zero).
    assert float(re.split(r"\s*\|\s*", rows[0])[2]) > 0, rows[0]
    summary = load_benchmark("run_all").summarize(name, out)  # what benchmarks/run_all.py reads of the run
    assert summary["hfacc"][0] > 0 and summary["hfacc"][1] > 0, summary
    if name == "distill":  # the part that stopped with the TypeError: hfacc's on-policy rows
        assert {mode for mode, *_ in errors} == {"off-policy", "on-policy"}
        assert "| on-policy | hfacc DistillationTrainer |" in out


def test_throughput_quick(capsys):
    result, out = run_quick("throughput", capsys)
    assert set(result["speed"]) >= {"stock", "hfacc", "hfacc_padded"}
    assert all(v[0] > 0 for v in result["speed"].values())
    assert result["memory"]["gradient difference"] <= 1e-6
    assert result["memory"][("whole step", "hfacc")] > 0


def test_grpo_quick(capsys):
    errors, out = run_quick("grpo", capsys)
    assert set(errors) == {"ragged", "second step"} and max(errors.values()) <= 1e-6, errors
    assert re.search(r"^hfacc\s+\d+", out, re.M), out
    assert load_benchmark("run_all").summarize("grpo", out)["hfacc"][0] == 1.0  # its own reference without TRL


def test_trainer_overhead_quick(capsys):
    ratio, out = run_quick("trainer_overhead", capsys)
    assert ratio > 0 and "step time hfacc / stock Trainer" in out


@pytest.mark.parametrize("name", ["memory_soak", "streaming_memory"])
def test_memory_benchmarks_quick(name, capsys):
    code, out = run_quick(name, capsys)
    assert code == 0 and "RSS" in out


def test_streaming_sharding_quick_in_one_process(capsys):
    result, out = run_quick("streaming_sharding", capsys)
    assert result["dispatch"] > 0 and result["split"] > 0, out


def test_layout_zoo_quick(capsys):
    rows, out = run_quick("layout_zoo", capsys)
    assert set(rows) == {"llama", "qwen2"}
    assert all(not got.startswith("error") for got in rows["llama"]), rows


def test_cli_startup_quick(capsys):
    times, out = run_quick("cli_startup", capsys)
    assert len(times) == 2 and all(t[0] > 0 for t in times.values()), times


def test_engines_quick_launches_the_single_device_config(capsys):
    results, out = run_quick("engines", capsys)
    (config,) = results.values()
    assert "error" not in config, config
    assert all(case["grad_error"] <= 1e-6 for case in config["cases"].values()), config


def test_sft_profile_quick_times_every_part_of_the_epoch(capsys):
    (parts, total, steps), out = run_quick("sft_profile", capsys)
    assert steps >= 1 and total > 0, out
    # The model's own parts were timed (the wraps reached them), and the parts add up to the epoch's CPU time.
    assert min(parts["forward"], parts["loss"], parts["backward"], parts["draw + collate"], parts["window"]) > 0, parts
    assert sum(parts.values()) == pytest.approx(total), parts
    assert len(table_rows(out)) == 13, out  # the header, 11 parts and the total


QUICK_TESTS = {  # every script has its quick run above
    "cli_startup",
    "distill",
    "dpo",
    "engines",
    "grpo",
    "layout_zoo",
    "long_context",
    "memory_soak",
    "reward_kto",
    "sft_profile",
    "streaming_memory",
    "streaming_sharding",
    "throughput",
    "trainer_overhead",
}


def test_every_benchmark_script_has_a_quick_run_here():
    """A new script in benchmarks/ gets its --quick mode and its test in this module."""
    assert set(SCRIPTS) - {"run_all"} == QUICK_TESTS | {"gpu"}


def test_the_gpu_benchmark_smoke_runs_on_cpu(tmp_path, capsys):
    """benchmarks/gpu.py (written for a CUDA device, never run on one in this project yet) at tiny sizes on the CPU:
    every part it runs without TRL and vLLM produces its row, none fails."""
    out = tmp_path / "gpu_table.md"
    text = load_benchmark("gpu").main(["--models", "tiny", "--budget", "6", "--device", "cpu", "--out", str(out)])
    assert out.read_text() == text
    assert "failed" not in text, text
    for title in ("### SFT, tiny, sdpa", "### DPO, tiny", "### GRPO, tiny"):
        assert title in text
    rows = {row.split(" | ")[0][2:]: row for row in table_rows(text)}
    assert {"stock", "hfacc_padded", "hfacc"} <= set(rows), rows


def test_the_long_context_benchmark_runs_small_on_cpu():
    """benchmarks/long_context.py's one-device layout on the tiny config (the GPU run launches the Ulysses layout
    the same way, through accelerate_configs/deepspeed_ulysses.yaml; tests/test_sequence_parallel.py launches that
    engine on CPU): every length up to --max_length trains a step and lands in the table."""
    import argparse

    bench = load_benchmark("long_context")
    args = argparse.Namespace(model="tiny", start=32, max_length=64, budget_s=60.0, cpu=True)
    layout = bench.run_layout(args, 1, 1)
    assert [r["length"] for r in layout["results"]] == [32, 64], layout
    assert all(r["tokens_per_s"] > 0 for r in layout["results"])
    assert "| 1 device(s), sp 1 | 64 |" in bench.table("tiny", [layout])
