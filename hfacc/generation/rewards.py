"""Reward functions for :class:`hfacc.GRPOTrainer` (TRL's signature), and how a recipe names them.

A reward function is ``f(prompts, completions, **columns) -> list[float]``: one float per completion, ``columns`` the
prompts dataset's other columns (one entry per completion). Completions of chat prompts are
``[{"role": "assistant", "content": text}]``, of text prompts the text.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from ..data.formats import DataError


def completion_text(completion: Any) -> str:
    """The text of a completion: itself, or the content of its (last) assistant message."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"])


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


REWARDS: dict[str, Callable] = {"correctness": correctness, "similarity": similarity}


def get_reward_funcs(names: Sequence[str]) -> list[Callable]:
    """The functions ``names`` stand for: a built-in name (``correctness``, ``similarity``) or ``module:function``
    (``module.function`` too), imported from the Python path."""
    funcs = []
    for name in names:
        if name in REWARDS:
            funcs.append(REWARDS[name])
            continue
        module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
        if not (module and attr):
            raise DataError(f"reward function {name!r}: use one of {sorted(REWARDS)} or 'module:function'.")
        try:
            func = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise DataError(f"reward function {name!r} cannot be imported ({err}).") from err
        if not callable(func):
            raise DataError(f"reward function {name!r} is not callable.")
        funcs.append(func)
    return funcs


__all__ = ["REWARDS", "completion_text", "correctness", "get_reward_funcs", "similarity"]
