"""The GPU table: hfacc vs stock Trainer vs TRL on 0.5B-3B models, tokens/s, peak memory and MFU, in one command.

    python benchmarks/gpu.py --out $OUT/gpu_table.md              # a CUDA device: about --budget (540) seconds
    python benchmarks/gpu.py --models tiny --budget 30 --out t.md   # CPU: the tests' smoke run (tiny sizes)

Models are built from the public configs' shapes (no weights needed: the numbers are those of the configs on the
Hub, written here): Qwen2.5-0.5B, Llama-3.2-1B, Llama-3.2-3B (Llama 3.2's rope scaling left out: it does not change
the work), randomly initialized on the device. Rows are synthetic with the length distribution of a chat dataset
(log-normal, median 350 tokens, capped at --max-length; 30-70 % of each row is the prompt, masked with -100).

SFT, per model and attention implementation (sdpa, and flash_attention_2 where flash-attn is installed), each
contender trains bs 8 x GA 2 in bf16 (autocast over fp32 master weights, the Trainer's bf16=True) for its share of
--budget; the first two optimizer steps are warm-up and not timed:

- ``stock``: transformers.Trainer, padded batches (DataCollatorForSeq2Seq), the model's own loss;
- ``trl`` / ``trl_pf``: TRL's SFTTrainer, padded and padding_free=True (where TRL is installed);
- ``hfacc_padded`` / ``hfacc``: TokenWeightedTrainer with padding_free=False and with its defaults.

Reported: real (non-padding) tokens per second and target tokens per second of the timed steps, the peak of
torch.cuda.max_memory_allocated over the run (weights, Adam states and activations), and MFU: real tokens/s x
(6 N + 6 L d s) / the device's dense bf16 peak (N the parameters but the input embedding, L layers, d the hidden
size, s the mean sequence length: the causal attention's share), for the devices whose peak is known here.

Then at the smallest size: DPO (hfacc vs TRL's DPOTrainer, pairs/s) and GRPO (hfacc vs TRL's GRPOTrainer through
transformers' generate, and hfacc through vLLM where it is installed; completion tokens sampled and trained per
second). A contender that fails (out of memory, an import) gets its error in the table instead of figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import count_targets, trl_version  # noqa: E402
from transformers import LlamaConfig, Qwen2Config, TrainerCallback  # noqa: E402

# The public configs' shapes (Hub config.json of each model).
MODELS = {
    "qwen2.5-0.5b": (Qwen2Config, dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "llama-3.2-1b": (LlamaConfig, dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                       num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "llama-3.2-3b": (LlamaConfig, dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                       num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                       head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "tiny": (LlamaConfig, dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2)),
}  # fmt: skip
# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12, "L4": 121e12}
BS, GA, WARMUP = 8, 2, 2
SFT_CONTENDERS = ("stock", "trl", "trl_pf", "hfacc_padded", "hfacc")


def build_model(name, device, attention, seed=0, vocab_size=None):
    config_class, shape = MODELS[name]
    shape = {**shape, **({"vocab_size": vocab_size} if vocab_size else {})}
    config = config_class(**shape, max_position_embeddings=32768, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = attention
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it trains: a 3B model's init on the CPU takes minutes
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


def chat_rows(n, vocab_size, max_length, seed=0, median=350):
    """Token rows with a chat dataset's length distribution (log-normal), prompts of 30-70 % masked with -100."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = max(8, min(max_length, int(rng.lognormvariate(math.log(median), 0.8))))
        ids = [rng.randrange(3, vocab_size) for _ in range(length)]
        prompt = int(length * rng.uniform(0.3, 0.7))
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return rows


def flops_per_token(model, mean_length):
    """6 N + 6 L d s (training: forward and backward; the input embedding is a lookup, not counted)."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    if not config.tie_word_embeddings:
        params -= model.get_input_embeddings().weight.numel()
    return 6 * params + 6 * config.num_hidden_layers * config.hidden_size * mean_length


def device_peak(device):
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


class Clock(TrainerCallback):
    """Times each optimizer step (after the device finished it) and stops training after ``seconds`` of steps."""

    def __init__(self, device, seconds):
        self.device, self.seconds, self.steps, self._start, self._t0 = device, seconds, [], None, None

    def _now(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = self._now()

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = self._now()

    def on_step_end(self, args, state, control, **kwargs):
        now = self._now()
        self.steps.append(now - self._start)
        if len(self.steps) > WARMUP + 1 and now - self._t0 > self.seconds:
            control.should_training_stop = True


def sft_trainer(kind, model, rows, tmp, cli):
    import throughput as sft

    sft.BS, sft.GA = BS, GA
    dtype = "bf16" if cli.bf16 else "fp32"
    runner = sft.RUNNERS[kind]
    trainer = runner(model, rows, tmp, cli.device, dtype)
    trainer.args.max_steps = 10**6  # the Clock stops it
    trainer.args.train_sampling_strategy = "sequential"  # so that the timed steps' rows are known
    return trainer


def run_sft(kind, cli, name, attention, rows, seconds):
    if cli.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build_model(name, cli.device, attention)
    mean_length = sum(len(r["input_ids"]) for r in rows) / len(rows)
    per_token = flops_per_token(model, mean_length)
    clock = Clock(cli.device, seconds)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = sft_trainer(kind, model, rows, tmp, cli)
        trainer.add_callback(clock)
        trainer.train()
        steps = trainer.state.global_step
    timed = clock.steps[WARMUP:]
    per_step = BS * GA
    # The rows are drawn sequentially and cycle: step i trains rows [i * 16, (i + 1) * 16) mod len(rows).
    chosen = [rows[(s * per_step + j) % len(rows)] for s in range(WARMUP, steps) for j in range(per_step)]
    real = sum(len(r["input_ids"]) for r in chosen)
    result = {
        "tokens/s": real / sum(timed),
        "target tokens/s": count_targets(chosen) / sum(timed),
        "steps": len(timed),
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if cli.device == "cuda" else None,
    }
    peak = device_peak(cli.device)
    result["MFU"] = result["tokens/s"] * per_token / peak if peak else None
    del trainer, model
    return result


def run_dpo(kind, cli, name, seconds):
    import dpo

    longest = cli.max_length // 4  # prompts and answers of up to a quarter of --max-length each
    pairs = dpo.build_pairs(64, MODELS[name][1]["vocab_size"], prompts=(longest // 8, longest), answers=(4, longest))
    model = build_model(name, cli.device, "sdpa")
    if cli.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = Clock(cli.device, seconds)
    extra = dict(use_cpu=cli.device == "cpu", bf16=cli.bf16, max_steps=10**6)
    with tempfile.TemporaryDirectory() as tmp:
        runner = dpo.trl_trainer if kind == "trl" else dpo.hfacc_trainer
        trainer = runner(model, copy.deepcopy(model), pairs, tmp, 4, 2, 1000, **extra)
        trainer.add_callback(clock)
        trainer.train()
    timed = clock.steps[WARMUP:]
    return {
        "pairs/s": 4 * 2 * len(timed) / sum(timed),
        "steps": len(timed),
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if cli.device == "cuda" else None,
    }


def run_grpo(kind, cli, name, seconds):
    import grpo

    from hfacc.data.embedded import build_default_tokenizer

    if cli.models == ["tiny"]:
        grpo.BS, grpo.G, grpo.L = 4, 2, 8
    tokenizer = build_default_tokenizer()
    model = build_model(name, cli.device, "sdpa", vocab_size=len(tokenizer))
    if cli.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = 2 + max(1, int(seconds // 20))
    prompts = grpo.prompts_dataset(512)
    settings = {"bf16": cli.bf16}
    with tempfile.TemporaryDirectory() as out:
        if kind == "trl":
            trainer, timer = grpo.run_trl(model, tokenizer, prompts, steps, out, cli.device, **settings)
        else:
            if kind == "hfacc vLLM":
                settings["use_vllm"] = True
            trainer, timer = grpo.run_hfacc(model, tokenizer, prompts, steps, out, cli.device, **settings)
    tokens = grpo.completion_tokens(trainer, "trl" if kind == "trl" else "hfacc")[1:]
    step_times, generation = timer.steps[1:], timer.generation[1:]
    train = sum(s - g for s, g in zip(step_times, generation, strict=True))
    return {
        "completion tokens/s (training)": sum(tokens) / train,
        "completion tokens/s (sampling)": sum(tokens) / sum(generation),
        "s/step": sum(step_times) / len(step_times),
        "peak GiB": torch.cuda.max_memory_allocated() / 2**30 if cli.device == "cuda" else None,
    }


def attempt(fn, *args):
    """``fn(*args)``, or ``{"error": ...}``: one contender's failure (out of memory, a missing package) is a row."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return fn(*args)
    except Exception as err:  # noqa: BLE001 - reported in the table
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"}


def cell(value, digits=0):
    if value is None:
        return "-"
    if isinstance(value, float) and digits == 0 and value < 100:
        digits = 2  # small figures (pairs/s) keep two decimals
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(title, results, columns, reference):
    """A markdown table: one row per contender, each column's figure and its ratio to ``reference``'s."""
    lines = [
        f"### {title}",
        "",
        "| contender | " + " | ".join(columns) + f" | vs {reference} |",
        "|---" * (len(columns) + 2) + "|",
    ]
    base = results.get(reference, {})
    for kind, r in results.items():
        if "error" in r:
            lines.append(f"| {kind} | failed: {r['error']} |" + " |" * len(columns))
            continue
        first = columns[0]
        ratio = r[first] / base[first] if first in base and base[first] else None
        cells = [cell(r.get(c), 3 if c in ("MFU", "s/step") else 1 if "GiB" in c else 0) for c in columns]
        lines.append(f"| {kind} | " + " | ".join(cells) + f" | {cell(ratio, 2)}{'x' if ratio else ''} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen2.5-0.5b,llama-3.2-1b,llama-3.2-3b", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--budget", type=float, default=540, help="seconds of training in all (under ten minutes)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--out", default="gpu_table.md", help="the markdown table's file")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: sft, dpo, grpo")
    cli = parser.parse_args(argv)
    cli.models = cli.models.split(",")
    cli.bf16 = cli.device == "cuda"
    if cli.device == "cpu":
        torch.set_num_threads(1)
        cli.max_length, cli.rows = min(cli.max_length, 48), min(cli.rows, 32)
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    version = trl_version()
    attentions = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    sft_kinds = [k for k in SFT_CONTENDERS if version or not k.startswith("trl")]
    skip = set(cli.skip.split(",")) - {""}
    has_vllm = importlib.util.find_spec("vllm") is not None and cli.device == "cuda"
    grpo_kinds = ["hfacc"] + (["hfacc vLLM"] if has_vllm else []) + (["trl"] if version else [])
    runs = 0 if "sft" in skip else len(cli.models) * len(attentions) * len(sft_kinds)
    runs += (0 if "dpo" in skip else 1 + bool(version)) + (0 if "grpo" in skip else len(grpo_kinds))
    seconds = cli.budget / max(runs, 1)
    device = torch.cuda.get_device_name(0) if cli.device == "cuda" else "CPU"
    import transformers

    out = [
        "# hfacc on " + device,
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}, TRL {version or 'not installed'}, "
        f"{'bf16 autocast' if cli.bf16 else 'fp32'}, bs {BS} x GA {GA}, {seconds:.0f} s per contender (the first "
        f"{WARMUP} steps not timed); MFU against {cell(device_peak(cli.device) and device_peak(cli.device) / 1e12)} "
        "TFLOP/s dense bf16.",
        "",
    ]
    print(out[2], flush=True)
    if "sft" not in skip:
        for name in cli.models:
            vocab = MODELS[name][1]["vocab_size"]
            rows = chat_rows(cli.rows, vocab, cli.max_length)
            for attention in attentions:
                results = {}
                for kind in sft_kinds:
                    results[kind] = attempt(run_sft, kind, cli, name, attention, rows, seconds)
                    print(f"{name} {attention} {kind}: {results[kind]}", flush=True)
                columns = ["tokens/s", "target tokens/s", "peak GiB", "MFU", "steps"]
                reference = "stock" if "stock" in results else sft_kinds[0]
                out.append(table(f"SFT, {name}, {attention}", results, columns, reference))
    small = cli.models[0]
    if "dpo" not in skip:
        results = {
            kind: attempt(run_dpo, kind, cli, small, seconds) for kind in (["trl"] if version else []) + ["hfacc"]
        }
        print(f"DPO: {results}", flush=True)
        out.append(table(f"DPO, {small}, sdpa", results, ["pairs/s", "peak GiB", "steps"], next(iter(results))))
    if "grpo" not in skip:
        results = {kind: attempt(run_grpo, kind, cli, small, seconds) for kind in grpo_kinds}
        print(f"GRPO: {results}", flush=True)
        columns = ["completion tokens/s (training)", "completion tokens/s (sampling)", "s/step", "peak GiB"]
        reference = "trl" if "trl" in results else "hfacc"
        out.append(table(f"GRPO, {small} (the recipe's vocabulary), sdpa", results, columns, reference))
    text = "\n".join(out)
    Path(cli.out).write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
