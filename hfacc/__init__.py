"""hfacc: k accumulated micro-batches give exactly the update of one big batch."""

from .accumulation import MicroBatch, accumulation_window, iter_windows
from .arguments import TokenWeightedArguments
from .audit import AccumulationAuditCallback
from .batching import TokenBudgetBatchSampler, pack_dataset, pack_examples
from .collator import DataCollatorForCausalLM
from .data import DataArguments, build_sft_dataset, load_sft_source
from .distributed import get_gradient_scale
from .grpo_trainer import GRPOArguments, GRPOTrainer
from .loss import (
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
from .modeling import ModelArguments, apply_lora, build_tiny_llama, get_tokenizer, load_causal_lm
from .objectives import (
    CausalLMObjective,
    DPOObjective,
    FunctionObjective,
    LossFunctionObjective,
    ModelLossObjective,
    MultiLabelObjective,
    Objective,
    PolicyGradientObjective,
    RegressionObjective,
    SequenceClassificationObjective,
    TokenObjective,
    get_objective,
)
from .preference_data import DataCollatorForPreference, build_preference_dataset, precompute_reference_logps
from .step_gate import NonFiniteLossError
from .trainer import TokenWeightedTrainer
from .verify import verify_accumulation
from .vision import DataCollatorForVisionLM, get_processor

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
    # preference pairs (DPO)
    "build_preference_dataset",
    "DataCollatorForPreference",
    "precompute_reference_logps",
    # models
    "get_tokenizer",
    "load_causal_lm",
    "apply_lora",
    "build_tiny_llama",
    "ModelArguments",
    # objectives: what a target is
    "Objective",
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
    # online policy gradients (GRPO, DAPO, Dr. GRPO)
    "PolicyGradientObjective",
    "GRPOTrainer",
    "GRPOArguments",
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
    # checking
    "verify_accumulation",
    "AccumulationAuditCallback",
]
