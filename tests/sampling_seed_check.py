"""Each rank samples its own completions, reproducibly, on a resumed run too: GRPOTrainer and on-policy
DistillationTrainer on the generate path (the transformers engine), 2 CPU ranks. Launched by
tests/test_sampling_seeds.py:

    torchrun --nproc_per_node 2 tests/sampling_seed_check.py OUT_DIR

Every prompt is the same prompt, so the ranks sample for identical prompts from identical weights with identically
seeded global generators: only the per-rank sampling seed can tell their completions apart. Per trainer, in the same
processes: a 2-step run that saves a checkpoint after each step, the same run again (without saving), and a run resumed
from the first checkpoint. Each engine draw is recorded (prompts, completions). Rank 0 writes OUT_DIR/results.json.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402

from hfacc import DistillationArguments, DistillationTrainer, GRPOArguments, GRPOTrainer  # noqa: E402
from hfacc.data.embedded import build_default_model  # noqa: E402
from hfacc.generation import engine as engines  # noqa: E402
from hfacc.jobs.console import end_process_group  # noqa: E402
from tests.grpo_setup import build_policy  # noqa: E402

DRAWS: list[dict] = []  # this rank's engine draws in the current run
_sample = engines.TransformersEngine.sample


def recording_sample(self, prompt_ids, settings, *, seed=None):
    samples = _sample(self, prompt_ids, settings, seed=seed)
    DRAWS.append({"prompts": [list(p) for p in prompt_ids], "completions": samples.completion_ids})
    return samples


engines.TransformersEngine.sample = recording_sample


def length(prompts, completions, **kwargs):
    """Longer is better: the policy keeps sampling tokens after an update (a reward for brevity teaches it EOS)."""
    return [float(len(c[0]["content"])) for c in completions]


PROMPTS = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}] * 16)
COMMON = dict(
    per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=8, max_steps=2,
    learning_rate=1e-2, save_steps=1, logging_steps=1, report_to=[], use_cpu=True,
    disable_tqdm=True, seed=0, ddp_timeout=120,
)  # fmt: skip


POLICY, TOKENIZER = build_policy()  # every run starts from a copy: the same weights on both ranks
TEACHER = build_default_model(TOKENIZER, hidden_size=48, num_layers=1, seed=1)


def build(kind: str, output_dir: Path, save: bool):
    policy, settings = copy.deepcopy(POLICY), dict(COMMON, save_strategy="steps" if save else "no")
    if kind == "grpo":
        args = GRPOArguments(output_dir=str(output_dir), num_generations=4, **settings)
        return GRPOTrainer(policy, [length], args, train_dataset=PROMPTS, processing_class=TOKENIZER)
    args = DistillationArguments(output_dir=str(output_dir), lmbda=1.0, **settings)
    return DistillationTrainer(policy, TEACHER, args, train_dataset=PROMPTS, processing_class=TOKENIZER)


def run(kind: str, output_dir: Path, save: bool = False, resume: str | None = None) -> list[dict]:
    """This rank's engine draws of one run (one per generation)."""
    DRAWS.clear()
    build(kind, output_dir, save).train(resume_from_checkpoint=resume)
    return list(DRAWS)


def main(out: Path) -> None:
    results = {}
    for kind in ("grpo", "distill"):
        first = out / kind / "first"
        results[kind] = {
            "first": run(kind, first, save=True),
            "again": run(kind, out / kind / "again"),
            "resumed": run(kind, first, resume=str(first / "checkpoint-1")),
        }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps({"world_size": dist.get_world_size(), "ranks": gathered}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # a rank that exits with the gloo group alive aborts now and then (1 in 20 here)
