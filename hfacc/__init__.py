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

from .data.batching import TokenBudgetBatchSampler, pack_dataset, pack_examples
from .data.collator import DataCollatorForCausalLM
from .data.embedded import (
    build_default_model,
    build_default_tokenizer,
    build_tiny_llama,
    generate_instruction_examples,
)
from .data.embedded_vision import build_tiny_vlm, generate_shape_examples
from .data.formats import render_mask
from .data.preference import DataCollatorForPreference, DataCollatorForUnpairedPreference, build_preference_dataset
from .data.sft import DataArguments, build_sft_dataset
from .data.sources import load_sft_source
from .data.vision import DataCollatorForVisionLM, get_processor
from .generation.engine import GenerationEngine, TransformersEngine
from .generation.evaluation import generate_answers
from .generation.vllm_engine import VLLMArguments, VLLMEngine, build_generation_engine
from .models.loading import (
    ModelArguments,
    apply_lora,
    as_reward_model,
    get_tokenizer,
    load_causal_lm,
    load_reward_model,
)
from .models.reference import precompute_reference_logps
from .models.teacher import precompute_teacher_logprobs
from .objectives import (
    CausalLMObjective,
    DistillationObjective,
    DPOObjective,
    FunctionObjective,
    KTOObjective,
    LossFunctionObjective,
    ModelLossObjective,
    MultiLabelObjective,
    Objective,
    PolicyGradientObjective,
    RegressionObjective,
    RewardObjective,
    SequenceClassificationObjective,
    SetupContext,
    TokenObjective,
    get_objective,
)
from .ops.loss import (
    IGNORE_INDEX,
    LossSums,
    WindowCounts,
    binary_cross_entropy_sums,
    causal_lm_sums,
    count_targets,
    cross_entropy_sums,
    normalize_window_loss,
    shift_labels,
    squared_error_sums,
)
from .runtime.distributed import get_gradient_scale
from .runtime.memory import peak_memory
from .training.accumulation import MicroBatch, accumulation_window, iter_windows
from .training.arguments import TokenWeightedArguments
from .training.audit import AccumulationAuditCallback
from .training.distill_trainer import DistillationArguments, DistillationTrainer
from .training.grpo_trainer import GRPOArguments, GRPOTrainer
from .training.step_gate import NonFiniteLossError
from .training.trainer import TokenWeightedTrainer
from .training.trl_trainers import (
    DistillationConfig,
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    KTOConfig,
    KTOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)
from .verify.equivalence import verify_accumulation

__version__ = "0.1.0"

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
    "VLLMArguments",
    "build_generation_engine",
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
