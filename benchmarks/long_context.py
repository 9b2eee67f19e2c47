"""The longest sequence one training step fits, with and without sequence parallelism, and its tokens/s.

    PYTHONPATH=$PWD python benchmarks/long_context.py --model qwen2.5-0.5b --budget_s 120 --out long_context.md
    PYTHONPATH=$PWD python benchmarks/long_context.py --model tiny --cpu --start 64 --max_length 256   # smoke test

For each layout (one device without sequence parallelism; every visible GPU as one DeepSpeed Ulysses group through
accelerate_configs/deepspeed_ulysses.yaml), a worker process per device builds the model from its public config
(random weights: no download), and trains one step (forward, backward, optimizer) of hfacc's causal-LM objective on one
row of L tokens, L doubling from --start until the step runs out of memory, passes --max_length, or the layout's
share of --budget_s is spent. Each fitting length is timed on a second step. The table (markdown) goes to --out.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Public configs, written out from the model's config.json (no Hub here): the shapes are what matters for memory.
PUBLIC_CONFIGS = {
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B config.json
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "tiny": dict(  # the smoke test's
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
    ),
}  # fmt: skip


def build_model(name: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(PUBLIC_CONFIGS[name])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


def worker(args) -> None:
    """One process of a layout: train one step per length, append what fitted to args.worker (rank 0)."""
    from accelerate import Accelerator

    from hfacc.objectives import CausalLMObjective
    from hfacc.runtime.sequence_parallel import DataCollatorForSequenceParallel, init_deepspeed_comm

    cuda = torch.cuda.is_available() and not args.cpu
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(cpu=not cuda and not deepspeed)  # cpu=True would make DeepSpeed's processes MULTI_CPU
    sp = accelerator.parallelism_config.sp_size if accelerator.parallelism_config else 1
    if sp > 1:
        init_deepspeed_comm()
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(args.model, dtype)
    vocab = model.config.vocab_size
    lengths = []
    length = args.start
    while length <= args.max_length:
        lengths.append(length)
        length *= 2
    collate = DataCollatorForSequenceParallel(lambda rows: rows[0], sp)
    rows = [{"input_ids": torch.randint(1, vocab, (1, n)), "labels": torch.randint(1, vocab, (1, n))} for n in lengths]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    if sp > 1:
        # accelerate shards the loader over the ranks and Ulysses runs every rank's row on the whole group: each rank
        # gets every length once, and the group takes `world` steps of it (the first ones warm up).
        steps = torch.distributed.get_world_size()
        data = [collate([row]) for row in rows for _ in range(steps)]
        loader = torch.utils.data.DataLoader(data, batch_size=1, collate_fn=lambda b: b[0])
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        steps = 2
        model, optimizer = accelerator.prepare(model, optimizer)
        loader = [collate([row]) for row in rows for _ in range(steps)]
    objective = CausalLMObjective(chunk_size=1024)
    objective.fused = True
    model.train()
    results, start, failed = [], time.perf_counter(), None
    iterator = iter(loader)
    for n in lengths:
        times = []
        try:
            for _ in range(steps):  # the last step is timed; the ones before warm up
                batch = next(iterator)
                batch = {k: v.to(accelerator.device) for k, v in batch.items() if torch.is_tensor(v)}
                if "shift_labels" in batch:
                    batch["labels"] = batch["shift_labels"]
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                _, sums = objective(model, batch)
                accelerator.backward(sums.loss / max(int(sums.count), 1))
                optimizer.step()
                optimizer.zero_grad()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            failed = n
            break
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        results.append({"length": n, "tokens_per_s": n / times[-1], "peak_gib": peak})
        if time.perf_counter() - start > args.budget_s:
            break
    if accelerator.is_main_process:
        out = {
            "sp": sp,
            "world": torch.distributed.get_world_size() if sp > 1 else 1,
            "results": results,
            "out_of_memory_at": failed,
        }
        Path(args.worker).write_text(json.dumps(out))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(args, processes: int, sp: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "layout.json"
    script = [str(Path(__file__).resolve()), "--worker", str(out), "--model", args.model, "--start", str(args.start),
              "--max_length", str(args.max_length), "--budget_s", str(args.budget_s)] + (["--cpu"] if args.cpu else [])  # fmt: skip
    if sp > 1:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "accelerate_configs/deepspeed_ulysses.yaml"), "--num_processes", str(processes),
                  "--parallelism_config_sp_size", str(sp), "--main_process_port", str(free_port()),
                  "--mixed_precision", "no" if args.cpu else "bf16"]  # fmt: skip
    else:
        launch = [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*launch, *script], env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        errors = [line for line in proc.stderr.splitlines() if "Error" in line] or proc.stderr.splitlines()[-1:]
        return {"sp": sp, "world": processes, "error": errors[-1:]}
    return json.loads(out.read_text())


def table(model: str, layouts: list[dict]) -> str:
    lines = [f"Longest sequence of one training step, {model} (random weights from its public config)", "",
             "| layout | longest that fits | tokens/s there | peak GiB per device | first that did not fit |",
             "|---|---|---|---|---|"]  # fmt: skip
    for layout in layouts:
        name = f"{layout['world']} device(s), sp {layout['sp']}"
        if "error" in layout or not layout["results"]:
            lines.append(f"| {name} | failed: {' '.join(layout.get('error', ['nothing fitted']))} | | | |")
            continue
        best = layout["results"][-1]
        oom = layout["out_of_memory_at"] or "not reached"
        peak = f"{best['peak_gib']:.1f}" if best["peak_gib"] == best["peak_gib"] else "-"  # NaN: not on a GPU
        lines.append(f"| {name} | {best['length']} | {best['tokens_per_s']:.0f} | {peak} | {oom} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PUBLIC_CONFIGS))
    parser.add_argument("--budget_s", type=float, default=120.0, help="seconds for all layouts together")
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--max_length", type=int, default=1 << 20)
    parser.add_argument("--sp", type=int, default=0, help="sequence-parallel size (default: every visible GPU)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo (the smoke test)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    sp = args.sp or (2 if args.cpu else max(torch.cuda.device_count(), 1))
    layouts = [(1, 1)] + ([(sp, sp)] if sp > 1 else [])
    args.budget_s = args.budget_s / len(layouts)
    report = table(args.model, [run_layout(args, processes, size) for processes, size in layouts])
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
