"""Loss masks under real models' chat templates: every template of tests/chat_templates x every conversation kind.

For each case: our template renders, character for character, what the published template renders; hfacc's tokens
are the template's own (``apply_chat_template``); the trained characters are exactly the expected ones, at the
expected places (each assistant turn's text with its end-of-turn marker, nothing of the system, user, tool results,
tool schemas, headers or default prompts); and the stop-token check TRL runs on its training templates passes.
"""

from functools import cache

import pytest

from hfacc.chat import METHODS, get_renderer
from hfacc.data import encode_row, normalize_messages, normalize_tools
from tests.chat_corpus import (
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
    assert len(families) >= 20 and len(CASES) >= 90
    assert {kind for _, kind in CASES} == {"plain", "tools", "reasoning", "assistant_first", "parts"}
    for family, entry in families.items():
        assert entry["model"] and entry["published"].startswith("https://"), family
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
    ids, labels, _, _ = encode_row(tokenizer, {"messages": messages}, 0, "messages")
    added = set(tokenizer.get_added_vocab().values())
    trained = [t for t, y in zip(ids, labels, strict=True) if y != -100]
    last = next(t for t in reversed(trained) if tokenizer.decode([t]).strip())
    assert last in added, f"{family}: the turn's last trained token is {tokenizer.decode([last])!r}"


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
