"""The offline tool task: products of two 3-digit numbers, which a tiny model cannot compute and can look up.

``hfacc grpo --embedded_dataset tools`` (recipes/configs/tiny_grpo_tools.yaml) trains on it: a short SFT on the
conversations of :func:`generate_tool_examples` teaches the ``<tool_call>`` format of the embedded chat template, then
GRPO with the :func:`multiply` tool on the prompts of :func:`generate_tool_prompt_rows`. Both factors are drawn from
400..999, so every product has six digits and every conversation the same layout: where a digit is copied from (the
question into the call, the tool's result into the answer) is the same number of tokens back in each, which a
two-layer model learns in a few hundred steps.

Part of the SFT conversations (``direct_fraction``) answer directly, without the tool, with an estimate ("About
460000"), as a model would that cannot multiply: the SFT model then calls the tool on only part of its samples, and
above one half its greedy answer is the estimate (exact match 0). GRPO's correctness reward is what teaches it to call
the tool (docs/tools_and_environments.md, "The demo, measured").
"""

from __future__ import annotations

import random
import re

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
    result and the answer; ``direct_fraction`` of them answer at once instead, with the product rounded to ten
    thousands ("About 460000": an estimate, never an exact match). The same for the same seed.

    >>> generate_tool_examples(1, seed=1, direct_fraction=0.0)[0]["messages"][1]["tool_calls"][0]["function"]
    {'name': 'multiply', 'arguments': {'a': 537, 'b': 982}}
    """
    rng, tools = random.Random(seed), get_tool_schemas()
    rows = []
    for _ in range(n):
        messages, a, b = _question(rng)
        product = multiply(a, b)
        if rng.random() < direct_fraction:  # an estimate: the model cannot multiply, so it guesses the magnitude
            messages.append({"role": "assistant", "content": f"About {round(int(product), -4)}"})
        else:
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "multiply", "content": product},
                {"role": "assistant", "content": product},
            ]
        rows.append({"messages": messages, "tools": tools, "task": TOOL_TASK})
    return rows


QUESTION = re.compile(r"What is (\d+) x (\d+)\?")


def copied_digits(prompts, completions, **columns) -> list[float]:
    """Partial credit for the two copies the task needs: the share of digits copied right, of the question's two
    factors into the first ``multiply`` call (6 digits) and of the tool's result into the last answer (6 digits).

    Each copy is scored position by position (a digit left out or added shifts the rest: they count as wrong); a
    completion without a call scores 0 (it copied nothing), as does a text completion. Where exact match
    (``correctness``) is 1 for few samples (one digit of twelve sampled wrong spoils it), this ranks a group's
    samples by how much of the copy they got right, at the position where they differ.

    >>> call = {"function": {"name": "multiply", "arguments": {"a": 123, "b": 456}}}
    >>> turns = [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "56088"}]
    >>> copied_digits([[{"role": "user", "content": "What is 123 x 457?"}]],
    ...               [turns + [{"role": "assistant", "content": "56188"}]])
    [0.8181818181818182]
    """
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        question = QUESTION.search(str(prompt[-1]["content"] if isinstance(prompt, list) else prompt))
        calls = [] if isinstance(completion, str) else [c for m in completion for c in m.get("tool_calls") or []]
        results = [] if isinstance(completion, str) else [m for m in completion if m.get("role") == "tool"]
        if question is None or not calls:
            out.append(0.0)
            continue
        arguments = calls[0].get("function", calls[0]).get("arguments") or {}
        factors = "".join(question.groups())
        given = "".join(str(arguments.get(k, "")) for k in ("a", "b"))
        answers = [m for m in completion if m.get("role") == "assistant"]
        result = str(results[0]["content"]) if results else ""
        answer = str(answers[-1]["content"]).strip() if len(answers) > 1 else ""
        right = _same_digits(factors, given) + _same_digits(result, answer)
        out.append(right / (len(factors) + len(result)))
    return out


def _same_digits(reference: str, copy: str) -> int:
    return sum(x == y for x, y in zip(reference, copy, strict=False))


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
