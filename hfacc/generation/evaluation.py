"""Generation-based evaluation: answer held-out prompts greedily and score them with exact match."""

from __future__ import annotations

from pathlib import Path

import torch

EXACT_MATCH_PATH = Path(__file__).resolve().parents[1] / "metrics" / "exact_match" / "exact_match.py"


def load_exact_match():
    """The exact-match metric module shipped in the repo, loaded through ``evaluate`` (works offline)."""
    import evaluate

    return evaluate.load(str(EXACT_MATCH_PATH))


@torch.no_grad()
def generate_answers(
    model, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 48, batch_size: int = 32
):
    """Greedy answers to ``conversations`` (each ending with a user turn), decoded without special tokens."""
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    answers = []
    try:
        for i in range(0, len(conversations), batch_size):
            prompts = [
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                for c in conversations[i : i + batch_size]
            ]
            batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            answers += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return [a.strip() for a in answers]


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
