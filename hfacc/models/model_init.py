"""A model given as TRL's trainers take it: a hub id or local directory (loaded with ``model_init_kwargs``) or a
model object, a tokenizer that may be left out (loaded from the model's name), and a ``peft_config``."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .loading import get_tokenizer, load_causal_lm, load_reward_model

logger = logging.getLogger(__name__)

# The from_pretrained keywords of TRL's model_init_kwargs that hfacc's safe loaders take.
MODEL_INIT_KEYS = ("dtype", "torch_dtype", "trust_remote_code", "revision", "attn_implementation")


def get_model_and_tokenizer(
    model: str | nn.Module,
    processing_class=None,
    *,
    model_init_kwargs: dict[str, Any] | None = None,
    peft_config=None,
    reward: bool = False,
    owner: str = "the trainer",
):
    """``(model, tokenizer)`` from TRL's call shape.

    ``model`` a string: loaded with :func:`hfacc.load_causal_lm` (``reward=True``: :func:`hfacc.load_reward_model`,
    a new score head on a causal LM) and ``model_init_kwargs`` (``dtype``, ``trust_remote_code``, ``revision``,
    ``attn_implementation``; any other key is an error). ``processing_class`` None: the tokenizer saved with the
    model (:func:`hfacc.get_tokenizer`: a missing pad token falls back to EOS, said once). ``peft_config`` (a
    ``peft.PeftConfig``): the model is wrapped with ``peft.get_peft_model``.
    """
    kwargs = dict(model_init_kwargs or {})
    if isinstance(model, str):
        unknown = sorted(set(kwargs) - set(MODEL_INIT_KEYS))
        if unknown:
            raise ValueError(
                f"{owner}: model_init_kwargs {unknown} are not supported; hfacc loads models with "
                f"{list(MODEL_INIT_KEYS)} only (quantization and device maps are not supported)."
            )
        dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "auto"))
        trust, revision = kwargs.get("trust_remote_code", False), kwargs.get("revision")
        tokenizer = processing_class
        if tokenizer is None:
            tokenizer = get_tokenizer(model, trust_remote_code=trust, revision=revision)
        options = dict(trust_remote_code=trust, dtype=dtype, revision=revision)
        options["attn_implementation"] = kwargs.get("attn_implementation")
        if reward:
            loaded = load_reward_model(model, pad_token_id=tokenizer.pad_token_id, **options)
        else:
            loaded = load_causal_lm(model, **options)
    else:
        if kwargs:
            raise ValueError(
                f"{owner}: model_init_kwargs is for a model given by name; this model is already loaded "
                "(drop model_init_kwargs, or pass the model's name)."
            )
        loaded, tokenizer = model, processing_class
        if tokenizer is None:
            name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
            if not name:
                raise ValueError(
                    f"{owner}: processing_class=None and the model has no name to load its tokenizer from; "
                    "pass processing_class=<the tokenizer>."
                )
            tokenizer = get_tokenizer(name)
        if reward and tokenizer.pad_token_id is not None and getattr(loaded.config, "pad_token_id", None) is None:
            loaded.config.pad_token_id = tokenizer.pad_token_id  # the model's pooling reads the last non-pad token
    if peft_config is not None:
        from peft import get_peft_model

        loaded = get_peft_model(loaded, peft_config)
    return loaded, tokenizer


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout's probability to 0 (TRL's ``disable_dropout=True``)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def get_policy_for_trainer(model, processing_class, args, peft_config, owner: str):
    """The policy and tokenizer of an online trainer (GRPO, on-policy distillation) called as TRL calls one: a
    model's name (loaded with ``args.model_init_kwargs``), no ``processing_class``, a ``peft_config``; a model and
    tokenizer given as objects pass through. ``args.disable_dropout`` zeroes its dropout."""
    if isinstance(model, str) or processing_class is None or peft_config is not None:
        model, processing_class = get_model_and_tokenizer(
            model,
            processing_class,
            model_init_kwargs=getattr(args, "model_init_kwargs", None),
            peft_config=peft_config,
            owner=owner,
        )
    if getattr(args, "disable_dropout", False):
        disable_dropout(model)
    return model, processing_class
