"""Model loading: hub ids and local directories for real runs, tiny models built from a config for offline ones."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

# The tiny Llama is built with the embedded default, which needs it; it is re-exported here with the other models.
from ..data.embedded import build_default_model, build_default_tokenizer
from ..data.embedded import build_tiny_llama as build_tiny_llama
from ..data.vision import get_processor
from ..runtime.config import ConfigError

logger = logging.getLogger(__name__)

# Any of these makes a folder hold a tokenizer AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_causal_lm(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype = "auto",
    revision: str | None = None,
    attn_implementation: str | None = None,
):
    """Load a causal LM from a hub id or a local directory, safely.

    Weights load through safetensors only (``use_safetensors=True``: a repository that ships only pickled
    ``.bin`` weights is refused rather than unpickled), and ``trust_remote_code`` stays off unless asked for. A
    vision-language model loads as its ``*ForConditionalGeneration`` (``AutoModelForImageTextToText``).
    Weights that do not fit the config (other shapes, layers the file lacks) are a :class:`ConfigError`, not layers
    silently initialized at random; so are a local directory without a readable ``config.json`` or with damaged
    weights.
    """
    return _load_checked(
        name_or_path,
        None,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        revision=revision,
        attn_implementation=attn_implementation,
    )


def load_reward_model(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype = "auto",
    revision: str | None = None,
    attn_implementation: str | None = None,
    pad_token_id: int | None = None,
):
    """Load a reward model (``AutoModelForSequenceClassification`` with ``num_labels=1``) from a hub id or a local
    directory, as safely as :func:`load_causal_lm`.

    A causal LM's checkpoint (an SFT model) loads with a new, randomly initialized score head: said at INFO, as TRL's
    ``RewardTrainer`` starts one. A classifier whose head has another number of outputs is a :class:`ConfigError`
    (a reward model gives one score per sequence). ``pad_token_id`` goes into the config (the model's own pooling
    needs it for batches of several sequences).
    """
    model = _load_checked(
        name_or_path,
        AutoModelForSequenceClassification,
        trust_remote_code=trust_remote_code,
        dtype=dtype,
        revision=revision,
        attn_implementation=attn_implementation,
        num_labels=1,
        new_head=("score.",),
    )
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def as_reward_model(model, pad_token_id: int | None = None, seed: int = 0):
    """A reward model (``AutoModelForSequenceClassification``, ``num_labels=1``) with ``model``'s backbone: a causal
    LM's weights and a new score head (seeded), in ``model``'s dtype; ``pad_token_id`` goes into its config."""
    import copy

    config = copy.deepcopy(model.config)
    config.num_labels = 1
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reward = AutoModelForSequenceClassification.from_config(config)
    missing, _ = reward.load_state_dict(model.state_dict(), strict=False)  # the causal LM's head is not wanted
    if any(not k.startswith("score.") for k in missing):
        raise ValueError(f"{type(model).__name__}'s backbone does not fit {type(reward).__name__}: {missing[:3]}")
    return reward.to(next(model.parameters()).dtype)


def _load_checked(
    name_or_path: str,
    model_class,
    *,
    trust_remote_code: bool,
    dtype,
    revision,
    attn_implementation,
    num_labels: int | None = None,
    new_head: tuple[str, ...] = (),
):
    """``model_class.from_pretrained`` (None: a causal LM, or a vision-language model's image-text-to-text class),
    safetensors only; weights that do not fit, or are missing (but a new head's, ``new_head`` prefixes), are a
    ConfigError."""
    local = Path(name_or_path).is_dir()
    if local:
        check_model_dir(Path(name_or_path))
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
        if num_labels is not None:
            config.num_labels = num_labels
        kwargs = {"config": config, "trust_remote_code": trust_remote_code, "revision": revision}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        if model_class is None:
            model_class = AutoModelForCausalLM
            if is_vision_language_config(config):  # Qwen2.5-VL, Gemma 3, Idefics3, LLaVA, ...: image-text-to-text
                from transformers import AutoModelForImageTextToText as model_class
        with _held_load_report() as reports:
            model, info = model_class.from_pretrained(
                name_or_path, dtype=dtype, use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True,
                **kwargs,
            )  # fmt: skip
        # A causal LM loaded with a new head (a reward model from an SFT model) is what was asked: transformers'
        # table of its MISSING head and UNEXPECTED lm_head is noise (the line below says it at INFO); any other report
        # is shown as transformers wrote it.
        expected = new_head + ("lm_head.",)
        if not (new_head and all(k.startswith(expected) for k in [*info["missing_keys"], *info["unexpected_keys"]])):
            for record in reports:
                logging.getLogger(record.name).handle(record)
    except Exception as err:
        if not local or "trust_remote_code" in str(err):
            raise
        what = "its weights are damaged or incomplete" if "Safetensor" in type(err).__name__ else "it cannot be loaded"
        raise ConfigError(
            f"--model_name_or_path {name_or_path}: {what} ({_first_line(err)}). Copy or save the model again."
        ) from err
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched and new_head and mismatched[0][0].startswith(new_head):
        name, saved, expected = mismatched[0]
        raise ConfigError(
            f"--model_name_or_path {name_or_path}: its head '{name}' has {saved[0]} outputs; a reward model gives one "
            "score per sequence (num_labels=1). Start from a causal LM or a reward model instead."
        )
    if mismatched:
        name, saved, expected = mismatched[0]
        raise ConfigError(
            f"--model_name_or_path {name_or_path}: its weights do not fit its config.json: '{name}' is "
            f"{list(saved)} in the weights and {list(expected)} by the config ({len(mismatched)} such weights). The "
            "config and the weights are of different models."
        )
    missing = sorted(k for k in info.get("missing_keys") or () if not k.startswith(new_head))
    if missing:
        raise ConfigError(
            f"--model_name_or_path {name_or_path}: {len(missing)} weight(s) of the model its config.json describes "
            f"are not in its weights ('{missing[0]}', ...): they would train from random values. The config and the "
            "weights are of different models."
        )
    if new_head and info.get("missing_keys"):
        logger.info("hfacc: %s: a new score head (%s), initialized at random.", name_or_path, type(model).__name__)
    return model


@contextlib.contextmanager
def _held_load_report():
    """Inside: transformers' weight-loading report (its "LOAD REPORT" table) is held back, not logged; the list of
    held records is yielded, for the caller to log or drop."""
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    source = logging.getLogger("transformers.modeling_utils")
    source.addFilter(hold)
    try:
        yield held
    finally:
        source.removeFilter(hold)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_model_dir(path: Path) -> None:
    """A ConfigError naming what a local model directory lacks: a readable config.json, safetensors weights."""
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"--model_name_or_path {path}: the folder has no config.json. Give the folder that save_pretrained wrote "
            "(config.json and model.safetensors)."
        )
    try:
        json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{config} is not valid JSON ({err}); fix it or save the model again.") from None
    if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        pickled = sorted(p.name for p in path.glob("*.bin"))
        if pickled:
            raise ConfigError(
                f"--model_name_or_path {path}: its weights are pickled ({pickled[0]}), and hfacc loads safetensors "
                "only (unpickling can run code). If you trust the file, convert it once: load it with transformers "
                "and save_pretrained (which writes model.safetensors)."
            )
        raise ConfigError(f"--model_name_or_path {path}: the folder has no model.safetensors.")


def is_vision_language_config(config) -> bool:
    """Whether a model config describes a vision-language model (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def get_tokenizer(name_or_path: str, *, trust_remote_code: bool = False, revision: str | None = None):
    """Load a tokenizer; give it a pad token if it has none, and say so.

    The pad token falls back to EOS. That is safe with hfacc's collator, which masks padding through the labels
    (-100), never by token id, so EOS stays a target where the data puts it.
    """
    from transformers import AutoTokenizer

    path = Path(name_or_path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"tokenizer {name_or_path}: the folder has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...). "
            "Save the tokenizer there too (tokenizer.save_pretrained), or give --tokenizer_name_or_path."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    except Exception as err:
        if not path.is_dir():
            raise
        raise ConfigError(f"tokenizer {name_or_path}: it cannot be loaded ({_first_line(err)}).") from err
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError(f"{name_or_path}: the tokenizer has neither a pad, an EOS nor an UNK token to pad with.")
        tokenizer.pad_token = fallback
        logger.warning("hfacc: the tokenizer had no pad token; using %r (labels of padding are -100).", fallback)
    return tokenizer


def apply_lora(
    model, r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules="all-linear", task_type="CAUSAL_LM"
):
    """Wrap ``model`` with a LoRA adapter (peft); only the adapter's weights train (``task_type="SEQ_CLS"``: a
    reward model, whose new score head trains whole too)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type=task_type
    )
    model = get_peft_model(model, config)
    trainable, total = (
        sum(p.numel() for p in model.parameters() if p.requires_grad),
        sum(p.numel() for p in model.parameters()),
    )
    logger.info("hfacc: LoRA r=%d: %d of %d parameters train (%.2f %%)", r, trainable, total, 100 * trainable / total)
    return model


EMBEDDED_MODELS = ("llama", "qwen2_5_vl")


@dataclass
class ModelArguments:
    """Which model to train and how to load it."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Hub id or local directory of a causal LM or a vision-language model (its processor is loaded "
            "too). None: the embedded tiny model (offline, see embedded_model)."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use, if not the model's own."}
    )
    model_revision: str | None = field(default=None, metadata={"help": "Branch, tag or commit of the hub model."})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "Weights dtype: 'auto' (as saved), 'float32', 'bfloat16' or 'float16'.",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention kernel: 'sdpa', 'eager', 'flash_attention_2'; None: default."}
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Run modeling code shipped with the hub repository. Off unless you trust its authors."},
    )
    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the LoRA path. Non-zero makes accumulation inexact (hfacc verify says so)."},
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "Modules to adapt ('all-linear': every Linear)."}
    )
    embedded_model: str = field(
        default="llama",
        metadata={
            "help": "The embedded tiny model (no model_name_or_path): 'llama' (a Llama and a BPE tokenizer built "
            "here) or 'qwen2_5_vl' (a Qwen2.5-VL and its processor built here, for image chat).",
            "choices": list(EMBEDDED_MODELS),
        },
    )
    embedded_hidden_size: int = field(default=256, metadata={"help": "Hidden size of the embedded tiny model."})
    embedded_num_layers: int = field(default=2, metadata={"help": "Layers of the embedded tiny model."})

    def __post_init__(self):
        if self.lora_r < 1:
            raise ValueError(f"lora_r={self.lora_r}: the LoRA rank must be >= 1.")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout={self.lora_dropout}: it must be in [0, 1).")
        if self.embedded_model not in EMBEDDED_MODELS:
            raise ValueError(f"embedded_model={self.embedded_model!r}: use one of {list(EMBEDDED_MODELS)}.")
        for name in ("model_name_or_path", "tokenizer_name_or_path"):
            value = getattr(self, name)
            if value is not None and Path(value).is_file():  # transformers' answer: "not a valid JSON file"
                raise ValueError(
                    f"{name}={value}: it is a file; give the folder it is in (the one save_pretrained wrote, with "
                    "config.json and the weights or tokenizer files), or a Hub id."
                )


def load_tokenizer(args: ModelArguments):
    """The tokenizer of ``args`` alone (``tokenizer_name_or_path``, else the model's, else the embedded default's),
    for tools that need no model (``hfacc show-mask``)."""
    name = args.tokenizer_name_or_path or args.model_name_or_path
    if name is None and args.embedded_model == "qwen2_5_vl":  # the embedded vision-language model's processor
        from ..data.embedded_vision import build_tiny_vlm

        return build_tiny_vlm(args.embedded_hidden_size, args.embedded_num_layers)[1]
    if name is None:
        return build_default_tokenizer()
    kwargs = {"trust_remote_code": args.trust_remote_code, "revision": args.model_revision}
    try:
        vision = is_vision_language_config(AutoConfig.from_pretrained(name, **kwargs))
    except (OSError, ValueError):  # a folder holding only a tokenizer
        vision = False
    return get_processor(name, **kwargs) if vision else get_tokenizer(name, **kwargs)


def load_model_and_tokenizer(args: ModelArguments, seed: int = 0):
    """The model and tokenizer of ``args``: from the hub or a local directory, or the embedded default.

    The embedded default trains its tokenizer on the project's own corpus and sizes a tiny Llama to it; both are
    deterministic, so every rank of a distributed run builds the same ones. For a vision-language model the
    "tokenizer" is its processor (:func:`hfacc.data.vision.get_processor`), which build_sft_dataset and the collator
    take.
    """
    if args.model_name_or_path is not None and Path(args.model_name_or_path).is_dir():
        check_model_dir(Path(args.model_name_or_path))  # what the folder lacks, before its tokenizer trips on it
    if args.model_name_or_path is None and args.embedded_model == "qwen2_5_vl":
        from ..data.embedded_vision import build_tiny_vlm

        model, tokenizer = build_tiny_vlm(args.embedded_hidden_size, args.embedded_num_layers, seed=seed)
    elif args.model_name_or_path is None:
        tokenizer = load_tokenizer(args)
        model = build_default_model(
            tokenizer, hidden_size=args.embedded_hidden_size, num_layers=args.embedded_num_layers, seed=seed
        )
    else:
        tokenizer = load_tokenizer(args)  # a vision-language model's processor (hfacc.data.vision)
        model = load_causal_lm(
            args.model_name_or_path,
            trust_remote_code=args.trust_remote_code,
            dtype=args.dtype,
            revision=args.model_revision,
            attn_implementation=args.attn_implementation,
        )
    return apply_lora_settings(model, args), tokenizer


def apply_lora_settings(model, args: ModelArguments, task_type: str = "CAUSAL_LM"):
    """``model`` with the LoRA adapter ``args`` ask for (``--use_lora``), or ``model`` itself."""
    if not args.use_lora:
        return model
    targets = args.lora_target_modules
    target = targets[0] if targets == ["all-linear"] else targets
    return apply_lora(model, args.lora_r, args.lora_alpha, args.lora_dropout, target, task_type)
