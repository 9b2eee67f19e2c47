"""Two CPU ranks (gloo) training the four tiny vision-language families, launched by tests/test_vision.py:

    accelerate launch --config_file accelerate_configs/ddp.yaml tests/vision_distributed_check.py OUT.json

For each family the 8 multi-image, multi-turn conversations of tests/vision_families.py (very different numbers of
targets and image tokens) are trained for one step, bs 2 x GA 2 on each rank, padding-free in one row; the gradient
after DDP's all-reduce is compared with the hand-written big-batch reference computed on every rank. Rank 0 writes
the errors to OUT.json.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hfacc.setup.layout_check as layout_check  # noqa: E402
from hfacc import DataCollatorForVisionLM, TokenWeightedArguments, TokenWeightedTrainer  # noqa: E402
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.helpers import relative_error, run_trainer, train_args  # noqa: E402
from tests.test_vision import FAMILIES, examples_for, reference_gradient  # noqa: E402
from tests.vision_families import model_for, processor_for  # noqa: E402


def main(out_path: str) -> None:
    # Padding-free in one row (what flash/flex attention get; sdpa's rows of the longest sequence hold one
    # sequence each at 2 per micro-batch): the ranks' sequences really share a row.
    layout_check.uses_one_row = lambda model: True
    results = {"cases": {}}
    for family in FAMILIES:
        examples = examples_for(family)
        collate = DataCollatorForVisionLM(processor_for(family))
        reference = reference_gradient(family, examples)
        for padding_free in (True,):  # padded on two ranks: tests/test_distributed.py (the same counting)
            args = train_args(tempfile.mkdtemp(), 2, 2, args_class=TokenWeightedArguments, padding_free=padding_free)
            trainer, capture = run_trainer(TokenWeightedTrainer, model_for(family), examples, args, collate)
            results["cases"][f"{family} padding_free={padding_free}"] = {
                "grad_error": relative_error(capture.grads[0], reference),
                "padding_free": trainer.padding_free,
                "num_targets": trainer.state.log_history[0]["num_targets"],
            }
    results["world_size"] = dist.get_world_size()  # the process group exists once the Trainer made it
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
