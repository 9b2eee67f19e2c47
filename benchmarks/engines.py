"""Every shipped accelerate config on this machine, launched with its engine: how exact hfacc's step is, as a table.

    python benchmarks/engines.py                       # GPUs: fp32 and bf16, 2 processes (1 GPU: one process)
    python benchmarks/engines.py --dtype bf16          # bf16 only
    python benchmarks/engines.py --cpu --dtype fp32    # smoke test on 2 CPU processes (gloo), as the tests run

Each config is launched with ``accelerate launch --config_file accelerate_configs/<config>.yaml`` running
tests/engine_check.py, the same cases tests/test_engines.py asserts on CPU: one optimizer step of
TokenWeightedTrainer (fused loss on, tied embeddings, plain path for comparison), FSDP2 also through the loop helper
with fully_shard applied directly, and under DeepSpeed the NaN/empty-window skip and the refusal of a config without
an overflow check. The reference is always one big batch in fp32 on the same initial weights; in bf16 the errors
measure bf16's rounding, in fp32 they should stay at fp32 rounding (<= 1e-6 gradient, <= 1e-5 loss) as on CPU.

With 2+ GPUs every config runs on 2 of them, and multi_node_ddp as two machine ranks of one GPU each on this host
(CUDA_VISIBLE_DEVICES splits the GPUs, since both ranks are local rank 0). With 1 GPU the engines run in their
single-process modes and the multi-node config is left out. Not timed: a wall-clock number here would mean nothing.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [  # (accelerate config, engine_check engine)
    ("single_device", "single"),
    ("ddp", "ddp"),
    ("multi_node_ddp", "ddp"),
    ("fsdp2", "fsdp2"),
    ("deepspeed_zero2", "zero2"),
    ("deepspeed_zero3", "zero3"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config, engine, processes, dtype, out, *, machine=None, env=None):
    """Start one ``accelerate launch``; ``machine`` = (rank, port) starts one machine of the two-machine config."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        f"accelerate_configs/{config}.yaml",
    ]
    command += ["--num_processes", str(processes), "--mixed_precision", "bf16" if dtype == "bf16" else "no"]
    if machine is not None:
        rank, port = machine
        command += ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
        command += ["--main_process_port", str(port)]
    elif processes > 1:
        command += ["--main_process_port", str(free_port())]
    command += ["tests/engine_check.py", engine, str(out)] + (["--bf16"] if dtype == "bf16" else [])
    return subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_config(config, engine, dtype, gpus, cpu, timeout):
    """Results of one config as engine_check wrote them, or {"error": ...}."""
    out = Path(tempfile.mkdtemp()) / f"{config}-{dtype}.json"
    if config == "multi_node_ddp":
        if not cpu and gpus < 2:
            return {"error": "needs 2 GPUs (one per machine rank)"}
        port = free_port()
        procs = [
            launch(
                config,
                engine,
                2,
                dtype,
                out,
                machine=(rank, port),
                env=None if cpu else {"CUDA_VISIBLE_DEVICES": str(rank)},
            )
            for rank in (0, 1)
        ]
    else:
        processes = 1 if config == "single_device" or (not cpu and gpus < 2) else 2
        procs = [launch(config, engine, processes, dtype, out)]
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            errors.append((err.strip().splitlines() or ["no output"])[-1])
    if errors or not out.exists():
        return {"error": errors[0] if errors else "no results written"}
    return json.loads(out.read_text())


def rows(config, dtype, results):
    if "error" in results:
        yield [config, dtype, "-", f"FAILED: {results['error'][:100]}"]
        return
    for name, case in results["cases"].items():
        head = case["head"]["in_forward"][0] if case["head"]["in_forward"] else {}
        weight = head.get("weight", {})
        whole = weight.get("shape") == [96, 64] and weight.get("local_numel") == 96 * 64
        notes = []
        if "distributed_type" in case:
            notes.append(case["distributed_type"].split(".")[-1])
        yield [
            config,
            dtype,
            str(results["world_size"]),
            name,
            "yes" if case["fused"] else "no",
            ("whole" if whole else "SHARDED") if case["fused"] else "-",
            f"{case['grad_error']:.1e}",
            f"{case['loss_error']:.1e}",
            ", ".join(notes),
        ]
    procs = str(results["world_size"])
    if "fused_vs_plain" in results:
        yield [config, dtype, procs, "fused vs plain (applied gradients)", "", "", f"{results['fused_vs_plain']:.1e}"]
    if "nonfinite" in results:
        r = results["nonfinite"]
        ok = r["unchanged_by_nan_window"] and r["unchanged_by_empty_window"] and r["all_finite"]
        yield [config, dtype, procs, f"NaN + empty windows: {'skipped, weights untouched' if ok else 'NOT SKIPPED'}"]
    if "overflow_check_off" in results:
        refused = "refused" if results["overflow_check_off"] else "NOT REFUSED"
        yield [config, dtype, procs, f"config without an overflow check: {refused}"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default=None, help="fp32, bf16 or fp32,bf16 (default: both on GPUs, fp32 on CPU)")
    parser.add_argument("--cpu", action="store_true", help="run on 2 CPU processes (gloo), as the tests do")
    parser.add_argument("--configs", default=",".join(c for c, _ in CONFIGS), help="comma-separated config names")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    parser.add_argument("--json", default=None, help="also write every result to this file")
    parser.add_argument("--quick", action="store_true", help="the single_device config on CPU, fp32 (the tests' run)")
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.cpu, cli.dtype, cli.configs = True, "fp32", "single_device"

    import torch

    gpus = 0 if cli.cpu else torch.cuda.device_count()
    if not gpus and not cli.cpu:
        raise SystemExit("no GPU here: pass --cpu for the smoke test on CPU processes")
    dtypes = (cli.dtype or ("fp32" if cli.cpu else "fp32,bf16")).split(",")
    wanted = cli.configs.split(",")
    header = ["config", "dtype", "procs", "case", "fused", "head weight", "grad rel err", "loss rel err", "notes"]
    table, everything = [], {}
    device = "CPU processes (gloo)" if cli.cpu else f"{gpus} x {torch.cuda.get_device_name(0)}"
    print(f"hfacc engines on {device}, torch {torch.__version__}", flush=True)
    for dtype in dtypes:
        for config, engine in CONFIGS:
            if config not in wanted:
                continue
            print(f"... {config} ({dtype})", flush=True)
            results = run_config(config, engine, dtype, gpus, cli.cpu, cli.timeout)
            everything[f"{config}/{dtype}"] = results
            table.extend(rows(config, dtype, results))
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row + [""] * (len(header) - len(row))) + " |")
    if cli.json:
        Path(cli.json).write_text(json.dumps(everything, indent=2))
    return everything


if __name__ == "__main__":
    main()
