"""DPO: hfacc vs TRL's DPOTrainer on the same model, pairs, bs and GA — pairs/s, peak memory, update error.

    python benchmarks/dpo.py                     # CPU, fp32: the numbers in benchmarks/README.md (~10 minutes)
    python benchmarks/dpo.py --rounds 1 --pairs 16 --check-losses    # quicker; and TRL's loss code re-run

Three measurements, each side by side in this one process:

1. **Throughput**: a Llama-style model (vocab 32000, hidden 256, 4 layers), 32 pairs with prompts of 32-256 tokens
   and answers of 8-256 (the same token ids for both trainers: TRL gets them pre-tokenized), bs 4 x GA 2, a given
   reference model (a copy of the policy) for both, the sigmoid loss. Each round trains two epochs per contender
   and times the second; rounds alternate the order; the ratio is the median of the per-round ratios.
2. **Peak memory** of one micro-batch's forward and backward (policy and reference), for the 4 longest pairs: the
   PyTorch profiler's allocation events (CPU) or CUDA's statistics; each trainer's own path (TRL: its collator and
   ``compute_loss``; hfacc: the padding-free layout and the objective as training runs them).
3. **Update error** as the issue measured it: a tiny Llama, 8 pairs with answers of 1-14 tokens, one step, fp32;
   the relative error of the accumulated gradient against the hand-written big batch
   (tests/preference_reference.py), for bs 8 x GA 1, 2 x 4, 1 x 8, 3 x 3 (micro-batches of 3, 3, 2), with the
   sigmoid loss and with the NLL term (TRL: ``loss_type=["sigmoid", "sft"]``).
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
from transformers import TrainerCallback  # noqa: E402

from hfacc import DataCollatorForPreference, DPOObjective, TokenWeightedArguments, TokenWeightedTrainer  # noqa: E402
from hfacc.data.padding_free import remove_padding  # noqa: E402
from hfacc.runtime.memory import peak_memory  # noqa: E402
from tests.preference_reference import big_batch, make_pairs, reference_logps  # noqa: E402

BS, GA = 4, 2
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]


def build_pairs(n, vocab, seed=0, prompts=(32, 256), answers=(8, 256)):
    """Random-token pairs, as hfacc builds them (chosen/rejected input_ids and labels -100 on the prompt)."""
    return make_pairs(n, vocab, seed=seed, answer_lengths=answers, prompt_lengths=prompts)


def trl_rows(pairs):
    """The same pairs as TRL's pre-tokenized rows: prompt_ids, chosen_ids, rejected_ids."""
    rows = []
    for p in pairs:
        start = next(i for i, y in enumerate(p["chosen_labels"]) if y != -100)
        rows.append(
            {
                "prompt_ids": p["chosen_input_ids"][:start],
                "chosen_ids": p["chosen_input_ids"][start:],
                "rejected_ids": p["rejected_input_ids"][start:],
            }
        )
    return rows


def word_tokenizer(vocab_size):
    """A tokenizer TRL accepts for pre-tokenized data: word-level over the id range, pad = id 0."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t1"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", eos_token="t2", unk_token="t1")


def common_args(tmp, bs, ga, epochs, **extra):
    """The settings both trainers get. ``bf16=False`` said outright: TRL's configs default to ``bf16=True`` (its
    DPOConfig, RewardConfig and KTOConfig), which on a CPU with bf16 units ran TRL in bf16 autocast against hfacc in
    fp32 (the reward model's "0.65x TRL" of issue 38 was that)."""
    settings = dict(
        output_dir=tmp,
        bf16=False,
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        num_train_epochs=epochs,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
        dataloader_pin_memory=False,
        train_sampling_strategy="sequential",
    )
    return {**settings, **extra}  # benchmarks/gpu.py: use_cpu=False, bf16=True


def trl_trainer(model, ref, pairs, tmp, bs, ga, epochs=2, loss_type=("sigmoid",), weights=None, **extra):
    from trl import DPOConfig, DPOTrainer

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # the rows are tokenized already (same ids as hfacc)
            return dataset

    config = DPOConfig(
        **common_args(tmp, bs, ga, epochs, **extra),
        beta=0.1,
        loss_type=list(loss_type),
        loss_weights=weights,
        max_length=None,
        remove_unused_columns=False,
    )
    vocab = model.config.vocab_size
    return PreTokenized(
        model=model,
        ref_model=ref,
        args=config,
        train_dataset=Dataset.from_list(trl_rows(pairs)),
        processing_class=word_tokenizer(vocab),
    )


def hfacc_trainer(model, ref, pairs, tmp, bs, ga, epochs=2, nll_weight=0.0, **extra):
    args = TokenWeightedArguments(**common_args(tmp, bs, ga, epochs, **extra))
    return TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        data_collator=DataCollatorForPreference(0),
        objective=DPOObjective(beta=0.1, nll_weight=nll_weight, ref_model=ref),
    )


RUNNERS = {"trl": trl_trainer, "hfacc": hfacc_trainer}


class EpochTimer(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def pairs_per_second(kind, cli, pairs):
    model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
    timer = EpochTimer()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = RUNNERS[kind](model, copy.deepcopy(model), pairs, tmp, BS, GA, learning_rate=1e-4)
        trainer.add_callback(timer)
        trainer.train()
    return len(pairs) / timer.times[-1]


def memory(cli, pairs):
    """Peak bytes of one micro-batch's forward and backward (policy + reference) for the 4 longest pairs."""
    longest = sorted(pairs, key=lambda p: -len(p["chosen_input_ids"]) - len(p["rejected_input_ids"]))[:BS]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if cli.trl:
            model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
            trainer = trl_trainer(model, copy.deepcopy(model), longest, tmp, BS, 1, epochs=1)
            trl_batch = trainer.data_collator(trl_rows(longest))
            trainer.model.train()
            results["trl"] = peak_memory(lambda: trainer.compute_loss(trainer.model, trl_batch).backward(), cli.device)

        model = build_bench_model(cli.vocab, cli.hidden, cli.layers)
        trainer = hfacc_trainer(model, copy.deepcopy(model), longest, tmp, BS, 1, epochs=1)
        batch = DataCollatorForPreference(0)(longest)
        setup = trainer.setup_model(batch)  # the per-model decisions training takes: layout, loss path, reference
        objective = trainer.objective
        laid = remove_padding(batch, setup.one_row, keep=objective.row_keys) if setup.padding_free else batch
        counts = torch.as_tensor(objective.count(batch)).tolist()
        from hfacc.ops.loss import WindowCounts

        window = WindowCounts(counts[0], counts[1], 1, tuple(counts))

        def hfacc_step():
            _, sums = objective(trainer.model, laid)
            objective.loss(sums, window).backward()

        trainer.model.train()
        results["hfacc"] = peak_memory(hfacc_step, cli.device)
        results["hfacc layout"] = f"padding-free {setup.padding_free}, loss path {setup.loss_path}"
    return results


class Capture(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.model.parameters() if p.grad is not None]))


def update_errors(kinds=("trl", "hfacc"), splits=SPLITS):
    """Relative error of the accumulated gradient vs the hand-written big batch, as the issue measured it."""
    from hfacc import build_tiny_llama

    pairs = make_pairs(8, 64, seed=0)
    out = {}
    for nll in (0.0, 1.0):
        for bs, ga in splits:
            for kind in kinds:
                model = build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, seed=0)
                want, _ = big_batch(model, pairs, "sigmoid", reference_logps(model, pairs), nll, beta=0.1, eps=0.0)
                with tempfile.TemporaryDirectory() as tmp:
                    if kind == "trl":
                        extra = dict(loss_type=("sigmoid", "sft"), weights=[1.0, nll]) if nll else {}
                        trainer = trl_trainer(model, copy.deepcopy(model), pairs, tmp, bs, ga, 1, **extra)
                    else:
                        trainer = hfacc_trainer(model, copy.deepcopy(model), pairs, tmp, bs, ga, 1, nll_weight=nll)
                    capture = Capture(model)
                    trainer.add_callback(capture)
                    trainer.args.learning_rate, trainer.args.max_grad_norm = 0.0, 0.0
                    trainer.train()
                got = capture.grads[0].double()
                out[(nll, bs, ga, kind)] = ((got - want.double()).norm() / want.double().norm()).item()
                if (bs, ga) == splits[0]:
                    own = got  # the trainer's own bs 8 x GA 1 step, what the issue compared TRL with
                out[(nll, bs, ga, kind, "own")] = ((got - own).norm() / own.norm()).item()
    return out


def check_losses():
    """TRL's own loss code (DPOTrainer._compute_loss, CPOTrainer.cpo_loss) on the log-probs of
    tests/test_preference.py: the values written there."""
    from accelerate import Accelerator
    from trl import DPOTrainer
    from trl.experimental.cpo import CPOTrainer

    from tests import test_preference as t

    accelerator = Accelerator(cpu=True)
    chosen, rejected = t.CHOSEN, t.REJECTED
    lengths = t.CHOSEN_LENGTHS.tolist() + t.REJECTED_LENGTHS.tolist()
    b, width = len(chosen), 16
    completion = torch.zeros(2 * b, width, dtype=torch.long)
    token_logps = torch.zeros(2 * b, width - 1)
    for i, (n, total) in enumerate(zip(lengths, torch.cat([chosen, rejected]).tolist(), strict=True)):
        completion[i, width - n :] = 1
        token_logps[i, width - n - 1 :] = total / n

    def model(**kwargs):
        zeros = torch.zeros_like(token_logps)
        return types.SimpleNamespace(log_probs=token_logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model.training = True
    worst = 0.0
    for loss_type, (smoothing, want) in {**t.TRL_DPO, "sft": (0.0, t.TRL_SFT)}.items():
        trainer = types.SimpleNamespace(
            model=model, accelerator=accelerator, ld_alpha=None, precompute_ref_logps=True, aux_loss_enabled=False,
            f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=0.1,
            label_smoothing=smoothing, use_weighting=False, _metrics={"train": defaultdict(list)},
            _total_train_tokens=0, _tp_size=1, args=None,
        )  # fmt: skip
        inputs = {
            "input_ids": torch.ones(2 * b, width, dtype=torch.long),
            "attention_mask": torch.ones(2 * b, width, dtype=torch.long),
            "completion_mask": completion,
            "ref_chosen_logps": t.REF_CHOSEN,
            "ref_rejected_logps": t.REF_REJECTED,
        }
        got = DPOTrainer._compute_loss(trainer, model, inputs, False).item()
        worst = max(worst, abs(got - want) / abs(want))
    lengths_c, lengths_r = t.CHOSEN_LENGTHS.float(), t.REJECTED_LENGTHS.float()
    for smoothing, want in t.TRL_SIMPO.items():
        cpo = types.SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=smoothing,
                                    accelerator=accelerator)  # fmt: skip
        losses, _, _ = CPOTrainer.cpo_loss(cpo, chosen / lengths_c, rejected / lengths_r)
        worst = max(worst, max(abs(a - w) / abs(w) for a, w in zip(losses.tolist(), want, strict=True)))
    return worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--check-losses", action="store_true", help="re-run TRL's loss code on the tests' log-probs")
    add_quick(parser)
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.rounds, cli.pairs, cli.vocab, cli.hidden, cli.layers = 1, 8, 256, 32, 1
    if cli.threads:
        torch.set_num_threads(cli.threads)
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    version = trl_version()
    cli.trl = version is not None
    kinds = [k for k in RUNNERS if cli.trl or k != "trl"]

    if cli.check_losses and cli.trl:
        print(f"TRL {version}'s loss code vs the values in tests/test_preference.py: {check_losses():.1e}")
    pairs = build_pairs(cli.pairs, cli.vocab, **(dict(prompts=(4, 24), answers=(2, 24)) if cli.quick else {}))
    tokens = sum(len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in pairs)
    print(
        f"TRL {version or 'not installed: its contenders left out'}; {cli.pairs} pairs ({tokens} tokens), bs {BS} x "
        f"GA {GA}, vocab {cli.vocab}, hidden {cli.hidden}, {cli.layers} layers, fp32, torch threads "
        f"{torch.get_num_threads()}"
    )
    speed = {k: [] for k in kinds}
    for r in range(cli.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            speed[kind].append(pairs_per_second(kind, cli, pairs))
        print(f"round {r + 1}: " + ", ".join(f"{k} {speed[k][-1]:.2f}" for k in kinds) + " pairs/s", flush=True)
    peak = memory(cli, pairs)
    base = kinds[0]
    print(f"\n| contender | pairs/s (median) | vs {base} | micro-batch peak MiB | vs {base} |")
    print("|---|---|---|---|---|")
    for kind in kinds:
        ratio = median([a / b for a, b in zip(speed[kind], speed[base], strict=True)])
        mem = peak[kind] / 2**20
        print(f"| {kind} | {median(speed[kind]):.2f} | {ratio:.2f}x | {mem:.1f} | {peak[kind] / peak[base]:.2f}x |")
    print(f"(hfacc: {peak['hfacc layout']})")
    splits = SPLITS[::3] if cli.quick else SPLITS  # --quick: 8 x 1 and the ragged 3 x 3
    errors = update_errors(kinds, splits)
    print("\nupdate error vs the big batch (tiny Llama, 8 pairs, answers 1-14 tokens, fp32):")
    print("| loss | bs x GA | " + " | ".join(f"{k} | (vs its own {splits[0][0]} x 1)" for k in kinds) + " |")
    print("|---|---|" + "---|---|" * len(kinds))
    for nll in (0.0, 1.0):
        for bs, ga in splits:
            name = "sigmoid + NLL (1.0)" if nll else "sigmoid"
            cells = [f"{errors[(nll, bs, ga, k)]:.1e} | {errors[(nll, bs, ga, k, 'own')]:.1e}" for k in kinds]
            print(f"| {name} | {bs} x {ga} | " + " | ".join(cells) + " |")
    return errors


if __name__ == "__main__":
    main()
