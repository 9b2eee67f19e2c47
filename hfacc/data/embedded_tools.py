"""The offline tool task: products of two 3-digit numbers, which a tiny model cannot compute and can look up.

``hfacc grpo --embedded_dataset tools`` (recipes/configs/tiny_grpo_tools.yaml) trains on it: a short SFT on the
conversations of :func:`generate_tool_examples` teaches the ``<tool_call>`` format of the embedded chat template, then
GRPO with the :func:`multiply` tool on the prompts of :func:`generate_tool_prompt_rows`. Both factors are drawn from
400..999, so every product has six digits and every conversation the same layout: where a digit is copied from (the
question into the call, the tool's result into the answer) is the same number of tokens back in each, which a
two-layer model learns in a few hundred steps.

Part of the SFT conversations (``direct_fraction``) answer directly, without the tool, as a model would that was not
taught when to use one: the SFT model then calls the tool on only part of the questions, and answers the others
wrong (it cannot multiply). GRPO's correctness reward is what teaches it to call the tool.
"""

from __future__ import annotations

import random

TOOL_TASK = "multiply"
FACTORS = (400, 999)  # products of 160,000..998,001: six digits each


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(int(a) * int(b))


def get_tool_schemas() -> list[dict]:
    """The JSON schema of :func:`multiply` (transformers' ``get_json_schema``), as a row's ``tools``."""
    from transformers.utils import get_json_schema

    return [get_json_schema(multiply)]


def _question(rng: random.Random) -> tuple[list[dict], int, int]:
    a, b = rng.randint(*FACTORS), rng.randint(*FACTORS)
    return [{"role": "user", "content": f"What is {a} x {b}?"}], a, b


def generate_tool_examples(n: int = 4000, seed: int = 0, direct_fraction: float = 0.3) -> list[dict]:
    """``n`` SFT rows ``{"messages", "tools", "task"}``: a question, the assistant's ``multiply`` call, the tool's
    result and the answer; ``direct_fraction`` of them answer at once instead (no call). The same for the same seed.

    >>> generate_tool_examples(1, seed=1, direct_fraction=0.0)[0]["messages"][1]["tool_calls"][0]["function"]
    {'name': 'multiply', 'arguments': {'a': 537, 'b': 982}}
    """
    rng, tools = random.Random(seed), get_tool_schemas()
    rows = []
    for _ in range(n):
        messages, a, b = _question(rng)
        product = multiply(a, b)
        if rng.random() < direct_fraction:
            messages.append({"role": "assistant", "content": product})
        else:
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "multiply", "content": product},
                {"role": "assistant", "content": product},
            ]
        rows.append({"messages": messages, "tools": tools, "task": TOOL_TASK})
    return rows


def generate_tool_prompt_rows(n: int, seed: int) -> list[dict]:
    """``n`` GRPO prompt rows ``{"prompt", "answer", "task"}`` of the task (the ``answer`` column the correctness
    reward reads), the same for the same seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, a, b = _question(rng)
        rows.append({"prompt": prompt, "answer": multiply(a, b), "task": TOOL_TASK})
    return rows


__all__ = ["TOOL_TASK", "generate_tool_examples", "generate_tool_prompt_rows", "get_tool_schemas", "multiply"]
