"""Generation-based evaluation: answer held-out prompts greedily and score them with exact match."""

from __future__ import annotations

from pathlib import Path

from .engine import TransformersEngine

EXACT_MATCH_PATH = Path(__file__).resolve().parents[1] / "metrics" / "exact_match" / "exact_match.py"


def load_exact_match():
    """The exact-match metric module shipped in the repo, loaded through ``evaluate`` (works offline)."""
    import evaluate

    return evaluate.load(str(EXACT_MATCH_PATH))


def generate_answers(
    model, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 48, batch_size: int = 32, engine=None
):
    """Greedy answers to ``conversations`` (each ending with a user turn), decoded without special tokens.

    ``engine``: a :class:`hfacc.generation.engine.GenerationEngine` to answer with (vLLM, holding ``model``'s weights:
    ``engine.update(...)`` first); None: ``model.generate``.
    """
    prompt_ids = [
        tokenizer(
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )["input_ids"]
        for c in conversations
    ]
    if engine is None:
        answers = TransformersEngine(model, tokenizer).answer(prompt_ids, max_new_tokens, batch_size=batch_size)
    else:
        answers = engine.answer(prompt_ids, max_new_tokens)
    return [a.strip() for a in tokenizer.batch_decode(answers, skip_special_tokens=True)]


def exact_match_on_conversations(model, tokenizer, conversations: list[list[dict]], **kwargs) -> tuple[float, list]:
    """Exact match of the model's answer to each conversation's last assistant turn, given the turns before it."""
    prompts = [c[:-1] for c in conversations]
    references = [c[-1]["content"] for c in conversations]
    predictions = generate_answers(model, tokenizer, prompts, **kwargs)
    score = load_exact_match().compute(predictions=predictions, references=references)["exact_match"]
    return score, list(zip(prompts, references, predictions, strict=True))


def exact_match_by_group(groups: list[str], samples: list[tuple]) -> dict[str, float]:
    """Exact match per group (e.g. per task) of ``samples`` from :func:`exact_match_on_conversations`.

    >>> exact_match_by_group(["add", "add", "sort"], [(None, "4", "4"), (None, "5", "6"), (None, "1 2", "1 2")])
    {'add': 0.5, 'sort': 1.0}
    """
    hits: dict[str, list[bool]] = {}
    for group, (_, reference, answer) in zip(groups, samples, strict=True):
        hits.setdefault(group, []).append(answer == reference)
    return {group: sum(v) / len(v) for group, v in hits.items()}
