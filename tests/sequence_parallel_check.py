"""DeepSpeed Ulysses sequence parallelism through accelerate: every split of one window against one big batch.

    accelerate launch --config_file accelerate_configs/deepspeed_ulysses.yaml --num_processes 2 --mixed_precision no \
        tests/sequence_parallel_check.py OUT.json

One launch per layout (sp 2; dp 2 x sp 2 with 4 processes) runs every case; rank 0 writes the errors to OUT.json,
which tests/test_sequence_parallel.py asserts. Each case is one SGD step of TokenWeightedTrainer on all 8 examples
(the long ones cross the shard boundary, the short ones leave a shard without targets), its applied update recovered
as (weights before - after) / lr; the controls break one rule of hfacc/runtime/sequence_parallel.py each. Then DPO on
8 pairs against its big batch, and its control: each shard's sigmoid of its own sums, the pair counted on every shard.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import Dataset  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import hfacc.objectives.preference as preference_module  # noqa: E402
import hfacc.training.trainer as trainer_module  # noqa: E402
from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama  # noqa: E402
from hfacc.cli import main as main_cli  # noqa: E402
from hfacc.jobs.console import end_process_group  # noqa: E402
from hfacc.ops.loss import WindowCounts  # noqa: E402
from tests.distributed_check import imbalanced_examples  # noqa: E402
from tests.engine_check import full_parameters  # noqa: E402
from tests.helpers import full_batch_causal_lm, relative_error, train_args  # noqa: E402
from tests.preference_check import COLLATE, objective_for, tiny  # noqa: E402
from tests.preference_reference import big_batch, imbalanced_pairs, reference_logps  # noqa: E402

SDPA = ALL_ATTENTION_FUNCTIONS["sdpa"]
LR = 1e4  # (before - after) / lr keeps the gradient's fp32 digits
EXAMPLES = 8
PAIRS = 8  # long and short answers alternating: a pair's rows cross the shard boundary, or leave a shard empty


def reference_case(examples):
    """The big batch, before any trainer: DeepSpeed registers its Ulysses attention with transformers for the
    process, after which a model's forward expects a shard."""
    return full_batch_causal_lm(build_tiny_llama(vocab_size=96), examples)[:2]


def trainer_case(examples, bs, ga, reference, token_loss):
    applied, trainer = run_case(build_tiny_llama(vocab_size=96), examples, bs, ga)  # the same weights (seeded)
    return {
        "grad_error": relative_error(applied, reference),
        "loss_error": abs(trainer.state.log_history[0]["loss"] - token_loss) / token_loss,
        "steps": trainer.state.global_step,
        "sp_size": trainer.sp_size,
        "fused": trainer.objective.fused,
    }


def run_case(model, examples, bs, ga, collator=None, objective=None):
    """One SGD step of TokenWeightedTrainer on ``examples``: ``(the applied update, the trainer)``."""
    before = torch.cat([p.detach().float().flatten().clone() for p in model.parameters()])
    args = train_args(
        Path(tempfile.mkdtemp()),
        bs,
        ga,
        args_class=TokenWeightedArguments,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        ddp_timeout=120,
        use_cpu=True,
    )
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        data_collator=collator or DataCollatorForCausalLM(pad_token_id=0),
        objective=objective,
    )
    trainer.train()
    # DeepSpeed keeps its sequence groups per process (and refuses to make them twice) and puts its attention in
    # transformers' table for the process: undone, so that the next case starts as a new run would.
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp._release_sequence_parallel_groups()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = SDPA
    return (before - full_parameters(trainer.model)) / LR, trainer


def dpo_reference():
    """DPO's big batch (sigmoid with label smoothing and the NLL term; the reference another model, so that the
    margins are not 0 and the sigmoid bends): all pairs in one forward of plain torch (tests/preference_reference.py)."""
    pairs = imbalanced_pairs(PAIRS, vocab=96)
    return pairs, big_batch(tiny(0, 96), pairs, "sigmoid", reference_logps(tiny(1, 96), pairs), 0.5)


def dpo_case(pairs, bs, ga, want, want_loss):
    """The DPO objective on Ulysses shards: each pair's chosen and rejected rows cut over the sequence group; the
    reference model computed on the same shards."""
    objective = objective_for("sigmoid", 0.5, ref_model=tiny(1, 96))
    applied, trainer = run_case(tiny(0, 96), pairs, bs, ga, COLLATE, objective)
    log = trainer.state.log_history[0]
    return {
        "grad_error": relative_error(applied, want),
        "loss_error": abs(log["loss"] - want_loss) / abs(want_loss),
        "num_pairs": log["num_pairs"],
        "steps": trainer.state.global_step,
        "sp_size": trainer.sp_size,
    }


def data_groups(world, sp):
    """For every rank, the group of ranks that hold the same sequence shard (DeepSpeed's sequence groups are
    consecutive ranks); new_group is a collective, so every rank makes all of them."""
    groups = [dist.new_group([r for r in range(world) if r % sp == s]) for s in range(sp)]
    return groups[dist.get_rank() % sp]


def main(out_path):
    from accelerate import PartialState

    PartialState(cpu=True)  # the process group, as the Trainer will make it
    world, rank, sp = dist.get_world_size(), dist.get_rank(), 2
    examples = imbalanced_examples(EXAMPLES)
    per_rank = EXAMPLES // world  # accelerate shards the loader over all ranks; Ulysses runs each batch on sp ranks
    reference = reference_case(examples)
    pairs, (dpo_want, dpo_loss) = dpo_reference()
    results = {"world_size": world, "sp_size": sp, "cases": {}, "controls": {}}
    for bs in (1, 2, per_rank):
        ga = per_rank // bs * sp  # one optimizer step for the whole data: each rank runs sp shards per batch
        results["cases"][f"bs{bs} ga{ga}"] = trainer_case(examples, bs, ga, *reference)

    # Controls, on the first split: each breaks one rule and must miss the big batch.
    bs, ga = 1, per_rank * sp
    group = data_groups(world, sp)
    original_count, original_labels = trainer_module.count_window, trainer_module.with_labels
    sp_rank = rank % sp

    def count_over_data_ranks(count, batches, accelerator, device=None, size=2):
        counts = torch.zeros(size, dtype=torch.long)
        for batch in batches:
            counts += count(batch).cpu()
        dist.all_reduce(counts, group=group)
        units = tuple(counts.tolist())
        return WindowCounts(units[0], units[1], len(batches), units)

    def boundary_dropped(shard):
        shard = original_labels(shard)
        if sp_rank < sp - 1:  # the last position's target is the next shard's first token: shifting in the shard
            shard["shift_labels"] = shard["shift_labels"].clone()
            shard["shift_labels"][:, -1] = -100
            shard["labels"] = shard["shift_labels"]
        return shard

    def boundary_counted_twice(count, batches, accelerator, device=None, size=2):
        # Each shard's last target (the next shard's first token) counted once more, as the next shard would.
        def twice(batch):
            extra = torch.zeros(size, dtype=torch.long)
            if sp_rank < sp - 1:
                extra[0] = (batch["shift_labels"][:, -1] != -100).sum()
            return count(batch).cpu() + extra

        return original_count(twice, batches, accelerator, device, size)

    for name, patch in (
        ("count over data ranks only", {"count_window": count_over_data_ranks}),
        ("boundary target dropped", {"with_labels": boundary_dropped}),
        ("boundary target counted twice", {"count_window": boundary_counted_twice}),
    ):
        for attr, fn in patch.items():
            setattr(trainer_module, attr, fn)
        try:
            results["controls"][name] = trainer_case(examples, bs, ga, *reference)
        finally:
            trainer_module.count_window, trainer_module.with_labels = original_count, original_labels
    # DPO: each pair's sequence sums reduced over the sequence group before the sigmoid, counted on its first rank.
    bs = 2
    ga = PAIRS // world // bs * sp
    results["dpo"] = dpo_case(pairs, bs, ga, dpo_want, dpo_loss)
    # Control: each shard's sigmoid of its own partial sums, the pair counted on every shard (no reduction).
    original_sum, original_first = preference_module.sum_over_sequence_group, preference_module.is_first_sequence_rank
    preference_module.sum_over_sequence_group, preference_module.is_first_sequence_rank = (lambda t: t), (lambda: True)
    try:
        results["dpo_controls"] = {"sums not reduced before the sigmoid": dpo_case(pairs, bs, ga, dpo_want, dpo_loss)}
    finally:
        preference_module.sum_over_sequence_group, preference_module.is_first_sequence_rank = (
            original_sum,
            original_first,
        )
    # hfacc verify on this layout (the embedded tiny Llama and data), as `accelerate launch ... -m hfacc.cli verify`
    # runs it; last, since it ends the process group.
    report = Path(tempfile.mkdtemp()) / "verify.json"
    argv = ["verify", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", str(2 * sp)]
    code = main_cli([*argv, "--json_path", str(report)])
    if rank == 0:
        results["verify"] = {"exit_code": code, **json.loads(report.read_text())}
        Path(out_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
