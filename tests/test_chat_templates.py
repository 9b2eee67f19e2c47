"""Loss masks under real models' chat templates: every template of tests/chat_templates x every conversation kind.

For each case: our template renders, character for character, what the published template renders; hfacc's tokens
are the template's own (``apply_chat_template``); the trained characters are exactly the expected ones, at the
expected places (each assistant turn's text with its end-of-turn marker, nothing of the system, user, tool results,
tool schemas, headers or default prompts); and the stop-token check TRL runs on its training templates passes.
"""

from functools import cache

import pytest

from hfacc.data.chat import METHODS, get_renderer
from hfacc.data.formats import DataError, encode_row, normalize_messages, normalize_tools
from tests.chat_corpus import (
    CORPUS_DIR,
    KINDS,
    cases,
    conversation,
    expected_rendering,
    index,
    legacy_labels,
    template,
    tokenizer_for,
    trained_spans,
)

CASES = cases()
FAMILIES = list(index()["families"])


@cache
def masked(family, kind):
    """hfacc's encoding of a corpus case (computed once: several tests read it, none changes it)."""
    tokenizer = tokenizer_for(family)
    messages, tools = conversation(family, kind)
    ids, labels, method, unclosed = encode_row(tokenizer, {"messages": messages, "tools": tools}, 0, "messages")
    return tokenizer, messages, tools, ids, labels, method, unclosed


def test_the_corpus_is_as_large_as_promised():
    families = index()["families"]
    assert len(families) >= 38 and len(CASES) >= 150
    assert {kind for _, kind in CASES} == set(KINDS)
    sources = (CORPUS_DIR / "published" / "SOURCES.md").read_text()
    for family, entry in families.items():
        assert entry["model"] and entry["published"].startswith("https://"), family
        if "template" in entry:  # a published template, vendored byte for byte: where it comes from is recorded
            source = entry["source"]
            folder = entry["template"].split("/")[1]
            assert f"| `{folder}/` | {source['repository']}" in sources and source["commit"] in sources, family
            assert entry["published"].endswith(f"{source['commit']}/{source['path']}"), family
        else:  # re-written here: the file says which model's template it renders
            assert template(family).startswith("{#-") and entry["model"].split("/")[0] in template(family)


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_masks_and_tokens_match_the_published_template(family, kind):
    tokenizer, messages, tools, ids, labels, method, unclosed = masked(family, kind)
    expected = index()["families"][family]["kinds"][kind]
    text = expected_rendering(family, kind)

    # The tokens are the chat template's own: the published template's text, tokenized as apply_chat_template does.
    renderer = get_renderer(tokenizer, normalize_tools(tools, 0))
    adapted = renderer.adapt_content(normalize_messages(messages, 0, "messages", need_assistant=True))
    assert ids == tokenizer.apply_chat_template(adapted, tools=tools, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text

    # Character by character: the trained text of every assistant turn, end-of-turn marker included, at its place.
    spans = trained_spans(tokenizer, text, ids, labels)
    assert [text[a:b] for a, b in spans] == expected["trained"]
    assert [list(s) for s in spans] == expected["spans"]
    assert method == METHODS[expected["method"]]
    assert unclosed == expected["unclosed"]
    # Nothing that is not the assistant's is trained: every trained character lies inside an assistant's answer.
    answers = [m for m in messages if m["role"] == "assistant"]
    assert len(spans) == len(answers)


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_token_is_trained_trl_check(family):
    """TRL's ``is_chat_template_stop_token_trained``, re-implemented on hfacc's labels (TRL is not a dependency).

    An assistant turn followed by a user message; ignoring trailing whitespace, the last trained token must be an
    added (end-of-turn) token, not content: else the model never learns to stop.
    """
    tokenizer = tokenizer_for(family)
    messages = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "dummy"},
        {"role": "user", "content": "dummy"},
    ]
    ids, labels, _, unclosed = encode_row(tokenizer, {"messages": messages}, 0, "messages")
    added = set(tokenizer.get_added_vocab().values())
    trained = [t for t, y in zip(ids, labels, strict=True) if y != -100]
    last = next(t for t in reversed(trained) if tokenizer.decode([t]).strip())
    if index()["families"][family].get("options", {}).get("no_end_of_turn_token"):
        # ChatQA and AmberChat end a turn with plain text: no token to train, and hfacc counts the turn as open
        # (the build warns), where TRL's check would fail.
        assert last not in added and unclosed == 1, family
        return
    assert last in added and unclosed == 0, f"{family}: the turn's last trained token is {tokenizer.decode([last])!r}"


@pytest.mark.parametrize(("family", "kind"), CASES)
def test_every_closed_turn_ends_on_an_added_token(family, kind):
    """The same check on every turn of the corpus: only a turn the template leaves open (GLM's last) may end on
    content, and hfacc counts it."""
    tokenizer, _, _, ids, labels, _, unclosed = masked(family, kind)
    added = set(tokenizer.get_added_vocab().values())
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    ends = [next(t for t in reversed(run) if tokenizer.decode([t]).strip()) in added for run in runs]
    assert ends.count(False) == unclosed and (not unclosed or ends[-1] is False)


@pytest.mark.parametrize(
    "family", [f for f, e in index()["families"].items() if {"plain", "parts"} <= set(e["kinds"])]
)
def test_text_parts_become_the_string_for_templates_that_read_strings(family):
    tokenizer = tokenizer_for(family)
    plain, parts = masked(family, "plain")[3:5], masked(family, "parts")[3:5]
    if get_renderer(tokenizer).content_mode == "string":
        assert parts == plain  # joined parts are the plain conversation, token for token
    else:  # the template reads parts itself (Gemma 3, Qwen2.5-VL, ...): it renders them its own way, checked above
        assert get_renderer(tokenizer).content_mode in ("either", "parts")


def test_negative_control_the_previous_masking_fails_these_cases():
    """The corpus can fail: hfacc's previous masking (prefix renders plus a text search for the answer) gets
    more than half of the cases wrong, the ways issue 16 lists, and the prefix-stable ones right."""
    wrong = {}
    for family, kind in CASES:
        tokenizer = tokenizer_for(family)
        messages, tools = conversation(family, kind)
        renderer = get_renderer(tokenizer, normalize_tools(tools, 0))
        messages = renderer.adapt_content(normalize_messages(messages, 0, "messages", need_assistant=True))
        trainable = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            text, ids, labels = legacy_labels(tokenizer, messages, trainable, tools)
        except Exception:  # it could not even render its prefixes (Qwen3.5 without a user query)
            wrong[family, kind] = None
            continue
        got = trained_spans(tokenizer, text, ids, labels)
        if [list(s) for s in got] != index()["families"][family]["kinds"][kind]["spans"]:
            wrong[family, kind] = [text[a:b] for a, b in got]
    assert len(wrong) > len(CASES) / 2
    assert wrong["qwen3", "plain"][0] == " Yes"  # the user's "Yes", found by the text search
    assert wrong["qwen2_5", "assistant_first"][0].startswith("<|im_start|>system\nYou are Qwen")  # default prompt
    assert not wrong["glm4_5", "plain"][0].endswith("<|user|>")  # GLM-4's stop signal untrained
    assert wrong["gpt_oss", "plain"][0] == " Yes"  # the earlier answer's header and <|end|> untrained
    assert wrong["phi3", "plain"][1].endswith("<|end|>\n<|endoftext|>")  # scaffolding after the end trained
    assert len(wrong["qwen3", "tools"]) == 2  # the tool call turn lost
    assert ("qwen2_5", "plain") not in wrong and ("llama3", "plain") not in wrong


PUBLISHED = [f for f, entry in index()["families"].items() if "template" in entry]


def _match_prefix_before_issue_21(renderer, tail, text, at):
    """The generation-prompt match as it was: all of the tail, or its longest prefix of whole tokens (any)."""
    if text.startswith(tail, at):
        return len(tail)
    return next((b for b in reversed(renderer.token_boundaries(tail)) if text.startswith(tail[:b], at)), None)


def _turn_end_before_issue_21(renderer, full, k, own):
    """The turn's end as it was: its whole segment (where its own text ends, ``own``, unread), and a marker only
    where the next message's segment opens."""
    start, end = full.segments[k]
    text = full.text
    while end > start and text[end - 1].isspace():
        end -= 1
    if renderer.special_at_end(text, end):
        return end, True
    following = [s for s in full.segments[k + 1 :] if s is not None]
    boundary = full.segments[k][1]
    if following and following[0][0] == boundary and renderer.special_at(text, boundary) is not None:
        return boundary + len(renderer.special_at(text, boundary)), True
    return end, False


def test_negative_control_the_masking_before_issue_21_fails_the_published_templates(monkeypatch):
    """The published templates' cases can fail: with the four pieces issue 21 changed put back as they were (the
    prompt match, the turn's end, the content probe, and no prefix renders for a turn written after the loop, whose
    whole-conversation fallback fails here), most cases are wrong in the ways the issue reports."""
    import hfacc.data.chat as chat

    nemotron = tokenizer_for("nemotron_nano_v2")  # the old path: prefix renders of every turn, refused
    messages = normalize_messages(conversation("nemotron_nano_v2", "plain")[0], 0, "messages", need_assistant=True)
    with pytest.raises(chat.ChatTemplateError, match="assistant message 2"):
        chat._prefix_spans(
            get_renderer(nemotron), messages, [2, 4], None, nemotron.apply_chat_template(messages, tokenize=False)
        )

    def no_prefix_for_one_turn(renderer, messages, k, tools, text, why):
        raise chat.ChatTemplateError(f"assistant message {k}: {why} (the template's loops cannot be traced)")

    monkeypatch.setattr(chat, "_match_prefix", _match_prefix_before_issue_21)
    monkeypatch.setattr(chat, "_turn_end", _turn_end_before_issue_21)
    monkeypatch.setattr(chat, "_dumped_parts", lambda text, probes: "'type'" in text or '"type"' in text)
    monkeypatch.setattr(chat, "_prefix_span", no_prefix_for_one_turn)
    trained, refused = {}, set()
    fresh = {f: tokenizer_for.__wrapped__(f) for f in PUBLISHED}  # fresh renderers, probed the old way
    for family, kind in [(f, k) for f, k in CASES if f in PUBLISHED]:
        tokenizer = fresh[family]
        messages, tools = conversation(family, kind)
        try:
            ids, labels, _, _ = encode_row(tokenizer, {"messages": messages, "tools": tools}, 0, "messages")
        except DataError:
            refused.add((family, kind))
            continue
        text = expected_rendering(family, kind)
        got = [text[a:b] for a, b in trained_spans(tokenizer, text, ids, labels)]
        if got != index()["families"][family]["kinds"][kind]["trained"]:
            trained[family, kind] = got
    cases = [c for c in CASES if c[0] in PUBLISHED]
    assert len(trained) + len(refused) >= 0.8 * len(cases)  # 46 of 55 when written, as main measured then
    assert any("22 C, sunny" in t for t in trained["gemma4", "tools"])  # the tool result trained
    assert "<｜Assistant｜>" in trained["deepseek_v3_1_vllm_tools", "plain"][0]  # the header trained
    assert "###Assistant:" in trained["amberchat", "plain"][0] and "Assistant:" in trained["chatqa", "plain"][0]
    assert "<s>bot" in trained["saiga", "plain"][0]
    assert trained["jamba", "plain"][-1] == " No" and trained["metharme", "plain"][-1] == "No"  # no closing marker
    assert {("nemotron_nano_v2", k) for k in ("plain", "tools")} <= refused
    assert {("deepseek_v3_vllm_tools", "plain"), ("llama4_vllm_json_tools", "plain")} <= refused
    assert ("hermes_vllm_tools", "parts") in refused  # the raw Jinja error of the content probe


def test_show_mask_and_the_build_warning_say_what_is_trained(tmp_path, capsys, caplog):
    """``hfacc show-mask`` shows Gemma 4's tool call trained up to its stop token and the tool result not; single
    turns of Jamba and ChatQA: Jamba's closing <|eom|> is trained (no warning), ChatQA has no token to train, and
    the warning says that, not that the template ends turns with the next message's marker."""
    import json
    import logging

    from datasets import Dataset

    from hfacc.cli import main as cli_main
    from hfacc.data.sft import build_sft_dataset

    messages, tools = conversation("gemma4", "tools")
    data = tmp_path / "tools.jsonl"
    data.write_text(json.dumps({"messages": messages, "tools": json.dumps(tools)}) + "\n")
    tokenizer_for("gemma4").save_pretrained(tmp_path / "gemma4")
    argv = ["--model_name_or_path", str(tmp_path / "gemma4"), "--dataset_name", str(data), "--color", "false"]
    assert cli_main(["show-mask", *argv]) == 0
    out = capsys.readouterr().out
    assert '[[<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>]]response:' in out
    assert "22 C, sunny" in out.split("<|tool_response>]]")[1].split("[[")[0]  # untrained, up to the next answer

    single = [{"messages": PLAIN_SINGLE_TURN}]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        jamba = build_sft_dataset(Dataset.from_list(single), tokenizer_for("jamba"))
        assert "end without an end-of-turn token" not in caplog.text
        build_sft_dataset(Dataset.from_list(single), tokenizer_for("chatqa"))
    assert "1 assistant turns end without an end-of-turn token" in caplog.text and "plain text" in caplog.text
    jamba_tokenizer = tokenizer_for("jamba")
    trained = [t for t, y in zip(jamba[0]["input_ids"], jamba[0]["labels"], strict=True) if y != -100]
    assert jamba_tokenizer.decode(trained[-1:]) == "<|eom|>"


PLAIN_SINGLE_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Is 7 prime? Answer Yes or No."},
    {"role": "assistant", "content": "Yes"},
]


def test_a_tool_result_the_template_drops_is_not_cut_from_the_answer():
    """Metharme writes nothing for a tool message; its content also in the answer before it is the answer's own
    text, trained in full (the cut applies only where a silent message's text is really in the turn). No
    tool_calls on the turn: Metharme has no place for them (refused, see the test below)."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me check: 22 C"},
        {"role": "tool", "content": "22 C"},
        {"role": "assistant", "content": "It is 22 C."},
    ]
    tokenizer = tokenizer_for("metharme")
    ids, labels, _, _ = encode_row(tokenizer, {"messages": messages}, 0, "messages")
    trained = tokenizer.decode([t for t, y in zip(ids, labels, strict=True) if y != -100])
    assert trained.startswith("Let me check: 22 C<|model|>") and trained.endswith("It is 22 C.</s>")


TOOL_CALL = {"id": "a1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_gemma4_trains_the_text_a_call_turn_writes_after_its_tool_results(caplog):
    """Issue 37 item 6: Gemma 4 writes a call turn's text after the tool results, inside the same turn
    (``<tool_response|>checking now<turn|>``). Before: the call was trained, neither that text nor the ``<turn|>``
    closing the turn, and no warning. Now both are, the results still not; as a string or as text parts, with one
    result or two, at the conversation's end or before a next answer."""
    import logging

    tokenizer = tokenizer_for("gemma4")
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    for content in ("checking now", [{"type": "text", "text": "checking now"}]):
        for results in (["22 C, sunny"], ["22 C, sunny", "and windy"]):
            for after in ([], [{"role": "assistant", "content": "It is 22 C."}]):
                messages = [
                    {"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": content, "tool_calls": [TOOL_CALL]},
                    *({"role": "tool", "tool_call_id": "a1", "content": r} for r in results),
                    *after,
                ]
                with caplog.at_level(logging.WARNING, logger="hfacc"):
                    ids, labels, _, unclosed = encode_row(tokenizer, {"messages": messages}, 0, "messages")
                text = tokenizer.decode(ids, skip_special_tokens=False)
                assert "<tool_response|>checking now<turn|>" in text
                trained = [text[a:b] for a, b in trained_spans(tokenizer, text, ids, labels)]
                assert trained == [call, "checking now<turn|>"] + ["It is 22 C.<turn|>"] * len(after)
                assert unclosed == 0
    assert "not trained" not in caplog.text


def test_gemma4_trains_a_call_turns_text_that_quotes_its_tool_result(caplog):
    """The call turn's text may quote the result it follows (``<tool_response|>It is 22 C, sunny.<turn|>``). Before:
    the quote, found after the text's start, read as a result written among the text: the text and ``<turn|>``
    were left out, with a WARNING that hfacc could not tell them apart."""
    import logging

    tokenizer = tokenizer_for("gemma4")
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "It is 22 C, sunny.", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "a1", "content": "22 C, sunny"},
    ]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        ids, labels, _, _ = encode_row(tokenizer, {"messages": messages}, 0, "messages")
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert [text[a:b] for a, b in trained_spans(tokenizer, text, ids, labels)] == [call, "It is 22 C, sunny.<turn|>"]
    assert "not trained" not in caplog.text


def test_an_answer_a_template_writes_among_tool_results_untold_is_said_at_warning(caplog):
    """Where the template writes the call turn's text after its tool results but cannot be read there (here it
    also writes a marker before the call only when there is text, so the rendering without the text departs before
    the results), the text is left out of the loss and a WARNING says which and why."""
    import logging

    from hfacc.data.chat import get_assistant_spans

    template = (
        "{%- for message in messages -%}{%- if message['role'] == 'user' -%}<|turn>user\n{{ message['content'] }}"
        "<turn|>\n{%- elif message['role'] == 'assistant' -%}<|turn>model\n"
        "{%- if message['content'] %}<|channel>{% endif -%}"
        "{%- for call in message['tool_calls'] or [] %}<|tool_call>{{ call['function']['name'] }}<tool_call|>"
        "{%- endfor -%}{%- for j in range(loop.index0 + 1, messages | length) -%}"
        "{%- if messages[j]['role'] == 'tool' %}<|tool_response>{{ messages[j]['content'] }}<tool_response|>"
        "{%- endif -%}{%- endfor -%}{{ message['content'] }}<turn|>\n{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt %}<|turn>model\n{% endif -%}"
    )
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "checking now", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": "22 C, sunny"},
    ]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        found = get_assistant_spans(tokenizer_for("gemma4"), messages, [1], chat_template=template)
    assert [found.text[a:b] for a, b in found.spans] == ["<|channel><|tool_call>get_weather<tool_call|>"]
    assert "assistant message 1 ('checking now')" in caplog.text and "not trained" in caplog.text


@pytest.mark.parametrize("family", ["llama3", "gemma3", "phi3", "metharme"])
def test_tool_calls_a_template_never_renders_are_refused_not_trained_as_an_empty_answer(family):
    """Before: these published templates have no place for tool_calls; the call turn rendered as nothing and only
    its end-of-turn marker was trained (the model learnt to answer "What is the weather?" with an empty turn),
    or, with text, its text without the call. No error, no warning."""
    call = {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    tokenizer = tokenizer_for(family)
    for content in ("", "Let me check."):
        messages = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "You are welcome."},
        ]
        with pytest.raises(DataError, match="does not render the tool calls of assistant message 1"):
            encode_row(tokenizer, {"messages": messages}, 0, "messages")
    # A reasoning-only turn the template drops (Llama 3 writes no reasoning) is the same empty answer.
    messages = [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "", "reasoning_content": "7 has no divisors."},
    ]
    with pytest.raises(DataError, match="does not render the reasoning of assistant message 1"):
        encode_row(tokenizer_for("llama3"), {"messages": messages}, 0, "messages")
