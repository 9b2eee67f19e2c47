"""Loss masking, token by token: prompt/completion, multi-turn chat under four template styles, plain text."""

import logging

import pytest
import torch
from datasets import Dataset

from hfacc import DataCollatorForCausalLM
from hfacc.data import build_sft_dataset, render_mask, tokenize_messages, tokenize_prompt_completion
from hfacc.embedded import build_bpe_tokenizer, build_default_tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# name: (template, special tokens, eos, bos, end-of-turn marker that must be trained)
TEMPLATES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>", "<|pad|>"], "<|im_end|>", None, "<|im_end|>"),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "</s>", "<s>", "</s>"),
    "gemma": (
        GEMMA,
        ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        "<end_of_turn>",
        "<bos>",
        "<end_of_turn>",
    ),
}
# Mistral's template writes "[/INST] answer": the model must learn to produce that space, so it is trained.
ANSWER_LEAD = {"mistral": " "}
CORPUS = [
    "What is two plus two? It is four.",
    "Tell me a story about a dragon and a castle.",
    "system user model",
] * 20

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six, a longer answer."},
]


def make_tokenizer(name):
    template, special, eos, bos, _ = TEMPLATES[name]
    pad = "<|pad|>" if "<|pad|>" in special else eos  # llama3/mistral/gemma pad with EOS, as many real ones do
    return build_bpe_tokenizer(
        CORPUS, 400, special, eos_token=eos, pad_token=pad, bos_token=bos, chat_template=template
    )


def trained_runs(tokenizer, ids, labels):
    """Decoded text of each maximal run of trained tokens, after checking trained labels equal their input ids."""
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_every_assistant_turn_and_its_end_of_turn_token_is_trained(name):
    tokenizer = make_tokenizer(name)
    eot = TEMPLATES[name][4]
    lead = ANSWER_LEAD.get(name, "")
    messages = CONVERSATION[1:] if name == "gemma" else CONVERSATION  # Gemma refuses system turns
    ids, labels = tokenize_messages(tokenizer, messages)
    answers = [f"{lead}It is 4.{eot}", f"{lead}Six, a longer answer.{eot}"]
    assert trained_runs(tokenizer, ids, labels) == answers
    # Everything else (system, user, role headers, BOS, newlines between turns) is masked, token by token.
    untrained = tokenizer.decode([t for t, y in zip(ids, labels, strict=True) if y == -100])
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert untrained == full.replace(answers[0], "", 1).replace(answers[1], "", 1)
    assert ids == tokenizer(full, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_last_turn_only(name):
    tokenizer = make_tokenizer(name)
    eot, lead = TEMPLATES[name][4], ANSWER_LEAD.get(name, "")
    ids, labels = tokenize_messages(tokenizer, CONVERSATION[1:], last_turn_only=True)
    assert trained_runs(tokenizer, ids, labels) == [f"{lead}Six, a longer answer.{eot}"]


def test_prompt_completion_trains_the_completion_and_eos_only():
    tokenizer = make_tokenizer("llama3")  # adds no BOS by itself; pad == EOS
    ids, labels = tokenize_prompt_completion(tokenizer, "What is two plus two?", " It is four.")
    assert trained_runs(tokenizer, ids, labels) == [" It is four.<|eot_id|>"]
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.pad_token_id
    # Padding masks through the labels, so the EOS target survives even though pad == EOS.
    batch = DataCollatorForCausalLM(tokenizer.pad_token_id)(
        [{"input_ids": ids, "labels": labels}, {"input_ids": ids[:3]}]
    )
    assert batch["labels"][0, len(ids) - 1].item() == tokenizer.eos_token_id
    assert (batch["labels"][1, 3:] == -100).all()


def test_conversational_prompt_completion_trains_the_completion_turns():
    tokenizer = make_tokenizer("chatml")
    prompt = CONVERSATION[:4]
    completion = [CONVERSATION[4]]
    ids, labels = tokenize_prompt_completion(tokenizer, prompt, completion)
    assert trained_runs(tokenizer, ids, labels) == ["Six, a longer answer.<|im_end|>"]


def test_text_trains_every_token_and_appends_eos():
    tokenizer = make_tokenizer("chatml")
    ds = build_sft_dataset(Dataset.from_list([{"text": "a dragon and a castle"}]), tokenizer)
    row = ds[0]
    assert row["labels"] == row["input_ids"] and row["input_ids"][-1] == tokenizer.eos_token_id


def test_build_sft_dataset_detects_the_format_and_truncates(caplog):
    tokenizer = build_default_tokenizer()
    long_ids, _ = tokenize_messages(tokenizer, CONVERSATION)
    short_ids, _ = tokenize_messages(tokenizer, CONVERSATION[:3])
    limit = (len(long_ids) + len(short_ids)) // 2  # cuts the two-turn chat, leaves the one-turn chat whole
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        ds = build_sft_dataset(Dataset.from_list(rows), tokenizer, max_length=limit)
    assert set(ds.column_names) == {"input_ids", "attention_mask", "labels"}
    assert [len(x) for x in ds["input_ids"]] == [limit, len(short_ids)]
    assert f"1 of 2 examples exceed max_length={limit} and were truncated" in caplog.text


def test_render_mask_highlights_trained_tokens():
    tokenizer = make_tokenizer("chatml")
    ids, labels = tokenize_messages(tokenizer, CONVERSATION[1:3])
    plain = render_mask(tokenizer, ids, labels, color=False)
    assert "[[It is 4.<|im_end|>]]" in plain and plain.count("[[") == 1
    assert "\x1b[1;32m" in render_mask(tokenizer, ids, labels)


def test_collator_pads_right_to_a_multiple():
    batch = DataCollatorForCausalLM(pad_token_id=0, pad_to_multiple_of=8)([{"input_ids": [1, 2, 3]}])
    assert batch["input_ids"].shape == (1, 8)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100, -100, -100, -100, -100]]
    assert batch["input_ids"].dtype == torch.long
