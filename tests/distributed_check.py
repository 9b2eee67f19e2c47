"""Two CPU ranks (gloo), launched as tests/test_distributed.py does:

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/distributed_check.py OUT.json

The ranks see very different token counts (rank 0 gets the long sequences, rank 1 the short ones). Each case's
gradient, after DDP's all-reduce, is compared with the full-batch reference computed on every rank from all 8
examples. Rank 0 writes the measured errors to OUT.json; tests/test_distributed.py asserts on them.
"""

import json
import random
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator  # noqa: E402
from transformers import Trainer  # noqa: E402

from hfacc import (  # noqa: E402
    DataCollatorForCausalLM,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    accumulation_window,
    build_tiny_llama,
    causal_lm_sums,
    iter_windows,
)
from hfacc.data.batching import TokenBudgetBatchSampler  # noqa: E402
from hfacc.runtime.distributed import all_ranks_agree  # noqa: E402
from tests.helpers import VOCAB, flat_grad, full_batch_causal_lm, relative_error, run_trainer, train_args  # noqa: E402


def imbalanced_examples(n=8, seed=0):
    """Even indices long (40-60 tokens, short prompts), odd ones short (5-10 tokens, long prompts)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(40, 60) if i % 2 == 0 else rng.randint(5, 10)
        ids = [rng.randrange(1, VOCAB) for _ in range(length)]
        prompt = rng.randint(1, 4) if i % 2 == 0 else length - rng.randint(1, 2)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def main(out_path: str) -> None:
    examples = imbalanced_examples()
    collate = DataCollatorForCausalLM(pad_token_id=0)
    results = {"cases": {}}
    tmp = Path(tempfile.mkdtemp())
    cases = [
        ("hfacc bs1 ga4 avg=True", TokenWeightedTrainer, 1, 4, True, "token"),
        ("hfacc bs1 ga4 avg=False", TokenWeightedTrainer, 1, 4, False, "token"),
        ("hfacc bs2 ga2 avg=False", TokenWeightedTrainer, 2, 2, False, "token"),
        ("hfacc bs2 ga2 sequence", TokenWeightedTrainer, 2, 2, True, "sequence"),
        ("stock bs1 ga4 avg=True", Trainer, 1, 4, True, "token"),
        ("stock bs1 ga4 avg=False", Trainer, 1, 4, False, "token"),
    ]
    # Token-budget micro-batches: a budget whose micro-batch count splits evenly over the ranks, one window for all.
    lengths = [len(e["input_ids"]) for e in examples]
    budget = next(b for b in range(60, 400, 4) if len(TokenBudgetBatchSampler(lengths, b)) in (4, 6))
    cases.append(
        (
            "hfacc token budget",
            TokenWeightedTrainer,
            1,
            len(TokenBudgetBatchSampler(lengths, budget)) // 2,
            True,
            "token",
        )
    )
    for name, cls, bs, ga, average, normalization in cases:
        model = build_tiny_llama(vocab_size=VOCAB)
        reference, token_loss, accuracy = full_batch_causal_lm(model, examples, mode=normalization)
        extra = {"max_tokens_per_batch": budget, "train_sampling_strategy": "random"} if "budget" in name else {}
        args = train_args(
            tmp,
            bs,
            ga,
            average_tokens_across_devices=average,
            args_class=TokenWeightedArguments,
            normalization=normalization,
            # A collective that never completes fails in 2 minutes instead of hanging the suite for 30.
            ddp_timeout=120,
            **extra,
        )
        trainer, capture = run_trainer(cls, model, examples, args, collate)
        log = trainer.state.log_history[0]
        results["cases"][name] = {
            "grad_error": relative_error(capture.grads[0], reference),
            "loss": log["loss"],
            "reference_loss": token_loss,
            "token_accuracy": log.get("token_accuracy"),
            "reference_accuracy": accuracy,
            "num_targets": log.get("num_targets"),
        }
        results["world_size"] = trainer.args.world_size
        results["local_targets"] = [
            sum(sum(1 for y in e["labels"][1:] if y != -100) for e in examples[r::2]) for r in range(2)
        ]

    # A hand-written loop with the helper, on the same data split over the ranks.
    accelerator = Accelerator(cpu=True)
    model = build_tiny_llama(vocab_size=VOCAB)
    reference, _, _ = full_batch_causal_lm(model, examples)
    prepared = accelerator.prepare(model)
    mine = examples[accelerator.process_index :: accelerator.num_processes]
    for batches in iter_windows([collate([e]) for e in mine], 4):
        for mb in accumulation_window(accelerator, prepared, batches):
            with mb.sync():
                logits = prepared(input_ids=mb.batch["input_ids"], attention_mask=mb.batch["attention_mask"]).logits
                accelerator.backward(mb.scale(causal_lm_sums(logits, mb.batch["labels"])))
    results["cases"]["loop helper"] = {"grad_error": relative_error(flat_grad(model), reference)}
    results["distributed_type"] = str(accelerator.distributed_type)
    # A decision every rank must share (fused loss on/off, skip a step): one "no" anywhere is "no" everywhere.
    mixed = all_ranks_agree(accelerator.process_index == 0, accelerator)
    results["agree"] = {"all yes": all_ranks_agree(True, accelerator), "one no": mixed}
    results["process_group_size"] = dist.get_world_size() if dist.is_initialized() else 1
    # Preference pairs (DPO and its variants) on the same two ranks: tests/preference_check.py.
    from tests.preference_check import ddp_cases

    results["preference"] = ddp_cases(tmp)
    # Distillation (a teacher model, stored top-K, on-policy) on the same two ranks: tests/distillation_check.py.
    from tests.distillation_check import ddp_cases as distillation_cases

    results["distillation"] = distillation_cases(tmp)

    # Reward models and KTO (its reference point over both ranks) on the same two ranks: tests/reward_kto_check.py.
    from tests.reward_kto_check import ddp_cases as reward_kto_cases

    results["reward_kto"] = reward_kto_cases(tmp)

    if accelerator.is_main_process:
        Path(out_path).write_text(json.dumps(results, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group: a rank that exits with it alive can abort


if __name__ == "__main__":
    main(sys.argv[1])
