"""TRL's trainers and configs under TRL's names, over hfacc's one trainer: a TRL script runs with its import line
changed (``from hfacc import DPOTrainer, DPOConfig``).

Each trainer is a thin :class:`hfacc.TokenWeightedTrainer`: it loads the model TRL's way (a name with
``model_init_kwargs``, ``processing_class`` from the model when left out, ``peft_config``), builds the dataset, the
collator and the :class:`hfacc.Objective` from the config's TRL fields, and trains with the accumulated window's
exact normalization. ``GRPOTrainer`` and ``DistillationTrainer`` are hfacc's own (they take TRL's call shape too);
their configs are here. A TRL field hfacc does not support, set to anything but TRL's default, is one
``ValueError`` naming it (``UNSUPPORTED``), never ignored.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from ..data.collator import DataCollatorForCausalLM
from ..data.preference import DataCollatorForPreference, DataCollatorForUnpairedPreference, build_preference_dataset
from ..data.sft import build_sft_dataset
from ..models.loading import load_causal_lm
from ..models.model_init import disable_dropout, get_model_and_tokenizer
from ..models.reference import precompute_reference_logps
from ..objectives.kto import KTOObjective
from ..objectives.preference import DPOObjective
from ..objectives.reward import RewardObjective
from ..ops.precision import get_training_autocast
from .arguments import TokenWeightedArguments, convert_arguments
from .distill_trainer import DistillationArguments
from .grpo_trainer import GRPOArguments
from .trainer import TokenWeightedTrainer

logger = logging.getLogger(__name__)

# TRL's truncation_mode -> hfacc's truncation ("keep_start" cuts the end; "keep_end" keeps the answer whole and
# cuts the prompt's start).
TRUNCATION_MODES = {"keep_start": "right", "keep_end": "left"}
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Say ``message`` at WARNING, once per process."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _help(text: str) -> dict:
    return {"help": text}


def _unsupported(default: Any, why: str):
    """A TRL field hfacc does not support: accepted at TRL's default only (see :func:`check_unsupported`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=_help(f"Not supported: {why}"))
    return field(default=default, metadata=_help(f"Not supported: {why}"))


def check_unsupported(config) -> None:
    """One named error for a TRL field hfacc does not support that is set to anything but TRL's default."""
    for f in dataclasses.fields(config):
        help_text = f.metadata.get("help", "")
        if not help_text.startswith("Not supported: "):
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(config, f.name)
        if value != default:
            raise ValueError(
                f"{type(config).__name__}.{f.name}={value!r}: hfacc does not support it "
                f"({help_text.removeprefix('Not supported: ')}); leave it at TRL's default {default!r}."
            )


def get_truncation(config) -> str:
    mode = config.truncation_mode
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"{type(config).__name__}.truncation_mode={mode!r}: use one of {list(TRUNCATION_MODES)}.")
    return TRUNCATION_MODES[mode]


def default_output_dir(model, method: str) -> str:
    """TRL's default output_dir: ``<model name>-<method>``."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return f"{name.rstrip('/').split('/')[-1] or 'model'}-{method}"


def as_config(args, cls, model, method: str):
    if args is None:
        return cls(output_dir=default_output_dir(model, method))
    return convert_arguments(args, cls)


def each_split(dataset, build):
    """``build`` applied to a dataset, or to each of a dict of them (TRL's eval_dataset may be a dict)."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {name: build(split) for name, split in dataset.items()}
    return build(dataset)


def is_tokenized(dataset, column: str) -> bool:
    return column in (getattr(dataset, "column_names", None) or ())


def warn_pair_unit(method: str, unit: str) -> None:
    warn_once(
        f"unit-{method}",
        f"hfacc: {method} divides the loss summed over every {unit} of the accumulation window (all micro-batches "
        f"and ranks) by their number; TRL averages each micro-batch's {unit}s and then the micro-batches. The two "
        "agree when every micro-batch holds as many; hfacc's is exactly the big batch's update otherwise too.",
    )


# ---- configs ---------------------------------------------------------------------------------------------------
@dataclass
class SFTConfig(TokenWeightedArguments):
    """TRL's ``SFTConfig``: :class:`hfacc.TokenWeightedArguments` with TRL's SFT fields and defaults."""

    learning_rate: float = field(default=2e-5, metadata=_help("The initial learning rate (TRL's SFT default)."))
    model_init_kwargs: dict | None = field(
        default=None, metadata=_help("from_pretrained keywords for a model given by name (dtype, revision, ...).")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Run the model's own code from the hub."))
    dataset_text_field: str = field(default="text", metadata=_help("The text column of language-modeling rows."))
    dataset_num_proc: int | None = field(default=None, metadata=_help("Processes for tokenizing the dataset."))
    max_length: int | None = field(default=1024, metadata=_help("Longest example in tokens (None: no limit)."))
    truncation_mode: str = field(
        default="keep_start", metadata=_help("Longer examples: 'keep_start' cuts their end ('keep_end' is refused).")
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata=_help("Prompt/completion rows: loss on the completion only (None or True; False is refused)."),
    )
    assistant_only_loss: bool = field(
        default=False,
        metadata=_help("Conversations: hfacc trains on the assistant turns only, whatever this says (said once)."),
    )
    loss_type: str = _unsupported("nll", "hfacc's SFT loss is the cross-entropy ('nll')")
    packing: bool = _unsupported(False, "pack with hfacc.pack_dataset and pass the packed dataset")
    packing_strategy: str = _unsupported("bfd", "see packing")
    eval_packing: bool | None = _unsupported(None, "see packing")
    shuffle_dataset: bool = _unsupported(False, "the trainer's sampler shuffles each epoch")
    dataset_kwargs: dict | None = _unsupported(None, "pass a tokenized dataset instead")
    chat_template_path: str | None = _unsupported(None, "set tokenizer.chat_template and pass processing_class")
    eos_token: str | None = _unsupported(None, "set it on the tokenizer and pass processing_class")
    pad_token: str | None = _unsupported(None, "set it on the tokenizer and pass processing_class")
    pad_to_multiple_of: int | str | None = _unsupported("auto", "hfacc pads each micro-batch to its longest row")
    activation_offloading: bool = _unsupported(False, "use gradient_checkpointing")
    router_aux_loss_coef: float | None = _unsupported(None, "MoE auxiliary losses are not added")

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self)
        get_truncation(self)
        if self.truncation_mode == "keep_end":
            raise ValueError(
                "SFTConfig.truncation_mode='keep_end': hfacc's SFT data keeps the start; use 'keep_start'."
            )
        if self.completion_only_loss is False:
            raise ValueError(
                "SFTConfig.completion_only_loss=False: hfacc trains prompt/completion rows on the completion only; "
                "to train on every token give a 'text' column instead."
            )


@dataclass
class _PreferenceFields:
    """What TRL's DPO, reward and KTO configs share."""

    model_init_kwargs: dict | None = field(
        default=None, metadata=_help("from_pretrained keywords for a model given by name (dtype, revision, ...).")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Run the model's own code from the hub."))
    disable_dropout: bool = field(default=True, metadata=_help("Set every dropout of the model to 0."))
    dataset_num_proc: int | None = field(default=None, metadata=_help("Processes for tokenizing the dataset."))
    max_length: int | None = field(default=1024, metadata=_help("Longest sequence (prompt and answer) in tokens."))
    pad_to_multiple_of: int | str | None = _unsupported("auto", "hfacc pads each micro-batch to its longest row")
    activation_offloading: bool = _unsupported(False, "use gradient_checkpointing")


@dataclass
class DPOConfig(TokenWeightedArguments, _PreferenceFields):
    """TRL's ``DPOConfig``: :class:`hfacc.TokenWeightedArguments` with TRL's DPO fields and defaults.

    ``loss_type`` is one of hfacc's preference losses (sigmoid, ipo, hinge, robust, simpo), or a list of one of
    them and ``"sft"`` with ``loss_weights`` (TRL's RPO: the ``"sft"`` weight is hfacc's ``nll_weight``).
    """

    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate (TRL's DPO default)."))
    truncation_mode: str = field(
        default="keep_start",
        metadata=_help("Longer pairs: 'keep_start' cuts the answer's end, 'keep_end' the prompt."),
    )
    precompute_ref_log_probs: bool = field(
        default=False, metadata=_help("Compute the reference's log-probs once before training (no reference held).")
    )
    precompute_ref_batch_size: int | None = field(default=None, metadata=_help("Pairs per batch of that (None: 16)."))
    loss_type: str | list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata=_help("sigmoid, ipo, hinge, robust, simpo; or [<one of them>, 'sft'] with loss_weights (RPO)."),
    )
    loss_weights: list[float] | None = field(default=None, metadata=_help("Weight of each loss_type (None: all 1)."))
    label_smoothing: float = field(default=0.0, metadata=_help("Conservative DPO's eps; robust's flip rate."))
    beta: float = field(default=0.1, metadata=_help("The loss's temperature (DPO's beta; IPO's tau)."))
    ld_alpha: float | None = _unsupported(None, "LD-DPO's length weighting")
    f_divergence_type: str = _unsupported("reverse_kl", "f-DPO's other divergences")
    f_alpha_divergence_coef: float = _unsupported(0.5, "f-DPO's alpha divergence")
    use_weighting: bool = _unsupported(False, "WPO's weighting")
    discopop_tau: float = _unsupported(0.05, "the discopop loss")
    sync_ref_model: bool = _unsupported(False, "TR-DPO's reference updates")
    ref_model_mixup_alpha: float = _unsupported(0.6, "TR-DPO's reference updates")
    ref_model_sync_steps: int = _unsupported(512, "TR-DPO's reference updates")
    pad_token: str | None = _unsupported(None, "set it on the tokenizer and pass processing_class")
    router_aux_loss_coef: float | None = _unsupported(None, "MoE auxiliary losses are not added")

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self)
        get_truncation(self)
        self.get_losses()

    def get_losses(self) -> tuple[str, float]:
        """``(loss_type, nll_weight)`` of hfacc's :class:`hfacc.DPOObjective` from TRL's list of losses."""
        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        weights = list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(types)
        if len(weights) != len(types):
            raise ValueError(f"DPOConfig.loss_weights has {len(weights)} entries for {len(types)} loss_type entries.")
        nll = sum(w for t, w in zip(types, weights, strict=True) if t == "sft")
        rest = [(t, w) for t, w in zip(types, weights, strict=True) if t != "sft"]
        if len(rest) != 1 or rest[0][1] != 1:
            raise ValueError(
                f"DPOConfig.loss_type={self.loss_type!r}, loss_weights={self.loss_weights!r}: hfacc combines one "
                "preference loss (weight 1) with at most 'sft' (any weight)."
            )
        return rest[0][0], float(nll)


@dataclass
class RewardConfig(TokenWeightedArguments, _PreferenceFields):
    """TRL's ``RewardConfig``: :class:`hfacc.TokenWeightedArguments` with TRL's reward-model fields and defaults."""

    learning_rate: float = field(default=1e-4, metadata=_help("The initial learning rate (TRL's reward default)."))
    center_rewards_coefficient: float | None = field(
        default=None, metadata=_help("Weight of the mean squared reward, which centers the scores (None: none).")
    )
    chat_template_path: str | None = _unsupported(None, "set tokenizer.chat_template and pass processing_class")
    eos_token: str | None = _unsupported(None, "set it on the tokenizer and pass processing_class")
    pad_token: str | None = _unsupported(None, "set it on the tokenizer and pass processing_class")

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self)


@dataclass
class KTOConfig(TokenWeightedArguments, _PreferenceFields):
    """TRL's ``KTOConfig``: :class:`hfacc.TokenWeightedArguments` with TRL's KTO fields and defaults."""

    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate (TRL's KTO default)."))
    precompute_ref_log_probs: bool = field(
        default=False, metadata=_help("Compute the reference's log-probs once before training (no reference held).")
    )
    precompute_ref_batch_size: int | None = field(default=None, metadata=_help("Rows per batch of that (None: 16)."))
    loss_type: str = _unsupported("kto", "hfacc's KTO loss is 'kto'")
    beta: float = field(default=0.1, metadata=_help("The loss's temperature beta."))
    desirable_weight: float = field(default=1.0, metadata=_help("Weight of the desirable rows' losses."))
    undesirable_weight: float = field(default=1.0, metadata=_help("Weight of the undesirable rows' losses."))
    train_sampling_strategy: str = _unsupported("sequential", "the trainer's sampler shuffles each epoch")
    sync_ref_model: bool = _unsupported(False, "reference updates")
    ref_model_mixup_alpha: float = _unsupported(0.6, "reference updates")
    ref_model_sync_steps: int = _unsupported(512, "reference updates")
    router_aux_loss_coef: float | None = _unsupported(None, "MoE auxiliary losses are not added")

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self)


@dataclass
class GRPOConfig(GRPOArguments):
    """TRL's ``GRPOConfig``: :class:`hfacc.GRPOArguments` (TRL's GRPO names already) with TRL's defaults and its
    model-loading fields; for :class:`hfacc.GRPOTrainer`."""

    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate (TRL's GRPO default)."))
    loss_type: str = field(
        default="dapo",
        metadata=_help("'dapo'/'token' (every completion token weighs the same), 'grpo'/'sequence', 'dr_grpo'."),
    )
    max_completion_length: int = field(default=512, metadata=_help("Longest completion sampled, in tokens."))
    model_init_kwargs: dict | None = field(
        default=None, metadata=_help("from_pretrained keywords for a model given by name (dtype, revision, ...).")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Run the model's own code from the hub."))
    disable_dropout: bool = field(default=False, metadata=_help("Set every dropout of the model to 0."))
    num_generations_eval: int | None = _unsupported(None, "GRPOTrainer does not evaluate during training")
    generation_batch_size: int | None = _unsupported(None, "set steps_per_generation")
    min_p: float | None = _unsupported(None, "min-p sampling")
    generation_kwargs: dict | None = _unsupported(None, "use temperature, top_p, top_k, repetition_penalty")
    chat_template_kwargs: dict | None = _unsupported(None, "chat template keywords")
    cache_implementation: str | None = _unsupported(None, "generation cache choice")
    delta: float | None = _unsupported(None, "two-sided clipping")
    importance_sampling_level: str = _unsupported("token", "sequence-level (GSPO) ratios")
    multi_objective_aggregation: str = _unsupported("sum_then_normalize", "other reward aggregations")
    mask_truncated_completions: bool = _unsupported(False, "masking truncated completions")
    sync_ref_model: bool = _unsupported(False, "reference updates")
    top_entropy_quantile: float = _unsupported(1.0, "entropy masking")
    entropy_coef: float = _unsupported(0.0, "an entropy bonus")
    off_policy_mask_threshold: float | None = _unsupported(None, "off-policy masking")
    log_completions: bool = _unsupported(False, "printing completions")
    cast_lm_head_to_fp32: bool = _unsupported(False, "an fp32 LM head")
    router_aux_loss_coef: float | None = _unsupported(None, "MoE auxiliary losses are not added")

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self)


@dataclass
class DistillationConfig(DistillationArguments):
    """TRL's ``DistillationConfig``: :class:`hfacc.DistillationArguments` with TRL's defaults (on-policy,
    ``lmbda=1``) and its model-loading fields; for :class:`hfacc.DistillationTrainer`."""

    learning_rate: float = field(default=1e-6, metadata=_help("The initial learning rate (TRL's default)."))
    max_completion_length: int = field(default=512, metadata=_help("Longest completion sampled, in tokens."))
    model_init_kwargs: dict | None = field(
        default=None, metadata=_help("from_pretrained keywords for a model given by name (dtype, revision, ...).")
    )
    trust_remote_code: bool = field(default=False, metadata=_help("Run the model's own code from the hub."))
    teacher_model_name_or_path: str | None = field(
        default=None, metadata=_help("The teacher, when DistillationTrainer gets no teacher_model.")
    )
    teacher_model_init_kwargs: dict | None = _unsupported(None, "pass a loaded teacher_model instead")
    teacher_model_revision: str | None = _unsupported(None, "pass a loaded teacher_model instead")
    disable_dropout: bool = field(default=False, metadata=_help("Set every dropout of the model to 0."))
    min_p: float | None = _unsupported(None, "min-p sampling")
    generation_kwargs: dict | None = _unsupported(None, "use temperature, top_p, top_k, repetition_penalty")
    chat_template_kwargs: dict | None = _unsupported(None, "chat template keywords")
    cache_implementation: str | None = _unsupported(None, "generation cache choice")
    log_completions: bool = _unsupported(False, "printing completions")
    max_tool_calling_iterations: int | None = _unsupported(None, "tool calling")

    def __post_init__(self):
        super().__post_init__()
        check_unsupported(self)


# ---- trainers --------------------------------------------------------------------------------------------------
class SFTTrainer(TokenWeightedTrainer):
    """TRL's ``SFTTrainer``: rows (``messages``; ``prompt``/``completion``; ``text``) tokenized and masked by
    :func:`hfacc.build_sft_dataset`, the loss per target token of the whole accumulation window."""

    def __init__(
        self,
        model,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
        formatting_func=None,
    ):
        args = as_config(args, SFTConfig, model, "SFT")
        if formatting_func is not None:
            raise ValueError("SFTTrainer: formatting_func is not supported; map the rows to a 'text' column first.")
        model, tokenizer = get_model_and_tokenizer(
            model,
            processing_class,
            model_init_kwargs=with_trust(args),
            peft_config=peft_config,
            owner="SFTTrainer",
        )

        def build(dataset):
            if is_tokenized(dataset, "input_ids"):
                return dataset
            columns = dataset.column_names
            if "messages" in columns and not args.assistant_only_loss:
                warn_once(
                    "sft-assistant",
                    "hfacc: SFTTrainer trains conversations on their assistant turns only (TRL's "
                    "assistant_only_loss=True); TRL's default trains every token. Give a 'text' column for that.",
                )
            if args.dataset_text_field != "text" and args.dataset_text_field in columns:
                dataset = dataset.rename_column(args.dataset_text_field, "text")
            return build_sft_dataset(
                dataset, tokenizer, max_length=args.max_length, truncation="right", num_proc=args.dataset_num_proc
            )

        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or DataCollatorForCausalLM(tokenizer.pad_token_id),
            train_dataset=each_split(train_dataset, build),
            eval_dataset=each_split(eval_dataset, build),
            processing_class=tokenizer,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )


def with_trust(args) -> dict | None:
    """``model_init_kwargs`` with the config's ``trust_remote_code``."""
    kwargs = dict(args.model_init_kwargs or {})
    if args.trust_remote_code:
        kwargs.setdefault("trust_remote_code", True)
    return kwargs or None


def build_pairs(args, tokenizer, dataset, *, unpaired: bool = False):
    if dataset is None or is_tokenized(dataset, "chosen_input_ids") or is_tokenized(dataset, "completion_input_ids"):
        return dataset
    truncation = get_truncation(args) if hasattr(args, "truncation_mode") else "right"
    return build_preference_dataset(
        dataset,
        tokenizer,
        max_length=args.max_length,
        truncation=truncation,
        num_proc=args.dataset_num_proc,
        unpaired=True if unpaired else None,
    )


def load_reference(ref_model, args, owner: str):
    if isinstance(ref_model, str):
        kwargs = args.model_init_kwargs or {}
        return load_causal_lm(ref_model, dtype=kwargs.get("dtype", kwargs.get("torch_dtype", "auto")))
    return ref_model


def precompute(args, datasets, reference, tokenizer):
    """The reference log-probs of every row, once, in the precision training computes the policy in."""
    options = dict(
        pad_token_id=tokenizer.pad_token_id,
        batch_size=args.precompute_ref_batch_size or 16,
        device=args.device,
        mixed_precision=get_training_autocast(args),
    )
    return [each_split(d, lambda split: precompute_reference_logps(split, reference, **options)) for d in datasets]


class DPOTrainer(TokenWeightedTrainer):
    """TRL's ``DPOTrainer``: pairs (``prompt``/``chosen``/``rejected``, conversational or plain; implicit prompts
    too) tokenized by :func:`hfacc.build_preference_dataset`, :class:`hfacc.DPOObjective`, the loss per pair of the
    whole accumulation window."""

    def __init__(
        self,
        model,
        ref_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
    ):
        args = as_config(args, DPOConfig, model, "DPO")
        model, tokenizer = get_model_and_tokenizer(
            model, processing_class, model_init_kwargs=with_trust(args), peft_config=peft_config, owner="DPOTrainer"
        )
        if args.disable_dropout:
            disable_dropout(model)
        loss_type, nll_weight = args.get_losses()
        train_ds = build_pairs(args, tokenizer, train_dataset)
        eval_ds = each_split(eval_dataset, lambda d: build_pairs(args, tokenizer, d))
        ref_model = load_reference(ref_model, args, "DPOTrainer")
        if args.precompute_ref_log_probs:
            reference = ref_model if ref_model is not None else model  # the policy before training
            train_ds, eval_ds = precompute(args, [train_ds, eval_ds], reference, tokenizer)
            ref_model = None
        warn_pair_unit("DPOTrainer", "pair")
        objective = DPOObjective(
            beta=args.beta,
            loss_type=loss_type,
            label_smoothing=args.label_smoothing,
            nll_weight=nll_weight,
            ref_model=ref_model,
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or DataCollatorForPreference(tokenizer.pad_token_id),
            train_dataset=train_ds,
            eval_dataset=eval_ds,
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            objective=objective,
        )


class RewardTrainer(TokenWeightedTrainer):
    """TRL's ``RewardTrainer``: a model given by name loads as a reward model (a causal LM gets a new score head),
    pairs as DPO's, :class:`hfacc.RewardObjective` (Bradley-Terry), the loss per pair of the window."""

    def __init__(
        self,
        model,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
    ):
        args = as_config(args, RewardConfig, model, "Reward")
        model, tokenizer = get_model_and_tokenizer(
            model,
            processing_class,
            model_init_kwargs=with_trust(args),
            peft_config=peft_config,
            reward=True,
            owner="RewardTrainer",
        )
        if args.disable_dropout:
            disable_dropout(model)
        warn_pair_unit("RewardTrainer", "pair")
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or DataCollatorForPreference(tokenizer.pad_token_id),
            train_dataset=build_pairs(args, tokenizer, train_dataset),
            eval_dataset=each_split(eval_dataset, lambda d: build_pairs(args, tokenizer, d)),
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            objective=RewardObjective(args.center_rewards_coefficient),
        )


class KTOTrainer(TokenWeightedTrainer):
    """TRL's ``KTOTrainer``: unpaired rows (``prompt``/``completion``/``label``; pairs are unpaired),
    :class:`hfacc.KTOObjective`, the loss per row of the window, its reference point from the whole window."""

    def __init__(
        self,
        model,
        ref_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        peft_config=None,
    ):
        args = as_config(args, KTOConfig, model, "KTO")
        model, tokenizer = get_model_and_tokenizer(
            model, processing_class, model_init_kwargs=with_trust(args), peft_config=peft_config, owner="KTOTrainer"
        )
        if args.disable_dropout:
            disable_dropout(model)
        train_ds = build_pairs(args, tokenizer, train_dataset, unpaired=True)
        eval_ds = each_split(eval_dataset, lambda d: build_pairs(args, tokenizer, d, unpaired=True))
        ref_model = load_reference(ref_model, args, "KTOTrainer")
        if args.precompute_ref_log_probs:
            reference = ref_model if ref_model is not None else model
            train_ds, eval_ds = precompute(args, [train_ds, eval_ds], reference, tokenizer)
            ref_model = None
        warn_pair_unit("KTOTrainer", "row")
        objective = KTOObjective(
            beta=args.beta,
            desirable_weight=args.desirable_weight,
            undesirable_weight=args.undesirable_weight,
            ref_model=ref_model,
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator or DataCollatorForUnpairedPreference(tokenizer.pad_token_id),
            train_dataset=train_ds,
            eval_dataset=eval_ds,
            processing_class=tokenizer,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            objective=objective,
        )
