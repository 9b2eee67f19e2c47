"""Reward models and KTO: hfacc vs TRL's RewardTrainer and KTOTrainer on the same models and data — throughput, peak
memory, update error.

    python benchmarks/reward_kto.py --threads 1                       # CPU, fp32: the numbers in benchmarks/README.md
    python benchmarks/reward_kto.py --rounds 1 --rows 16 --check-losses      # quicker; and TRL's loss code re-run
    python benchmarks/reward_kto.py --threads 1 --layouts                     # the reward model's time per layout

Three measurements per method, each side by side in this one process:

1. **Throughput**: a Llama-style model (vocab 32000, hidden 256, 4 layers; a sequence-classification head for the
   reward model), 32 pairs (KTO: their 64 unpaired rows, each with its KL row) with prompts of 32-256 tokens and
   answers of 8-256 (the same token ids for both trainers: TRL gets them pre-tokenized), bs 4 x GA 2; KTO with a given
   reference model (a copy of the policy) for both. Each round trains two epochs per contender and times the second
   (wall and process CPU time: the CPU time is the figure when the machine's load varies); rounds alternate the
   order; the ratio is the median of the per-round ratios. Pairs/s (reward) and rows/s (KTO).
2. **Peak memory** of one micro-batch's forward and backward, for the 4 longest examples: the PyTorch profiler's
   allocation events (:func:`hfacc.runtime.memory.peak_memory`); each trainer's own path (TRL: its collator and
   ``compute_loss``; hfacc: the padding-free layout, the KTO reference point's pass and the objective).
3. **Update error** under ragged accumulation, as the issue measured it: tiny models, 8 pairs (8 unpaired rows),
   one step, fp32; the relative error of the accumulated gradient against the hand-written big batch
   (tests/reward_kto_reference.py) for bs 8 x GA 1, 2 x 4, 1 x 8, 3 x 3 (micro-batches of 3, 3, 2). Reward: margins
   and centering 0.01. KTO: beta 0.5, and beta 1 with weights 1 / 1.5, a reference that differs from the policy (so
   that z0 > 0); TRL refuses micro-batches of one row (its KL estimate needs two).
"""

import argparse
import copy
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_quick, build_bench_model, median, trl_version  # noqa: E402
from datasets import Dataset  # noqa: E402
from dpo import Capture, common_args, word_tokenizer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForPreference,
    DataCollatorForUnpairedPreference,
    KTOObjective,
    RewardObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
)
from hfacc.models.loading import as_reward_model  # noqa: E402
from hfacc.ops.loss import WindowCounts  # noqa: E402
from hfacc.runtime.memory import peak_memory  # noqa: E402
from tests.preference_reference import make_pairs  # noqa: E402
from tests.reward_kto_reference import (  # noqa: E402
    kto_big_batch,
    kto_reference_logps,
    reward_big_batch,
    reward_pairs,
    tiny_reward_model,
    unpaired_rows,
)

BS, GA = 4, 2
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]
CENTER = 0.01
KTO_SETTINGS = [(0.5, 1.0, 1.0), (1.0, 1.0, 1.5)]  # (beta, desirable_weight, undesirable_weight)


# ---- the same data for both trainers -------------------------------------------------------------------------------
def bench_pairs(n, vocab, seed=0, prompts=(32, 256), answers=(8, 256)):
    pairs = make_pairs(n, vocab, seed=seed, answer_lengths=answers, prompt_lengths=prompts)
    for i, p in enumerate(pairs):
        p["margin"] = 0.25 * (i % 3)
    return pairs


def unpair(pairs):
    """hfacc's unpaired rows of ``pairs`` (chosen rows, then rejected rows; KL row: the previous row's completion)."""
    rows = []
    for side, label in (("chosen", True), ("rejected", False)):
        for p in pairs:
            start = next(i for i, y in enumerate(p[f"{side}_labels"]) if y != -100)
            rows.append({"prompt": p[f"{side}_input_ids"][:start], "completion": p[f"{side}_input_ids"][start:],
                         "label": label})  # fmt: skip
    return kto_rows(rows)


def kto_rows(raw):
    """``raw`` (prompt ids, completion ids, label) as hfacc's examples, the KL row borrowing the previous row's
    completion (cyclically): the pairing both trainers get."""
    out = []
    for i, r in enumerate(raw):
        other = raw[i - 1]["completion"]
        out.append({
            "completion_input_ids": r["prompt"] + r["completion"],
            "completion_labels": [-100] * len(r["prompt"]) + r["completion"],
            "label": r["label"],
            "kl_input_ids": r["prompt"] + other,
            "kl_labels": [-100] * len(r["prompt"]) + other,
        })  # fmt: skip
    return out


def trl_reward_rows(pairs):
    return [{"chosen_ids": p["chosen_input_ids"], "rejected_ids": p["rejected_input_ids"], "margin": p["margin"]}
            for p in pairs]  # fmt: skip


def trl_kto_rows(rows):
    out = []
    for r in rows:
        start = next(i for i, y in enumerate(r["completion_labels"]) if y != -100)
        kl_start = next(i for i, y in enumerate(r["kl_labels"]) if y != -100)
        out.append({"prompt_ids": r["completion_input_ids"][:start], "completion_ids": r["completion_input_ids"][start:],
                    "KL_completion_ids": r["kl_input_ids"][kl_start:], "label": r["label"]})  # fmt: skip
    return out


# ---- the trainers ------------------------------------------------------------------------------------------------
def trl_reward_trainer(model, pairs, tmp, bs, ga, epochs=2, center=CENTER, **extra):
    from trl import RewardConfig, RewardTrainer

    config = RewardConfig(**common_args(tmp, bs, ga, epochs, **extra), center_rewards_coefficient=center,
                          max_length=None, gradient_checkpointing=False)  # fmt: skip
    return RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(trl_reward_rows(pairs)),
                         processing_class=word_tokenizer(model.config.vocab_size))  # fmt: skip


def hfacc_reward_trainer(model, pairs, tmp, bs, ga, epochs=2, center=CENTER, **extra):
    args = TokenWeightedArguments(**common_args(tmp, bs, ga, epochs, **extra))
    return TokenWeightedTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                data_collator=DataCollatorForPreference(0), objective=RewardObjective(center))  # fmt: skip


def trl_kto_trainer(model, ref, rows, tmp, bs, ga, epochs=2, setting=(0.1, 1.0, 1.0), **extra):
    from trl import KTOConfig, KTOTrainer

    class PreTokenized(KTOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # tokenized, KL rows paired: the same as hfacc's
            return dataset

    beta, desirable, undesirable = setting
    config = KTOConfig(**common_args(tmp, bs, ga, epochs, **extra), beta=beta, desirable_weight=desirable,
                       undesirable_weight=undesirable, max_length=None, gradient_checkpointing=False,
                       remove_unused_columns=False)  # fmt: skip
    return PreTokenized(model=model, ref_model=ref, args=config, train_dataset=Dataset.from_list(trl_kto_rows(rows)),
                        processing_class=word_tokenizer(model.config.vocab_size))  # fmt: skip


def hfacc_kto_trainer(model, ref, rows, tmp, bs, ga, epochs=2, setting=(0.1, 1.0, 1.0), **extra):
    beta, desirable, undesirable = setting
    args = TokenWeightedArguments(**common_args(tmp, bs, ga, epochs, **extra))
    objective = KTOObjective(beta=beta, desirable_weight=desirable, undesirable_weight=undesirable, ref_model=ref)
    return TokenWeightedTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                data_collator=DataCollatorForUnpairedPreference(0), objective=objective)  # fmt: skip


class EpochTimer(TrainerCallback):
    """Wall and process CPU seconds of each epoch."""

    def __init__(self):
        self.wall, self.cpu, self._start = [], [], None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), time.process_time())

    def on_epoch_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])


def throughput(method, kind, cli, data):
    """``(per wall second, per CPU second)`` of the second epoch: pairs (reward) or rows (KTO)."""
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as tmp:
        if method == "reward":
            model = as_reward_model(build_bench_model(cli.vocab, cli.hidden, cli.layers), pad_token_id=0)
            runner = trl_reward_trainer if kind == "trl" else hfacc_reward_trainer
            trainer = runner(model, data, tmp, BS, GA, learning_rate=1e-4)
        else:
            model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
            runner = trl_kto_trainer if kind == "trl" else hfacc_kto_trainer
            trainer = runner(model, copy.deepcopy(model), data, tmp, BS, GA, learning_rate=1e-4)
        trainer.add_callback(timer)
        trainer.train()
    return len(data) / timer.wall[-1], len(data) / timer.cpu[-1]


def memory(method, cli, data):
    """Peak bytes of one micro-batch's forward and backward for the 4 longest examples, each trainer's own path."""
    size = lambda e: sum(len(v) for k, v in e.items() if k.endswith("input_ids"))  # noqa: E731
    longest = sorted(data, key=lambda e: -size(e))[:BS]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in cli.kinds:
            if method == "reward":
                model = as_reward_model(build_bench_model(cli.vocab, cli.hidden, cli.layers), pad_token_id=0)
                trainer = (trl_reward_trainer if kind == "trl" else hfacc_reward_trainer)(
                    model, longest, tmp, BS, 1, 1
                )
                raw = trl_reward_rows(longest) if kind == "trl" else longest
            else:
                model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
                runner = trl_kto_trainer if kind == "trl" else hfacc_kto_trainer
                trainer = runner(model, copy.deepcopy(model), longest, tmp, BS, 1, 1)
                raw = trl_kto_rows(longest) if kind == "trl" else longest
            batch = trainer.data_collator(raw)
            trainer.model.train()
            if kind == "trl":
                results[kind] = peak_memory(trl_step(trainer, batch), cli.device)
            else:
                setup = trainer.setup_model(batch)  # the per-model decisions training takes
                results[kind] = peak_memory(hfacc_step(trainer, setup, batch), cli.device)
                results["hfacc layout"] = (
                    f"padding-free {setup.padding_free}, shared prompts {setup.shared_prompts is not None}, "
                    f"loss path {setup.loss_path}"
                )
    return results


def trl_step(trainer, batch):
    return lambda: trainer.compute_loss(trainer.model, dict(batch)).backward()


def hfacc_step(trainer, setup, batch):
    """One micro-batch as training runs it: the window's statistics (KTO's reference point), the padding-free layout,
    the objective's loss over the window's counts, its backward."""
    objective = trainer.objective
    laid = trainer._layout(batch)  # as training lays it out (shared-prompt pairs, padding-free rows, or padded)
    counts = objective.count(batch).tolist()
    window = WindowCounts(counts[0], counts[1], 1, tuple(counts))

    def step():
        statistics = objective.window_statistics(trainer.model, [batch], layout=trainer._layout)
        _, sums = objective(trainer.model, {**laid, **statistics})
        objective.loss(sums, window).backward()

    return step


# ---- where the reward model's time goes: one epoch's micro-batches, forward and backward, per layout -----------------
def layout_profile(cli, pairs, rounds):
    """CPU seconds of the forward and backward of every micro-batch of an epoch (bs 4), interleaved over ``rounds``,
    for TRL's padded path and hfacc's layouts, with the positions each computes (real tokens: what a layout
    holds once)."""
    from hfacc.data.padding_free import remove_padding
    from hfacc.data.shared_prompts import get_attention_width, share_prompts

    model = as_reward_model(build_bench_model(cli.vocab, cli.hidden, cli.layers), pad_token_id=0)
    model.train()
    collate, objective = DataCollatorForPreference(0), RewardObjective(CENTER)
    batches = [collate(pairs[i : i + BS]) for i in range(0, len(pairs), BS)]
    width = get_attention_width(model.config)
    layouts = {
        "hfacc padded": lambda b: b,
        "hfacc packed rows (shared_prompts=False)": lambda b: remove_padding(b, False, keep=objective.row_keys),
        "hfacc shared prompts, rows as wide as the longest pair": lambda b: share_prompts(b, 0, keep=["margin"]),
        f"hfacc shared prompts, rows by cost (attention width {width}; the default)": lambda b: share_prompts(
            b, 0, keep=["margin"], attention_width=width
        ),
    }

    def hfacc_layout_step(lay):
        return lambda b: objective(model, lay(b))[1].loss.sum().backward()

    steps = {name: hfacc_layout_step(lay) for name, lay in layouts.items()}
    if "trl" in cli.kinds:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = trl_reward_trainer(model, pairs, tmp, BS, 1, 1)
            trl_batches = [trainer.data_collator(trl_reward_rows(pairs[i : i + BS])) for i in range(0, len(pairs), BS)]
        steps = {"TRL RewardTrainer (padded)": lambda b: trl_step(trainer, b)(), **steps}
    held = {name: sum(int(lay(b)["input_ids"].numel()) for b in batches) for name, lay in layouts.items()}
    held["TRL RewardTrainer (padded)"] = held["hfacc padded"]
    seconds = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps)[:: 1 if r % 2 == 0 else -1]:
            start = time.process_time()
            for j, b in enumerate(batches):
                steps[name](trl_batches[j] if name.startswith("TRL") else b)
            model.zero_grad(set_to_none=True)
            seconds[name].append(time.process_time() - start)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    once = sum(int(share_prompts(b)["layout_index"].unique().numel()) - 1 for b in batches)  # each prompt once
    base = next(iter(steps))
    print(f"\nforward and backward of the {len(batches)} micro-batches, CPU seconds (median of {rounds} interleaved); "
          f"{real} real tokens, {once} with each prompt once")  # fmt: skip
    print(f"| path | positions computed | CPU s | vs {base} |")
    print("|---|---|---|---|")
    for name, times in seconds.items():
        print(f"| {name} | {held[name]} | {median(times):.2f} | {median(seconds[base]) / median(times):.2f}x |")


# ---- the update error under ragged accumulation -------------------------------------------------------------------
def relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def update_errors(kinds=("trl", "hfacc"), splits=SPLITS, kto_settings=KTO_SETTINGS):
    """Relative error of each trainer's accumulated gradient vs the hand-written big batch (tiny models, fp32)."""
    from hfacc import build_tiny_llama

    out, own = {}, {}
    pairs = reward_pairs(8)
    for bs, ga in splits:
        for kind in kinds:
            model = tiny_reward_model()
            want, _, _ = reward_big_batch(model, pairs, CENTER)
            with tempfile.TemporaryDirectory() as tmp:
                runner = trl_reward_trainer if kind == "trl" else hfacc_reward_trainer
                trainer = runner(model, pairs, tmp, bs, ga, 1, learning_rate=0.0, max_grad_norm=0.0)
                capture = Capture(model)
                trainer.add_callback(capture)
                trainer.train()
            out[("reward", bs, ga, kind)] = relative(capture.grads[0], want)
            if (bs, ga) == splits[0]:
                own[kind] = capture.grads[0]  # the trainer's own bs 8 x GA 1 step
            out[("reward", bs, ga, kind, "own")] = relative(capture.grads[0], own[kind])
    rows = unpaired_rows(8)
    for setting in kto_settings:
        for bs, ga in splits:
            for kind in kinds:
                model = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=0)
                ref = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=1)
                with torch.no_grad():
                    ref.lm_head.weight.mul_(10.0)  # a reference the policy differs from: z0 > 0
                want, _, _ = kto_big_batch(model, rows, kto_reference_logps(ref, rows), *setting)
                if kind == "trl" and bs == 1:
                    out[("kto", setting, bs, ga, kind)] = None  # TRL: "Actual (not effective) batch size must be > 1"
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    runner = trl_kto_trainer if kind == "trl" else hfacc_kto_trainer
                    trainer = runner(model, ref, rows, tmp, bs, ga, 1, setting, learning_rate=0.0, max_grad_norm=0.0)
                    capture = Capture(model)
                    trainer.add_callback(capture)
                    trainer.train()
                out[("kto", setting, bs, ga, kind)] = relative(capture.grads[0], want)
                if (bs, ga) == splits[0]:
                    own[kind] = capture.grads[0]
                out[("kto", setting, bs, ga, kind, "own")] = relative(capture.grads[0], own[kind])
    return out


# ---- TRL's loss code on the tests' values ---------------------------------------------------------------------------
def check_losses():
    """TRL's own loss code (RewardTrainer.compute_loss, KTOTrainer._compute_loss) on the scores and log-probs of
    tests/test_reward.py and tests/test_kto.py: the values written there (the worst relative difference)."""
    from accelerate import Accelerator
    from trl import KTOTrainer, RewardTrainer

    from tests import test_kto as k
    from tests import test_reward as r

    accelerator = Accelerator(cpu=True)
    worst = 0.0

    def reward_model(**kwargs):
        return types.SimpleNamespace(logits=torch.cat([r.CHOSEN, r.REJECTED])[:, None])

    reward_model.training = True
    for (center, with_margin), want in r.TRL_REWARD.items():
        trainer = types.SimpleNamespace(model=reward_model, accelerator=accelerator, _total_train_tokens=0, _tp_size=1,
                                        args=types.SimpleNamespace(center_rewards_coefficient=center),
                                        _metrics={"train": defaultdict(list)})  # fmt: skip
        n = 2 * len(r.CHOSEN)
        inputs = {
            "input_ids": torch.ones(n, 4, dtype=torch.long),
            "attention_mask": torch.ones(n, 4, dtype=torch.long),
        }
        if with_margin:
            inputs["margin"] = r.MARGIN
        got = RewardTrainer.compute_loss(trainer, reward_model, inputs).item()
        worst = max(worst, abs(got - want) / abs(want))
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        worst = max(worst, *(abs(metrics[key] - v) / max(abs(v), 1e-9) for key, v in r.TRL_REWARD_METRICS.items()))
    rows, width = len(k.LABEL), 8

    def kto_model(input_ids=None, **kwargs):
        values = torch.zeros(rows, width - 1)
        values[:, -1] = k.KL_LOGPS if (input_ids == 2).all() else k.LOGPS  # the KL rows are the ids 2
        zeros = torch.zeros_like(values)
        return types.SimpleNamespace(log_probs=values, entropy=zeros, mean_logits=zeros)

    kto_model.training = True
    completion = torch.zeros(rows, width, dtype=torch.long)
    completion[:, -1] = 1
    for (beta, desirable, undesirable), (want, metrics_want) in k.TRL_KTO.items():
        trainer = types.SimpleNamespace(
            model=kto_model, accelerator=accelerator, calculate_KL=True, precompute_ref_logps=True,
            aux_loss_enabled=False, loss_type="kto", beta=beta, desirable_weight=desirable,
            undesirable_weight=undesirable, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        )  # fmt: skip
        trainer._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, trainer)
        ones = torch.ones(rows, width, dtype=torch.long)
        inputs = {"input_ids": ones, "attention_mask": ones, "completion_mask": completion, "KL_input_ids": 2 * ones,
                  "KL_attention_mask": ones, "KL_completion_mask": completion, "label": k.LABEL, "ref_logps": k.REF,
                  "ref_KL_logps": k.REF_KL}  # fmt: skip
        got = KTOTrainer._compute_loss(trainer, kto_model, inputs, False).item()
        worst = max(worst, abs(got - want) / abs(want))
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        expected = {**metrics_want, **k.TRL_KTO_METRICS}
        worst = max(worst, *(abs(metrics[key] - v) / max(abs(v), 1e-9) for key, v in expected.items()))
    return worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=32, help="pairs (KTO: their 2x unpaired rows)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--check-losses", action="store_true", help="re-run TRL's loss code on the tests' values")
    parser.add_argument("--only", choices=["reward", "kto"], default=None, help="one method only")
    parser.add_argument("--layouts", action="store_true", help="reward: the forward and backward per layout only")
    add_quick(parser)
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.rounds, cli.rows, cli.vocab, cli.hidden, cli.layers = 1, 8, 256, 32, 1
    if cli.threads:
        torch.set_num_threads(cli.threads)
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    version = trl_version()
    cli.kinds = ["trl", "hfacc"] if version else ["hfacc"]
    if cli.check_losses and version:
        print(f"TRL {version}'s loss code vs the values in tests/test_reward.py, test_kto.py: {check_losses():.1e}")
    pairs = bench_pairs(cli.rows, cli.vocab, **(dict(prompts=(4, 24), answers=(2, 24)) if cli.quick else {}))
    data = {"reward": pairs, "kto": unpair(pairs)}
    if cli.layouts:
        layout_profile(cli, pairs, cli.rounds)
        return
    base = cli.kinds[0]
    for method in [cli.only] if cli.only else ["reward", "kto"]:
        examples = data[method]
        unit = "pairs" if method == "reward" else "rows"
        tokens = sum(len(v) for e in examples for key, v in e.items() if key.endswith("input_ids"))
        print(
            f"\n{method}: TRL {version or 'not installed: its contenders left out'}; {len(examples)} {unit} ({tokens} "
            f"tokens), bs {BS} x GA {GA}, vocab {cli.vocab}, hidden {cli.hidden}, {cli.layers} layers, fp32, torch "
            f"threads {torch.get_num_threads()}"
        )
        speed = {k: [] for k in cli.kinds}
        for r in range(cli.rounds):
            for kind in cli.kinds if r % 2 == 0 else cli.kinds[::-1]:
                speed[kind].append(throughput(method, kind, cli, examples))
            print(f"round {r + 1}: " + ", ".join(f"{k} {speed[k][-1][0]:.2f} (CPU {speed[k][-1][1]:.2f})"
                                                 for k in speed) + f" {unit}/s", flush=True)  # fmt: skip
        peak = memory(method, cli, examples)
        print(f"\n| contender | {unit}/s wall (median) | {unit}/s CPU (median) | vs {base} (CPU) | micro-batch peak MiB "
              f"| vs {base} |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for kind in cli.kinds:
            ratio = median([a[1] / b[1] for a, b in zip(speed[kind], speed[base], strict=True)])
            wall, cpu = median([s[0] for s in speed[kind]]), median([s[1] for s in speed[kind]])
            mem = peak[kind] / 2**20
            print(f"| {kind} | {wall:.2f} | {cpu:.2f} | {ratio:.2f}x | {mem:.1f} | {peak[kind] / peak[base]:.2f}x |")
        print(f"(hfacc: {peak['hfacc layout']})")
    splits = SPLITS[::3] if cli.quick else SPLITS  # --quick: 8 x 1 and the ragged 3 x 3
    settings = KTO_SETTINGS[1:] if cli.quick else KTO_SETTINGS
    errors = update_errors(cli.kinds, splits, settings)
    print("\nupdate error vs the big batch (tiny models, 8 pairs / 8 unpaired rows, fp32):")
    print("| loss | bs x GA | " + " | ".join(f"{k} | (vs its own 8 x 1)" for k in cli.kinds) + " |")
    print("|---|---|" + "---|---|" * len(cli.kinds))
    rows = [(f"reward (margins, centering {CENTER})", ("reward",), split) for split in splits]
    rows += [(f"KTO (beta {s[0]}, weights {s[1]} / {s[2]})", ("kto", s), split) for s in settings for split in splits]
    for name, key, (bs, ga) in rows:
        cells = []
        for kind in cli.kinds:
            error = errors[(*key, bs, ga, kind)]
            own = errors.get((*key, bs, ga, kind, "own"))
            cells += ["refused", "-"] if error is None else [f"{error:.1e}", f"{own:.1e}"]
        print(f"| {name} | {bs} x {ga} | " + " | ".join(cells) + " |")
    return errors


if __name__ == "__main__":
    main()
