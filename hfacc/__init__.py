"""hfacc: k accumulated micro-batches give exactly the update of one big batch."""

from .accumulation import MicroBatch, accumulation_window, iter_windows
from .collator import DataCollatorForCausalLM
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
from .modeling import build_tiny_llama, load_causal_lm
from .objective import (
    CausalLMObjective,
    FunctionObjective,
    ModelLossObjective,
    MultiLabelObjective,
    Objective,
    RegressionObjective,
    SequenceClassificationObjective,
    TokenObjective,
    get_objective,
)
from .trainer import NonFiniteLossError, TokenWeightedArguments, TokenWeightedTrainer, get_gradient_scale

__version__ = "0.1.0"
