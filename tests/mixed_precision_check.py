"""Two CPU ranks (gloo) in bf16, launched by tests/test_mixed_precision.py:

    torchrun --nproc_per_node 2 tests/mixed_precision_check.py OUT.json

The ranks see very different token counts (tests/distributed_check.py's data). Each case trains one window with
``bf16=True`` (autocast over fp32 masters) or on bf16 weights; its gradient, after DDP's all-reduce, is compared with
the big batch of all 8 examples computed on every rank in the same precision, and that big batch with the fp32 one
(the precision's noise floor). Rank 0 writes the errors to OUT.json.
"""

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfacc import DataCollatorForCausalLM, TokenWeightedArguments, TokenWeightedTrainer, build_tiny_llama  # noqa: E402
from tests.distributed_check import imbalanced_examples  # noqa: E402
from tests.helpers import VOCAB, full_batch_causal_lm, relative_error, run_trainer, train_args  # noqa: E402


def main(out_path: str) -> None:
    examples = imbalanced_examples()
    collate = DataCollatorForCausalLM(pad_token_id=0)
    results, tmp = {"cases": {}}, Path(tempfile.mkdtemp())
    for name, bs, ga, weights in [
        ("bf16 autocast bs1 ga4", 1, 4, torch.float32),
        ("bf16 weights bs2 ga2", 2, 2, None),
    ]:
        model = build_tiny_llama(vocab_size=VOCAB)
        exact, _, _ = full_batch_causal_lm(model, examples)
        if weights is None:
            model = copy.deepcopy(model).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            big, _, _ = full_batch_causal_lm(model, examples)
        args = train_args(tmp, bs, ga, args_class=TokenWeightedArguments, bf16=True, ddp_timeout=120)
        trainer, capture = run_trainer(TokenWeightedTrainer, model, examples, args, collate)
        results["cases"][name] = {
            "error": relative_error(capture.grads[0], big),
            "noise_floor": relative_error(big, exact),
            "padding_free": trainer.padding_free,
            "mixed_precision": trainer.accelerator.mixed_precision,
        }
        results["world_size"] = trainer.args.world_size
    accelerator = trainer.accelerator
    if accelerator.is_main_process:
        Path(out_path).write_text(json.dumps(results, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
