"""Reward functions for :class:`hfacc.GRPOTrainer` (TRL's signature), and how a recipe names them.

A reward function is ``f(prompts, completions, **columns) -> list[float]``: one float per completion, ``columns`` the
prompts dataset's other columns (one entry per completion). Completions of chat prompts are
``[{"role": "assistant", "content": text}]``, of text prompts the text. A reward model (a sequence-classification
model with one output, e.g. trained by ``hfacc reward``) is one too, as in TRL: :class:`RewardModelFunction` scores
prompt + completion through the reward model's own tokenizer.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.formats import DataError
from ..models.loading import get_tokenizer, load_reward_model
from ..ops.scores import get_pad_token_id, get_score_head, get_sequence_scores, reward_model_problem


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of its last assistant message (a multi-turn completion's
    answer after its tool results; never a tool's result)."""
    if isinstance(completion, str):
        return completion
    turns = [m for m in completion if m.get("role", "assistant") == "assistant"] or [{"content": ""}]
    return str(turns[-1]["content"])


def correctness(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **columns) -> list[float]:
    """1.0 where the completion, stripped, is exactly the ``answer`` column, else 0.0 (exact match).

    >>> correctness(["q", "q"], ["4 + 5 = 9", " 9"], answer=["4 + 5 = 9", "8"])
    [1.0, 0.0]
    """
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


def similarity(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **columns) -> list[float]:
    """Partial credit: ``difflib``'s similarity ratio of the completion to the ``answer`` column, in [0, 1].

    A denser signal than exact match: a completion one letter off scores close to 1, so groups whose completions are
    all wrong still rank them.

    >>> similarity(["q"], ["T I G E"], answer=["T I G E R"])
    [0.875]
    """
    return [
        difflib.SequenceMatcher(None, completion_text(c).strip(), str(a).strip()).ratio()
        for c, a in zip(completions, answer, strict=True)
    ]


def tool_use(prompts: Sequence[Any], completions: Sequence[Any], **columns) -> list[float]:
    """Partial credit for a well-formed tool call: 1.0 where a multi-turn completion called a tool and no call
    failed (a ``tool`` message that does not start with ``Error:``), else 0.0. Text completions score 0.

    >>> call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    >>> tool_use(["q"] * 3, [[call, {"role": "tool", "content": "4"}], [call, {"role": "tool", "content": "Error: x"}],
    ...                      [{"role": "assistant", "content": "4"}]])
    [1.0, 0.0, 0.0]
    """
    out = []
    for completion in completions:
        results = [] if isinstance(completion, str) else [m for m in completion if m.get("role") == "tool"]
        out.append(float(bool(results) and not any(str(m["content"]).startswith("Error:") for m in results)))
    return out


REWARDS: dict[str, Callable] = {"correctness": correctness, "similarity": similarity, "tool_use": tool_use}


class RewardModelFunction:
    """A reward model as a reward function: each completion's score, read after its prompt.

    The text is the prompt and the completion together: a chat prompt's messages and the completion's, rendered by
    the reward model's tokenizer's chat template; text prompts and completions concatenated (as TRL's
    ``GRPOTrainer`` scores them). The score is the model's output where its own pooling reads it
    (:func:`hfacc.ops.scores.get_sequence_scores`), without gradient, ``batch_size`` completions at a time.

    Args:
        model: a sequence-classification model with ``num_labels=1`` and a ``pad_token_id``.
        tokenizer: its tokenizer (a chat template for chat prompts).
        batch_size: completions per forward.
        max_length: longest scored sequence in tokens (longer ones keep their end); None: no limit.
    """

    def __init__(self, model: nn.Module, tokenizer, batch_size: int = 32, max_length: int | None = None):
        problem = reward_model_problem(model)
        if problem:
            raise ValueError(f"reward model: {problem}.")
        if getattr(tokenizer, "pad_token_id", None) is None:
            raise ValueError("reward model: its tokenizer has no pad token; set tokenizer.pad_token.")
        configured = get_pad_token_id(model)
        # hfacc.ops.scores refuses it per batch; say it before any step. A model without a per-position head (an
        # encoder whose classifier reads its pooled first token) reads no pad id: nothing to refuse there.
        if configured != tokenizer.pad_token_id and get_score_head(model) is not None:
            raise ValueError(
                f"reward model: its tokenizer pads with token id {tokenizer.pad_token_id}, but its config has "
                f"pad_token_id={configured}: its own pooling (the rightmost token that is not pad_token_id) would read "
                f"the padding of every batch of unequal lengths. Set model.config.pad_token_id = "
                f"{tokenizer.pad_token_id} (TRL sets it from the tokenizer), or give the tokenizer that pad token."
            )
        self.model, self.tokenizer, self.batch_size, self.max_length = model, tokenizer, batch_size, max_length
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
        self.__name__ = str(name).rstrip("/").split("/")[-1]  # TRL names a reward model's reward so

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What is scored: each prompt with its completion."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, str) and isinstance(completion, str):
                out.append(prompt + completion)
            else:
                messages = list(prompt if not isinstance(prompt, str) else [{"role": "user", "content": prompt}])
                messages += completion if not isinstance(completion, str) else [completion_message(completion)]
                out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return out

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns) -> list[float]:
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        scores: list[float] = []
        try:
            texts = self.texts(prompts, completions)
            for start in range(0, len(texts), self.batch_size):
                ids = self.tokenizer(texts[start : start + self.batch_size], add_special_tokens=False)["input_ids"]
                if self.max_length:
                    ids = [x[-self.max_length :] for x in ids]
                width = max(len(x) for x in ids)
                batch = {
                    "input_ids": torch.tensor([x + [self.tokenizer.pad_token_id] * (width - len(x)) for x in ids]),
                    "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
                }
                batch = {k: v.to(device) for k, v in batch.items()}
                scores += get_sequence_scores(self.model, batch)[1].tolist()
        finally:
            self.model.train(was_training)
        return scores


def completion_message(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def get_reward_function(func: Any, tokenizer=None, device=None) -> Callable:
    """``func`` as a reward function: itself if it is one; a reward model (a sequence-classification model, scored
    through ``tokenizer``, by default the one saved with it); or the path of one (a local directory or a hub id), which
    is loaded (:func:`hfacc.models.loading.load_reward_model`) onto ``device``."""
    if isinstance(func, str):
        if func in REWARDS or ":" in func:
            return get_reward_funcs([func])[0]
        model = load_reward_model(func, dtype="float32")
        tokenizer = tokenizer if tokenizer is not None else get_tokenizer(func)
        model.config.pad_token_id = tokenizer.pad_token_id
        func = model
    if isinstance(func, nn.Module):
        if tokenizer is None:
            source = getattr(func.config, "_name_or_path", "")
            if not source:
                raise ValueError(
                    f"reward model {type(func).__name__}: no tokenizer to score with; pass its tokenizer "
                    "(GRPOTrainer's reward_processing_classes, as in TRL)."
                )
            tokenizer = get_tokenizer(source)
        if device is not None:
            func.to(device)
        return RewardModelFunction(func, tokenizer)
    if isinstance(func, RewardModelFunction) and device is not None:
        func.model.to(device)  # e.g. loaded by name (get_reward_funcs) before the trainer knew its device
    if not callable(func):
        raise ValueError(f"reward function {func!r}: give a function f(prompts, completions, **columns) or a model.")
    return func


def get_reward_funcs(names: Sequence[str]) -> list[Callable]:
    """The functions ``names`` stand for: a built-in name (``correctness``, ``similarity``), ``module:function``
    (``module.function`` too), imported from the Python path, or the directory of a reward model
    (:class:`RewardModelFunction`, its own tokenizer)."""
    funcs = []
    for name in names:
        if name in REWARDS:
            funcs.append(REWARDS[name])
            continue
        if Path(name).is_dir():
            funcs.append(get_reward_function(name))
            continue
        module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
        if not (module and attr):
            raise DataError(f"reward function {name!r}: use one of {sorted(REWARDS)} or 'module:function'.")
        func = _import_reward_function(name, module, attr)
        if not callable(func):
            raise DataError(f"reward function {name!r} is not callable.")
        funcs.append(func)
    return funcs


def import_function(name: str, what: str = "reward function"):
    """The function ``name`` (``module:function``, or ``module.function``) stands for, imported from the Python path;
    a DataError naming ``what`` it is for (a reward function, a tool) where it cannot be had."""
    module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not (module and attr):
        raise DataError(f"{what} {name!r}: give it as 'module:function'.")
    func = _import_reward_function(name, module, attr, what)
    if not callable(func):
        raise DataError(f"{what} {name!r} is not callable.")
    return func


def _import_reward_function(name: str, module: str, attr: str, what: str = "reward function"):
    """``module.attr``, or a DataError that says what failed: the module not on the path (with the PYTHONPATH
    fix: the ``hfacc`` command and ``accelerate launch`` do not put the current folder on it), the module's own
    imports, or no such function in it."""
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):  # the module itself (or its package) is not found
            top = module.split(".")[0]
            here = [p for p in (Path(f"{top}.py"), Path(top)) if p.exists()]
            detail = (
                f"{here[0]} is in this folder, which is not on the path"
                if here
                else "it is not installed, and no folder on the path holds it"
            )
            raise DataError(
                f"{what} {name!r}: no module {module!r} on the Python path ({detail}). Run with "
                f"PYTHONPATH set to the folder that holds {top}.py, e.g. PYTHONPATH=. hfacc grpo ..."
            ) from err
        raise DataError(f"{what} {name!r}: its module {module!r} does not import: {err}.") from err
    except Exception as err:  # an error inside the user's module: its own message says what
        raise DataError(f"{what} {name!r}: importing {module!r} failed: {type(err).__name__}: {err}") from err
    if not hasattr(loaded, attr):
        names = [n for n in dir(loaded) if not n.startswith("_") and callable(getattr(loaded, n))]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" Did you mean {module}:{close[0]}?" if close else ""
        raise DataError(f"{what} {name!r}: module {module!r} has no {attr!r}.{hint}")
    return getattr(loaded, attr)


__all__ = [
    "REWARDS",
    "RewardModelFunction",
    "completion_text",
    "correctness",
    "get_reward_function",
    "get_reward_funcs",
    "import_function",
    "similarity",
    "tool_use",
]
