"""Preference pairs as data (hfacc/data/preference.py): the three row shapes, the scored tokens (the answer as the
chat template renders it: the same tokens and labels as an SFT row of that conversation), truncation, bad rows,
streams, and reference log-probs computed once."""

import json
import logging

import datasets
import pytest
import torch

from hfacc import (
    DataCollatorForPreference,
    DPOObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    build_preference_dataset,
    build_sft_dataset,
    build_tiny_llama,
    precompute_reference_logps,
)
from hfacc.data.embedded import build_default_tokenizer
from hfacc.data.formats import DataError
from hfacc.runtime.config import ConfigError
from tests.chat_corpus import TOOL_CALL, TOOLS, tokenizer_for
from tests.helpers import CaptureGradients, relative_error, train_args
from tests.preference_reference import big_batch, reference_logps


@pytest.fixture(scope="module")
def tokenizer():
    return build_default_tokenizer()


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3's published chat template (tests/chat_templates): it drops the reasoning of turns before the last user
    message and renders tool calls, so the answer's tokens depend on the whole conversation."""
    return tokenizer_for("qwen3")


def sft_row(tokenizer, prompt, completion, tools=None):
    """The SFT example of the same prompt and answer: what a preference side must equal."""
    row = {"prompt": prompt, "completion": completion}
    if tools is not None:
        row["tools"] = tools
    return build_sft_dataset(datasets.Dataset.from_list([row]), tokenizer)[0]


def test_text_rows_are_scored_like_sft_prompt_completion(tokenizer):
    rows = [{"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "5 or so"}]
    pair = build_preference_dataset(datasets.Dataset.from_list(rows), tokenizer)[0]
    for side in ("chosen", "rejected"):
        want = sft_row(tokenizer, rows[0]["prompt"], rows[0][side])
        assert pair[f"{side}_input_ids"] == want["input_ids"] and pair[f"{side}_labels"] == want["labels"]
    assert pair["chosen_labels"][-1] == tokenizer.eos_token_id  # the answer ends with EOS, trained


def test_conversational_rows_with_tools_are_scored_as_the_template_renders_them(qwen3):
    prompt = [{"role": "user", "content": "What is the weather in Paris?"}]
    chosen = [
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "22 C, sunny"},
        {"role": "assistant", "content": "It is 22 C and sunny.", "reasoning_content": "The tool says 22 C."},
    ]
    rejected = [{"role": "assistant", "content": "I cannot know that.", "reasoning_content": "No idea."}]
    row = {"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": json.dumps(TOOLS)}
    pair = build_preference_dataset(datasets.Dataset.from_list([row]), qwen3)[0]
    for side in ("chosen", "rejected"):
        want = sft_row(qwen3, prompt, row[side], tools=row["tools"])
        assert pair[f"{side}_input_ids"] == want["input_ids"] and pair[f"{side}_labels"] == want["labels"]
    ids, labels = pair["chosen_input_ids"], pair["chosen_labels"]
    trained = qwen3.decode([t for t, y in zip(ids, labels, strict=True) if y != -100])
    assert "get_weather" in trained and "It is 22 C and sunny." in trained  # the tool call and the answer
    assert "22 C, sunny" not in trained and "weather in Paris?" not in trained  # the tool's and the user's text
    assert trained.count("<|im_end|>") == 2  # each assistant turn with its end-of-turn marker
    assert "get_weather" in qwen3.decode(ids[: labels.index(next(y for y in labels if y != -100))])  # the schema


def test_implicit_prompt_rows_are_the_explicit_ones(qwen3):
    shared = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 7 prime?"}]
    chosen, rejected = [{"role": "assistant", "content": "Yes."}], [{"role": "assistant", "content": "No."}]
    implicit = build_preference_dataset(
        datasets.Dataset.from_list([{"chosen": shared + chosen, "rejected": shared + rejected}]), qwen3
    )[0]
    explicit = build_preference_dataset(
        datasets.Dataset.from_list([{"prompt": shared, "chosen": chosen, "rejected": rejected}]), qwen3
    )[0]
    assert implicit == explicit


def test_truncation_cuts_what_the_setting_says_and_counts_it(tokenizer, caplog):
    long_prompt = " ".join(["apple"] * 40)
    rows = [
        {"prompt": long_prompt, "chosen": "banana split", "rejected": "cherry"},  # only its prompt is long
        {"prompt": "Hi", "chosen": "yes", "rejected": "no"},
    ]
    data = datasets.Dataset.from_list(rows)
    full = build_preference_dataset(data, tokenizer, max_length=None)
    n = len(full[0]["chosen_input_ids"])
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        right = build_preference_dataset(data, tokenizer, max_length=20)
    # Cutting the end cuts the long row's answers away entirely: that pair is dropped, and both are said.
    assert len(right) == 1 and "2 sequences of 2 pairs exceed max_length=20" in caplog.text
    assert "1 of 2 pairs have an answer with no scored token left after truncation" in caplog.text
    left = build_preference_dataset(data, tokenizer, max_length=20, truncation="left")
    assert len(left) == 2  # cutting the prompt's start keeps every answer whole
    assert left[0]["chosen_input_ids"] == full[0]["chosen_input_ids"][n - 20 :]
    assert left[0]["chosen_labels"][-4:] == full[0]["chosen_labels"][-4:]
    assert len(build_preference_dataset(data, tokenizer, max_length=20, truncation="drop")) == 1
    with pytest.raises(DataError, match="row 0, field 'chosen': .* exceed max_length=20"):
        build_preference_dataset(data, tokenizer, max_length=20, truncation="error")
    with pytest.raises(DataError, match="truncation='middle'"):
        build_preference_dataset(data, tokenizer, truncation="middle")


def test_bad_rows_are_named(tokenizer, qwen3, caplog):
    def build(rows, tok=tokenizer):
        return build_preference_dataset(datasets.Dataset.from_list(rows), tok)

    with pytest.raises(DataError, match="row 1, field 'rejected': it is empty"):
        build([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b", "rejected": " "}])
    with pytest.raises(DataError, match="missing \\['rejected'\\]"):
        build([{"prompt": "a", "chosen": "b"}])
    with pytest.raises(DataError, match="looks like SFT data"):
        build([{"prompt": "a", "completion": "b"}])
    with pytest.raises(DataError, match="row 0: no field 'prompt'. Without one"):
        build([{"chosen": "a b", "rejected": "a c"}])
    with pytest.raises(DataError, match="row 0, field 'rejected': the conversation has no assistant message"):
        build(
            [
                {
                    "prompt": [{"role": "user", "content": "hi"}],
                    "chosen": [{"role": "assistant", "content": "hello"}],
                    "rejected": [{"role": "user", "content": "hello"}],
                }
            ],
            qwen3,
        )
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        kept = build(
            [{"prompt": "a", "chosen": "same", "rejected": "same"}, {"prompt": "a", "chosen": "x", "rejected": "y"}]
        )
    assert len(kept) == 1 and "1 of 2 pairs have the same chosen and rejected sequence" in caplog.text


def test_reference_columns_ride_along_to_the_batch(tokenizer):
    rows = [
        {"prompt": "a", "chosen": "b", "rejected": "c", "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5},
        {"prompt": "d", "chosen": "e", "rejected": "f", "ref_chosen_logps": -3.5, "ref_rejected_logps": -4.5},
    ]
    data = build_preference_dataset(datasets.Dataset.from_list(rows), tokenizer)
    assert {"ref_chosen_logps", "ref_rejected_logps", "chosen_input_ids"} <= set(data.column_names)
    batch = DataCollatorForPreference(tokenizer.pad_token_id)(data.to_list())
    assert batch["ref_logps"].tolist() == [-1.5, -3.5, -2.5, -4.5]  # chosen rows, then rejected rows
    assert batch["input_ids"].shape[0] == 4


def test_a_streamed_dataset_gives_the_same_pairs_and_trains_exactly(tokenizer, tmp_path):
    rows = [{"prompt": f"What is {a} + {b}?", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in
            [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (9, 9)]]  # fmt: skip
    mapped = build_preference_dataset(datasets.Dataset.from_list(rows), tokenizer)
    stream = build_preference_dataset(datasets.IterableDataset.from_generator(lambda: iter(rows)), tokenizer)
    assert list(stream) == mapped.to_list()
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=4)
    pairs = mapped.to_list()
    want, _ = big_batch(model, pairs, "sigmoid", reference_logps(model, pairs), 0.0, beta=0.1, eps=0.0)
    capture = CaptureGradients(model)
    args = train_args(tmp_path, 2, 3, args_class=TokenWeightedArguments, max_steps=1)
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=stream,
        data_collator=DataCollatorForPreference(tokenizer.pad_token_id),
        objective=DPOObjective(),
        callbacks=[capture],
    )
    trainer.train()
    assert relative_error(capture.grads[0], want) <= 1e-6


def test_reference_log_probs_are_computed_once_with_a_progress_bar(tokenizer, capsys):
    rows = [{"prompt": f"Spell {w}.", "chosen": " ".join(w.upper()), "rejected": w} for w in ("cat", "dog", "owl")]
    data = build_preference_dataset(datasets.Dataset.from_list(rows), tokenizer)
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=5)
    out = precompute_reference_logps(data, model, pad_token_id=tokenizer.pad_token_id, batch_size=2)
    want = reference_logps(model, data.to_list())
    got = torch.tensor(list(out["ref_chosen_logps"]) + list(out["ref_rejected_logps"]))
    assert relative_error(got, want) <= 1e-6
    assert "Reference log-probs" in capsys.readouterr().err  # the bar


# ---- the DPO job's embedded pairs: the starting model's own mistakes ----------------------------------------------
def test_the_embedded_pairs_are_the_starting_models_own_mistakes(monkeypatch, caplog):
    """Rejected: the greedy answer where it is wrong, else a wrong sample; a prompt answered right every time has no
    pair (before: a made-up near miss, which lowered the full SFT output's held-out exact match 0.78 -> 0.69). The
    held-out prompts for exact match are all of them, right or wrong."""
    from hfacc.data.embedded import generate_instruction_examples
    from hfacc.jobs import dpo

    job = dpo.DPOArguments(num_embedded_prompts=24, num_rejected_samples=2, eval_fraction=0.25)
    examples = generate_instruction_examples(24, seed=1)  # what the job draws for seed 0
    right = [e["messages"][-1]["content"] for e in examples]
    # Prompt i: greedy wrong when i % 4 == 0; greedy right and the second sample wrong when i % 4 == 1; always
    # right otherwise (an empty answer is no answer to prefer against).
    greedy = [f"greedy miss {i}" if i % 4 == 0 else r for i, r in enumerate(right)]
    samples = [x for i, r in enumerate(right) for x in ("", f"sampled miss {i}" if i % 4 == 1 else r)]
    monkeypatch.setattr(dpo, "generate_answers", lambda *a, **k: greedy)
    monkeypatch.setattr(dpo, "sample_answers", lambda *a, **k: samples)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        train, evaluation, held_out = dpo.build_embedded_pairs(None, None, job, seed=0)
    rows = train.to_list() + evaluation.to_list()
    assert len(evaluation) == 4 and len(train) == 8  # pairs of prompts 0, 1, 4, 5 held out (0-5); 8, 9, ... trained
    expected = {
        examples[i]["messages"][-1]["content"]: ("greedy miss " if i % 4 == 0 else "sampled miss ") + str(i)
        for i in range(24)
        if i % 4 < 2
    }
    assert {r["chosen"][0]["content"]: r["rejected"][0]["content"] for r in rows} == expected
    assert [h["messages"] for h in held_out] == [e["messages"] for e in examples[:6]]
    assert "12 preference pairs from the starting model's own mistakes on 24 embedded prompts (rejected: 6 greedy" in (
        caplog.text
    )
    monkeypatch.setattr(dpo, "generate_answers", lambda *a, **k: right)
    monkeypatch.setattr(dpo, "sample_answers", lambda *a, **k: [r for r in right for _ in range(2)])
    with pytest.raises(ConfigError, match="answers 24 of 24 embedded prompts right every time"):
        dpo.build_embedded_pairs(None, None, job, seed=0)


# ---- the KTO job's embedded rows: the starting model's own answers, right ones desirable ---------------------------
def test_the_kto_rows_are_the_starting_models_own_answers_right_ones_desirable(monkeypatch, caplog, tokenizer):
    """Every distinct answer the model gave (greedy, then the samples) is a row: desirable where it is the right
    answer, undesirable where it is not; the right answer is never added where the model did not give it (the DPO
    job's pairs unpaired, before, lowered the full SFT output's held-out exact match 0.78 -> 0.70). The rows tokenize
    as KTO rows with their labels, and a model that is never wrong (or never right) is refused by name."""
    from hfacc.data.embedded import generate_instruction_examples
    from hfacc.jobs import kto

    job = kto.KTOArguments(num_embedded_prompts=24, num_rejected_samples=2, eval_fraction=0.25)
    examples = generate_instruction_examples(24, seed=1)  # what the job draws for seed 0
    right = [e["messages"][-1]["content"] for e in examples]
    # Prompt i: greedy wrong when i % 4 == 0 (and a sample right); greedy right and a sample wrong when i % 4 == 1;
    # always wrong when i % 4 == 2 (one mistake twice); always right otherwise (an empty answer is no answer).
    greedy = [r if i % 4 in (1, 3) else f"miss {i}" for i, r in enumerate(right)]
    samples = [
        x
        for i, r in enumerate(right)
        for x in {0: (r, ""), 1: (f"sampled miss {i}", r), 2: (f"miss {i}", f"miss {i}"), 3: ("", r)}[i % 4]
    ]
    monkeypatch.setattr(kto, "generate_answers", lambda *a, **k: greedy)
    monkeypatch.setattr(kto, "sample_answers", lambda *a, **k: samples)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        train, evaluation, held_out = kto.build_embedded_rows(None, None, job, seed=0)
    expected = {0: [("miss {i}", False), ("{r}", True)], 1: [("{r}", True), ("sampled miss {i}", False)]}
    expected |= {2: [("miss {i}", False)], 3: [("{r}", True)]}
    want = [
        (examples[i]["messages"][:-1], answer.format(i=i, r=r), label)
        for i, r in enumerate(right)
        for answer, label in expected[i % 4]
    ]
    rows = evaluation.to_list() + train.to_list()
    assert [(r["prompt"], r["completion"][0]["content"], r["label"]) for r in rows] == want
    assert len(evaluation) == 10 and [h["messages"] for h in held_out] == [e["messages"] for e in examples[:6]]
    assert "36 unpaired rows from the starting model's own answers to 24 embedded prompts" in caplog.text
    assert "18 right ones desirable, 18 mistakes undesirable" in caplog.text
    data = build_preference_dataset(train, tokenizer, unpaired=True)
    assert data["label"] == [label for *_, label in want[10:]]
    monkeypatch.setattr(kto, "generate_answers", lambda *a, **k: right)
    monkeypatch.setattr(kto, "sample_answers", lambda *a, **k: [r for r in right for _ in range(2)])
    with pytest.raises(ConfigError, match="gave 18 right and 0 wrong ones: KTO's own-answer rows need both"):
        kto.build_embedded_rows(None, None, job, seed=0)
