"""Objectives: one module per loss family, each declaring its unit, its sums and what it sets up once.

- :mod:`~hfacc.objectives.base`: :class:`Objective`, the abstract base every family implements, and the
  :class:`SetupContext` its ``setup`` reads;
- :mod:`~hfacc.objectives.causal_lm`: next-token prediction (SFT), the default for causal LMs;
- :mod:`~hfacc.objectives.heads`: token labels, sequence classification, multi-label, regression, the model's own loss;
- :mod:`~hfacc.objectives.function`: objectives from the user's functions (``FunctionObjective``,
  ``compute_loss_func``);
- :mod:`~hfacc.objectives.preference`: preference pairs (DPO, IPO, hinge, robust DPO, SimPO), exact per pair;
- :mod:`~hfacc.objectives.reward`: reward models (Bradley-Terry, margins, centering), exact per pair;
- :mod:`~hfacc.objectives.kto`: KTO on unpaired rows, exact per row with the step's reference point;
- :mod:`~hfacc.objectives.policy_gradient`: the clipped policy-gradient loss of the GRPO family on rollout rows;
- :mod:`~hfacc.objectives.distillation`: knowledge distillation (TRL's generalized JSD), exact per student token;
- :mod:`~hfacc.objectives.choice`: :func:`get_objective`, which one a model calls for (``objective="auto"``).

A new loss is a new module here, next to these: it subclasses :class:`Objective`, and the trainer needs no branch.
"""

from .base import Objective, SetupContext
from .causal_lm import CausalLMObjective, get_batch_sequences
from .choice import OBJECTIVES, get_objective
from .distillation import DistillationObjective
from .function import FunctionObjective, LossFunctionObjective
from .heads import (
    ModelLossObjective,
    MultiLabelObjective,
    RegressionObjective,
    SequenceClassificationObjective,
    TokenObjective,
)
from .kto import KTOObjective
from .policy_gradient import PolicyGradientObjective
from .preference import DPOObjective
from .reward import RewardObjective

__all__ = [
    "Objective",
    "SetupContext",
    "CausalLMObjective",
    "get_batch_sequences",
    "TokenObjective",
    "SequenceClassificationObjective",
    "MultiLabelObjective",
    "RegressionObjective",
    "ModelLossObjective",
    "FunctionObjective",
    "LossFunctionObjective",
    "DPOObjective",
    "RewardObjective",
    "KTOObjective",
    "PolicyGradientObjective",
    "DistillationObjective",
    "OBJECTIVES",
    "get_objective",
]
