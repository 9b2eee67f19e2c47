"""Loss masking, token by token: prompt/completion, multi-turn chat under four template styles, plain text."""

import json
import logging

import pytest
import torch
from datasets import Dataset

from hfacc import DataCollatorForCausalLM
from hfacc.data.embedded import build_bpe_tokenizer, build_default_tokenizer
from hfacc.data.formats import DataError, render_mask, tokenize_messages, tokenize_prompt_completion
from hfacc.data.sft import build_sft_dataset

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


# --- Chat data as today's datasets hold it: tool calls, reasoning, parts, a tools column ---------------------------


def test_embedded_dataset_masks_exactly_as_before():
    """The default recipe's numbers cannot move: on the embedded ChatML data, the template's segments train the
    same tokens as the prefix renders hfacc used before (tests/chat_corpus.legacy_spans)."""
    from hfacc.data.embedded import generate_instruction_examples
    from tests.chat_corpus import legacy_labels

    tokenizer = build_default_tokenizer()
    rows = generate_instruction_examples(600, seed=3)
    for row in rows:
        ids, labels = tokenize_messages(tokenizer, row["messages"])
        trainable = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant"]
        assert legacy_labels(tokenizer, row["messages"], trainable)[1:] == (ids, labels)
    assert sum(len(r["messages"]) > 3 for r in rows) > 10  # two-turn conversations are among them


def qwen_tokenizer():
    from tests.chat_corpus import tokenizer_for

    return tokenizer_for("qwen2_5")


def test_tools_column_as_json_string_or_list_and_arrow_none_fill():
    from tests.chat_corpus import TOOL_CONVERSATION, TOOLS

    tokenizer = qwen_tokenizer()
    direct = tokenize_messages(tokenizer, TOOL_CONVERSATION, tools=TOOLS)
    assert tokenize_messages(tokenizer, TOOL_CONVERSATION, tools=json.dumps(TOOLS)) == direct
    assert tokenize_messages(tokenizer, TOOL_CONVERSATION, tools=None) != direct  # the schemas are in the prompt
    # Through Arrow: a second row with other argument keys makes Arrow fill the missing ones with None; the tool
    # schemas are unified the same way. hfacc drops those Nones and trains exactly what the rows say.
    other = json.loads(json.dumps(TOOL_CONVERSATION))
    other[1]["tool_calls"][0]["function"]["arguments"] = {"town": "Lyon", "days": 2}
    ds = build_sft_dataset(
        Dataset.from_list([{"messages": TOOL_CONVERSATION, "tools": TOOLS}, {"messages": other}]), tokenizer
    )
    assert (ds[0]["input_ids"], ds[0]["labels"]) == direct
    assert (ds[1]["input_ids"], ds[1]["labels"]) == tokenize_messages(tokenizer, other)


def test_non_text_parts_are_refused_with_the_row():
    tokenizer = qwen_tokenizer()
    text = [{"type": "text", "text": "What is this?"}]
    image = [{"type": "image", "image": "cat.png"}, *text]
    rows = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text}]}] * 2
    rows.append({"messages": [{"role": "user", "content": image}, {"role": "assistant", "content": text}]})
    with pytest.raises(
        DataError,
        match=r"row 2, field 'messages', message 0, content part 0: an image, but the tokenizer \(or processor\) "
        r"given has no image processor.*build_sft_dataset\(dataset, processor\)",
    ):
        build_sft_dataset(Dataset.from_list(rows), tokenizer)
    audio = [{"type": "audio", "audio": "a.wav"}, *text]
    rows[2] = {"messages": [{"role": "user", "content": audio}, {"role": "assistant", "content": text}]}
    with pytest.raises(DataError, match=r"content part 0: a part of type 'audio'. hfacc trains on text and images"):
        build_sft_dataset(Dataset.from_list(rows), tokenizer)


def test_last_turn_only_and_conversational_completion_with_tools():
    from tests.chat_corpus import TOOL_CONVERSATION, TOOLS, tokenizer_for

    for family in ("qwen3", "lfm2_5"):  # traced segments, and {% generation %} markers
        tokenizer = tokenizer_for(family)
        ids, labels = tokenize_messages(tokenizer, TOOL_CONVERSATION, tools=TOOLS, last_turn_only=True)
        assert trained_runs(tokenizer, ids, labels)[0].endswith("You are welcome.<|im_end|>")
        assert len(trained_runs(tokenizer, ids, labels)) == 1
    tokenizer = qwen_tokenizer()
    ids, labels = tokenize_prompt_completion(tokenizer, TOOL_CONVERSATION[:1], TOOL_CONVERSATION[1:4], tools=TOOLS)
    runs = trained_runs(tokenizer, ids, labels)
    assert len(runs) == 2 and runs[0].startswith("<tool_call>") and runs[1] == "It is 22 C and sunny.<|im_end|>"
    assert "22 C, sunny" not in "".join(runs)  # the tool's result is never trained


def test_build_summary_counts_rows_by_masking_and_open_turns(caplog):
    from tests.chat_corpus import PLAIN, tokenizer_for

    rows = [{"messages": PLAIN}, {"messages": PLAIN[1:]}, {"text": None}]
    with caplog.at_level(logging.INFO, logger="hfacc"):
        build_sft_dataset(Dataset.from_list(rows[:2]), tokenizer_for("qwen2_5"))
        assert "chat rows masked by the template's message segments (2 rows)" in caplog.text
        build_sft_dataset(Dataset.from_list(rows[:2]), tokenizer_for("lfm2_5"))
        assert "chat rows masked by {% generation %} markers (2 rows)" in caplog.text
        build_sft_dataset(Dataset.from_list(rows[:2]), tokenizer_for("glm4_5"))
    assert "2 assistant turns end without an end-of-turn token to train" in caplog.text


def test_the_map_function_hashes_so_the_datasets_cache_works():
    tokenizer = qwen_tokenizer()
    ds = Dataset.from_list([{"messages": CONVERSATION}])
    # A call cycle in the functions the map closure reaches makes datasets fall back to a random fingerprint.
    assert build_sft_dataset(ds, tokenizer)._fingerprint == build_sft_dataset(ds, tokenizer)._fingerprint


INDEX_LOOP = (  # ChatML, but iterating over indices: the template's loop items are not the messages
    "{% for i in range(messages | length) %}{{ '<|im_start|>' + messages[i]['role'] + '\n' + messages[i]['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_untraceable_templates_use_checked_prefix_renders_or_are_refused(caplog):
    tokenizer = build_bpe_tokenizer(CORPUS, 400, ["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>")
    tokenizer.chat_template = INDEX_LOOP
    with caplog.at_level(logging.INFO, logger="hfacc"):
        ds = build_sft_dataset(Dataset.from_list([{"messages": CONVERSATION}]), tokenizer)
    assert trained_runs(tokenizer, ds[0]["input_ids"], ds[0]["labels"]) == [
        "It is 4.<|im_end|>",
        "Six, a longer answer.<|im_end|>",
    ]
    assert "masked from prefix renders" in caplog.text
    # The same loop, but the last turn is rendered differently (Phi-3's EOS): the prefixes do not hold, and hfacc
    # refuses the row instead of guessing.
    tokenizer.chat_template = INDEX_LOOP.replace(
        "{% endfor %}", "{% endfor %}{{ eos_token if not add_generation_prompt }}"
    )
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "'<|im_end|>\n' }}", "'<|im_end|>' + ('' if loop.last else '\n') }}"
    )
    with pytest.raises(
        DataError, match=r"row 0: hfacc cannot attribute the chat template's output to assistant message"
    ):
        tokenize_messages(tokenizer, CONVERSATION)


def test_json_rows_with_tool_calls_reasoning_and_parts_validate_and_errors_name_row_field_fix(tmp_path):
    from hfacc.data.sources import load_sft_source, validate_json_file
    from tests.chat_corpus import PARTS, REASONING, TOOL_CONVERSATION, TOOLS

    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": TOOL_CONVERSATION, "tools": json.dumps(TOOLS)},
        {"messages": REASONING, "tools": None},
        {"messages": [{**m, "content": m["content"][0]["text"]} for m in PARTS], "tools": None},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    validate_json_file(path)
    train, _ = load_sft_source(str(path), eval_fraction=0.34)
    assert "tools" in train.column_names

    def bad(row, match):
        path.write_text(json.dumps(rows[1]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError, match=match):
            validate_json_file(path)

    call = {"type": "function", "function": {"arguments": {"city": "Paris"}}}
    bad(
        {"messages": [TOOL_CONVERSATION[0], {"role": "assistant", "tool_calls": [call]}]},
        r"row 1 \(line 2 of chat.jsonl\), field 'messages', message 1, tool call 0: expected \{'type': 'function', "
        r"'function': \{'name'",
    )
    bad({"messages": REASONING, "tools": "[{oops"}, r"row 1 \(line 2 of chat.jsonl\), field 'tools': not valid JSON")
    bad({"messages": REASONING, "tools": [1, 2]}, r"field 'tools': expected a list of JSON schemas")
    image = [{"type": "input_audio", "input_audio": {"data": "x"}}]  # image parts are for a processor to judge
    bad(
        {"messages": [{"role": "user", "content": image}, REASONING[1]]},
        r"content part 0: a part of type 'input_audio'",
    )
    bad(
        {"messages": [REASONING[0], {"role": "assistant"}]},
        r"message 1: expected a dict with 'role' and 'content'.*only an assistant message with 'tool_calls'",
    )
    bad({"messages": [REASONING[0], {**REASONING[1], "reasoning_content": 3}]}, r"the reasoning must be a string")


def test_show_mask_shows_tool_calls_reasoning_and_how_rows_were_masked(tmp_path, capsys):
    from hfacc.cli import main as cli_main
    from tests.chat_corpus import save_qwen_style_tokenizer, tool_calling_rows

    rows = tool_calling_rows(8)
    for row in rows:  # reasoning in every row (Qwen2.5's template does not render it; show-mask still says so)
        row["messages"][-1]["reasoning_content"] = "Say what the tool said."
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_qwen_style_tokenizer(rows, tmp_path / "tokenizer")
    argv = [
        "--dataset_name",
        str(data),
        "--tokenizer_name_or_path",
        str(tmp_path / "tokenizer"),
        "--max_length",
        "1024",
    ]
    assert cli_main(["show-mask", "--count", "3", "--color", "false", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("masked by the template's message segments") == 3
    calls = "messages: user, assistant [tool call get_weather(city)], tool, assistant [reasoning 23 chars]"
    assert calls + "; tools: get_weather" in out
    assert '[[<tool_call>\n{"name": "get_weather", "arguments": {"city": ' in out  # the call is trained
    assert "<|im_start|>user\n<tool_response>\n" in out and "[[" not in out.split("<tool_response>")[1][:12]


def test_a_message_without_a_role_is_a_named_error():
    """Arrow gives a message that lacks 'role' a role of None (another row's messages have one): a DataError naming
    the row, the message and the fix, not a KeyError."""
    rows = [{"messages": CONVERSATION}, {"messages": [{"content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    data = Dataset.from_list(rows)
    assert data[1]["messages"][0]["role"] is None
    with pytest.raises(DataError, match=r"row 1, field 'messages', message 0: the message has no 'role'.*one of \["):
        build_sft_dataset(data, qwen_tokenizer())
    with pytest.raises(DataError, match=r"message 0: the message has no 'role'"):
        tokenize_messages(qwen_tokenizer(), rows[1]["messages"])


def test_show_mask_on_a_tokenizer_folder_and_a_one_row_file(tmp_path, capsys):
    """``hfacc show-mask`` needs only a tokenizer (a folder without model weights is enough) and shows the rows of a
    file in order, however few; a folder without a tokenizer is one error line with exit code 2."""
    from hfacc.cli import main as cli_main
    from tests.chat_corpus import tokenizer_for

    tokenizer_for("qwen2_5").save_pretrained(tmp_path / "tokenizer")  # no config.json, no weights
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION[:3]}) + "\n")
    argv = ["show-mask", "--model_name_or_path", str(tmp_path / "tokenizer"), "--dataset_name", str(data)]
    assert cli_main([*argv, "--count", "5", "--color", "false"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- example") == 1 and "--- example 0:" in out and "[[It is 4.<|im_end|>]]" in out
    for wrong, message in (
        (["--index", "1"], "error: --index 1: the data has fewer rows"),
        (["--model_name_or_path", str(tmp_path)], f"error: tokenizer {tmp_path}: the folder has no tokenizer files"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli_main([*argv, *wrong])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(message) and "Traceback" not in err
