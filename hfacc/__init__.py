"""hfacc: k accumulated micro-batches give exactly the update of one big batch.

The package's folders are the stages of a run, lowest first. A folder imports from the folders above it in this
list and from itself, never from one below it (tests/test_layers.py reads every import, lazy ones included):

    ops          loss math as pure functions, the fused loss and chunked log-probs, a model's inputs and outputs
    runtime      settings from YAML and flags, the ranks (what data parallelism changes), peak memory
    data         rows to micro-batches: sources, formats, chat masking, streaming, packing, collators, the
                 padding-free layout of each micro-batch, images, preference pairs, the embedded datasets
    models       loading models and tokenizers; the frozen reference and its precomputed log-probs
    generation   sampling from a policy: the engine (generate, vLLM), rollouts, rewards, generation-based evaluation
    objectives   one module per loss family: its unit, its sums, what it sets up once
    setup        the once-per-model decisions: objective, layout checks (padding-free, packing), loss path
    training     the trainer and the life of a step, checkpoints, hand-written loops, the GRPO trainer, TRL's trainers
    verify       ``hfacc verify``: an accumulated window against one big batch, and what breaks it
    jobs         the jobs of the recipes and of ``hfacc sft`` / ``dpo`` / ``grpo``, their console and reports
    cli.py       the ``hfacc`` command

So a micro-batch's path through ``TokenWeightedTrainer.compute_loss`` only goes down: training -> data (its
layout) -> objectives -> ops. Every public name is importable from ``hfacc`` itself (``__all__``): the folders
are for readers of the code, not a second API.
"""

from __future__ import annotations

import atexit
import importlib
import sys

__version__ = "0.1.0"


def _wait_for_collective_threads() -> None:
    """At exit, a process that ran gloo collectives waits for gloo's worker threads before it finalizes
    (hfacc/runtime/shutdown.py: otherwise a rank can abort after its work is done, and torchrun reports it failed).
    The module is imported only then, and only in a process that imported torch, so ``import hfacc`` stays free of
    every submodule (the wait itself is a scan of this process's threads: about 2 ms without gloo)."""
    if "torch" in sys.modules:
        from .runtime.shutdown import wait_for_collective_threads

        wait_for_collective_threads()


atexit.register(_wait_for_collective_threads)

# Where each public name lives. `import hfacc` imports none of them: a name is imported on first use (PEP 562),
# so `import hfacc` and `hfacc <command> --help` do not pay for torch models, datasets and the Trainer.
_LOCATIONS: dict[str, tuple[str, ...]] = {
    "data.batching": ("TokenBudgetBatchSampler", "pack_dataset", "pack_examples"),
    "data.collator": ("DataCollatorForCausalLM",),
    "data.embedded": (
        "build_default_model",
        "build_default_tokenizer",
        "build_tiny_llama",
        "generate_instruction_examples",
    ),
    "data.embedded_vision": ("build_tiny_vlm", "generate_shape_examples"),
    "data.formats": ("render_mask",),
    "data.preference": ("DataCollatorForPreference", "DataCollatorForUnpairedPreference", "build_preference_dataset"),
    "data.sft": ("DataArguments", "build_sft_dataset"),
    "data.sources": ("load_sft_source",),
    "data.vision": ("DataCollatorForVisionLM", "get_processor"),
    "generation.engine": ("GenerationEngine", "TransformersEngine"),
    "generation.evaluation": ("generate_answers",),
    "generation.server_engine": ("ServerEngine",),
    "generation.tools": ("MultiTurnSampler",),
    "generation.vllm_engine": ("VLLMArguments", "VLLMEngine", "build_generation_engine"),
    "models.loading": (
        "ModelArguments",
        "apply_lora",
        "as_reward_model",
        "get_tokenizer",
        "load_causal_lm",
        "load_reward_model",
    ),
    "models.reference": ("precompute_reference_logps",),
    "models.teacher": ("precompute_teacher_logprobs",),
    "objectives": (
        "CausalLMObjective",
        "DistillationObjective",
        "DPOObjective",
        "FunctionObjective",
        "KTOObjective",
        "LossFunctionObjective",
        "ModelLossObjective",
        "MultiLabelObjective",
        "Objective",
        "PolicyGradientObjective",
        "RegressionObjective",
        "RewardObjective",
        "SequenceClassificationObjective",
        "SetupContext",
        "TokenObjective",
        "get_objective",
    ),
    "ops.loss": (
        "IGNORE_INDEX",
        "LossSums",
        "WindowCounts",
        "binary_cross_entropy_sums",
        "causal_lm_sums",
        "count_targets",
        "cross_entropy_sums",
        "normalize_window_loss",
        "shift_labels",
        "squared_error_sums",
    ),
    "runtime.distributed": ("get_gradient_scale",),
    "runtime.memory": ("peak_memory",),
    "training.accumulation": ("MicroBatch", "accumulation_window", "iter_windows"),
    "training.arguments": ("TokenWeightedArguments",),
    "training.audit": ("AccumulationAuditCallback",),
    "training.distill_trainer": ("DistillationArguments", "DistillationTrainer"),
    "training.grpo_trainer": ("GRPOArguments", "GRPOTrainer"),
    "training.step_gate": ("NonFiniteLossError",),
    "training.trainer": ("TokenWeightedTrainer",),
    "training.trl_trainers": (
        "DistillationConfig",
        "DPOConfig",
        "DPOTrainer",
        "GRPOConfig",
        "KTOConfig",
        "KTOTrainer",
        "RewardConfig",
        "RewardTrainer",
        "SFTConfig",
        "SFTTrainer",
    ),
    "verify.equivalence": ("verify_accumulation",),
}
_MODULE_OF = {name: module for module, names in _LOCATIONS.items() for name in names}

# What README users import from `hfacc`; tests/test_docs.py checks that each name is here and importable.
__all__ = [
    # training
    "TokenWeightedTrainer",
    "TokenWeightedArguments",
    "NonFiniteLossError",
    "get_gradient_scale",
    # data
    "build_sft_dataset",
    "load_sft_source",
    "DataArguments",
    "DataCollatorForCausalLM",
    "DataCollatorForVisionLM",
    "get_processor",
    "TokenBudgetBatchSampler",
    "pack_examples",
    "pack_dataset",
    "render_mask",
    # preference pairs (DPO)
    "build_preference_dataset",
    "DataCollatorForPreference",
    "precompute_reference_logps",
    # reward models and unpaired preference (KTO)
    "RewardObjective",
    "KTOObjective",
    "DataCollatorForUnpairedPreference",
    "load_reward_model",
    "as_reward_model",
    # models
    "get_tokenizer",
    "load_causal_lm",
    "apply_lora",
    "build_tiny_llama",
    "ModelArguments",
    # the embedded examples: offline data, tokenizer and tiny models made here
    "generate_instruction_examples",
    "build_default_tokenizer",
    "build_default_model",
    "generate_shape_examples",
    "build_tiny_vlm",
    # objectives: what a target is
    "Objective",
    "SetupContext",
    "CausalLMObjective",
    "TokenObjective",
    "SequenceClassificationObjective",
    "MultiLabelObjective",
    "RegressionObjective",
    "ModelLossObjective",
    "FunctionObjective",
    "LossFunctionObjective",
    "DPOObjective",
    "get_objective",
    # knowledge distillation (from a teacher, from stored top-K log-probs)
    "DistillationObjective",
    "precompute_teacher_logprobs",
    "DistillationTrainer",
    "DistillationArguments",
    # online policy gradients (GRPO, DAPO, Dr. GRPO)
    "PolicyGradientObjective",
    "GRPOTrainer",
    "GRPOArguments",
    # generation engines: transformers generate, or vLLM kept in step with the policy
    "GenerationEngine",
    "TransformersEngine",
    "VLLMEngine",
    "ServerEngine",
    "VLLMArguments",
    "build_generation_engine",
    # multi-turn rollouts with tools (docs/tools_and_environments.md)
    "MultiTurnSampler",
    # TRL's trainers and configs under TRL's names (docs/from_trl.md)
    "SFTTrainer",
    "SFTConfig",
    "DPOTrainer",
    "DPOConfig",
    "RewardTrainer",
    "RewardConfig",
    "KTOTrainer",
    "KTOConfig",
    "GRPOConfig",
    "DistillationConfig",
    # loss math
    "IGNORE_INDEX",
    "LossSums",
    "WindowCounts",
    "shift_labels",
    "count_targets",
    "cross_entropy_sums",
    "causal_lm_sums",
    "binary_cross_entropy_sums",
    "squared_error_sums",
    "normalize_window_loss",
    # hand-written loops
    "iter_windows",
    "accumulation_window",
    "MicroBatch",
    # evaluation and measuring
    "generate_answers",
    "peak_memory",
    # checking
    "verify_accumulation",
    "AccumulationAuditCallback",
]


def __getattr__(name: str):
    """``hfacc.X``: import X's module on first use (and keep X here, so the next lookup is a plain attribute)."""
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # a folder: hfacc.data, hfacc.training, ... as after `import hfacc.data`
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
