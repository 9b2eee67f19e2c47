"""The chat-template corpus of tests/chat_templates: its conversations, tokenizers and index.

Each ``tests/chat_templates/<family>.jinja`` was written here to render exactly what a real model's published chat
template renders (``index.json`` names the model and where its template is published); ``renderings.json`` holds
what the published templates render for the conversations below, so every case checks that ours still does.
Families whose index entry names a ``template`` file use that published template itself, vendored byte for byte
under ``tests/chat_templates/published/`` (its ``SOURCES.md`` gives each repository and commit).
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import cache
from pathlib import Path

from hfacc.data.embedded import build_bpe_tokenizer

CORPUS_DIR = Path(__file__).parent / "chat_templates"
KINDS = ("plain", "tools", "reasoning", "assistant_first", "parts", "tool_reasoning")

SYSTEM = {"role": "system", "content": "Be brief."}
# The user's own text holds the answers ("Yes", "No"): a mask that searched for the answer would find them there.
PLAIN = [
    SYSTEM,
    {"role": "user", "content": "Is 7 prime? Answer Yes or No."},
    {"role": "assistant", "content": "Yes"},
    {"role": "user", "content": "And 9? Yes or No."},
    {"role": "assistant", "content": "No"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL = {
    "id": "a1b2c3d4e",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
# A tool call, its result, the answer, then one more exchange: the tool turns become history, which Qwen3 (drops
# their reasoning) and GPT-OSS (drops the analysis of a call once a final answer follows) render differently.
TOOL_CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "22 C, sunny"},
    {"role": "assistant", "content": "It is 22 C and sunny.", "reasoning_content": "The tool says 22 C."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
]
REASONING = [
    {"role": "user", "content": "Is 7 prime?"},
    {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisors but 1 and 7."},
    {"role": "user", "content": "And 9?"},
    {"role": "assistant", "content": "No.", "reasoning_content": "9 is 3 times 3."},
]
# Two parallel calls after the last user message, their two results, the answer: the call turn's reasoning is
# rendered (Gemma 4 keeps it only after the last user message), and several tool results follow one call turn.
TOOL_REASONING = [
    {"role": "user", "content": "What is the weather in Paris and in Lyon?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities: two calls.",
        "tool_calls": [
            TOOL_CALL,
            {
                "id": "f5g6h7i8j",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "f5g6h7i8j", "name": "get_weather", "content": "18 C, rain"},
    {
        "role": "assistant",
        "content": "Paris: 22 C and sunny. Lyon: 18 C and rain.",
        "reasoning_content": "Both answered.",
    },
]
ASSISTANT_FIRST = [
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Say yes."},
    {"role": "assistant", "content": "Yes."},
]
# PLAIN as lists of text parts; joined, each message is PLAIN's string.
PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Is 7 prime?"}, {"type": "text", "text": " Answer Yes or No."}],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "Yes"}]},
    {"role": "user", "content": [{"type": "text", "text": "And 9? Yes or No."}]},
    {"role": "assistant", "content": [{"type": "text", "text": "No"}]},
]
WORDS = [
    "What is the weather in Paris? It is 22 C and sunny. Thanks! You are welcome. Is 7 prime? And 9? Yes No",
    "Be brief. Answer Yes or No. Hi! How can I help? Say yes. I need the tool. The tool says 22 C. Be polite.",
    "7 has no divisors but 1 and 7. 9 is 3 times 3. get_weather city Get the weather The city string object",
    "system user assistant model tool function type name description parameters properties required",
]


@cache
def index() -> dict:
    return json.loads((CORPUS_DIR / "index.json").read_text())


@cache
def renderings() -> dict:
    return json.loads((CORPUS_DIR / "renderings.json").read_text())


def template(family: str) -> str:
    return (CORPUS_DIR / template_file(family)).read_text()


def template_file(family: str) -> str:
    """The family's template, relative to tests/chat_templates/: a published one, or one re-written here."""
    return index()["families"][family].get("template", f"{family}.jinja")


@cache
def tokenizer_for(family: str, chat_template: str | None = None):
    """A byte-level BPE tokenizer whose special tokens are the family's markers, so offsets are exact."""
    spec = index()["families"][family]["tokenizer"]
    tokenizer = build_bpe_tokenizer(
        WORDS * 4,
        320,
        spec["special"],
        eos_token=spec["eos"],
        pad_token=spec.get("pad", spec["eos"]),
        bos_token=spec.get("bos"),
        chat_template=chat_template if chat_template is not None else template(family),
    )
    if spec.get("added"):
        tokenizer.add_tokens(spec["added"])  # like <think>, <tool_call>: added vocabulary, not special tokens
    return tokenizer


def conversation(family: str, kind: str) -> tuple[list[dict], list[dict] | None]:
    """The ``kind`` conversation as this family's data would hold it, and its tools."""
    options = index()["families"][family].get("options", {})
    if kind == "plain":
        messages = PLAIN if options.get("system", True) else PLAIN[1:]
        return copy.deepcopy(messages), None
    if kind == "parts":
        messages = PARTS if options.get("system", True) else PARTS[1:]
        return copy.deepcopy(messages), None
    if kind == "reasoning":
        return copy.deepcopy(REASONING), None
    if kind == "assistant_first":
        return copy.deepcopy(ASSISTANT_FIRST), None
    messages = copy.deepcopy(TOOL_REASONING if kind == "tool_reasoning" else TOOL_CONVERSATION)
    call = messages[1]
    if options.get("tool_args") == "json":  # DeepSeek-V3 concatenates the arguments as a string
        for tool_call in call["tool_calls"]:
            tool_call["function"]["arguments"] = json.dumps(tool_call["function"]["arguments"])
    if options.get("tool_call_in_content"):  # LFM2 never reads tool_calls: its data writes the call as text
        del call["tool_calls"]
        call["content"] = '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>'
    return messages, copy.deepcopy(TOOLS)


def cases() -> list[tuple[str, str]]:
    return [(family, kind) for family, entry in index()["families"].items() for kind in entry["kinds"]]


def expected_rendering(family: str, kind: str) -> str:
    """What the published template renders for this case; dates the template takes from the clock are filled in."""
    text = renderings()[family][kind]
    for fmt in ("%d %b %Y", "%Y-%m-%d", "%d %B %Y"):
        text = text.replace("{{today:" + fmt + "}}", datetime.now().strftime(fmt))
    return text


def trained_spans(tokenizer, text: str, ids: list[int], labels: list[int]) -> list[tuple[int, int]]:
    """The character spans of ``text`` covered by trained tokens (label == input id), adjacent ones merged."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == ids, "the tokens are not the tokenization of the rendered text"
    spans: list[list[int]] = []
    for (start, end), token, label in zip(encoding["offset_mapping"], ids, labels, strict=True):
        if label == -100:
            continue
        assert label == token, "a trained label must be the token itself"
        if spans and spans[-1][1] == start:
            spans[-1][1] = end
        else:
            spans.append([start, end])
    return [tuple(s) for s in spans]


def legacy_spans(
    tokenizer, messages: list[dict], trainable: list[int], tools=None
) -> tuple[str, list[tuple[int, int]]]:
    """hfacc's masking before the corpus existed (kept as a reference): for turn i, the characters between
    ``render(messages[:i], add_generation_prompt=True)`` and ``render(messages[:i + 1])`` (trailing whitespace
    off), and where those are not prefixes of the conversation, the answer's text searched for, plus EOS."""

    def render(conversation, prompt=False):
        return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=prompt)

    text, spans = render(messages), []
    for i in trainable:
        before = render(messages[:i], True) if i else ""
        through = render(messages[: i + 1])
        if text.startswith(before) and text.startswith(through) and len(through) > len(before):
            spans.append((len(before), len(through.rstrip())))
            continue
        floor = spans[-1][1] if spans else 0
        content = messages[i].get("content") or ""
        start = text.find(content, floor)
        end = start + len(content)
        if tokenizer.eos_token and text.startswith(tokenizer.eos_token, end):
            end += len(tokenizer.eos_token)
        spans.append((start, end))
    return text, spans


def legacy_labels(tokenizer, messages: list[dict], trainable: list[int], tools=None):
    """``(text, input_ids, labels)`` as hfacc's previous masking made them (see :func:`legacy_spans`)."""
    text, spans = legacy_spans(tokenizer, messages, trainable, tools)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoding["input_ids"]
    ends = [end for _, end in encoding["offset_mapping"]]
    labels = [t if any(a < e <= b for a, b in spans) else -100 for t, e in zip(ids, ends, strict=True)]
    return text, ids, labels


CITIES = ["Paris", "Lyon", "Oslo", "Rome", "Lima", "Kyiv", "Cairo", "Delhi", "Tokyo", "Quito", "Hanoi", "Dakar"]


def tool_calling_rows(n: int, seed: int = 0) -> list[dict]:
    """``n`` generated tool-calling conversations (the ``tools`` column a JSON string, as many datasets store it):
    the user asks for a city's weather, the assistant calls get_weather, the tool answers, the assistant reports.
    Every fourth row is a plain exchange without tools."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        city, degrees = rng.choice(CITIES), rng.randint(-5, 35)
        if i % 4 == 3:
            messages = [
                {"role": "user", "content": f"Spell {city}."},
                {"role": "assistant", "content": " ".join(city.upper())},
            ]
            rows.append({"messages": messages, "tools": None})
            continue
        call = {
            "id": f"call{i:05d}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}},
        }
        messages = [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "name": "get_weather", "content": f"{degrees} C"},
            {"role": "assistant", "content": f"It is {degrees} C in {city}."},
        ]
        rows.append({"messages": messages, "tools": json.dumps(TOOLS)})
    return rows


def save_qwen_style_tokenizer(rows: list[dict], directory) -> None:
    """A BPE tokenizer with Qwen2.5's chat template and markers, trained on the rendered rows, saved to disk."""
    first = tokenizer_for("qwen2_5")
    texts = [
        first.apply_chat_template(r["messages"], tools=json.loads(r["tools"]) if r["tools"] else None, tokenize=False)
        for r in rows
    ]
    spec = index()["families"]["qwen2_5"]["tokenizer"]
    tokenizer = build_bpe_tokenizer(
        texts, 600, spec["special"], eos_token=spec["eos"], pad_token=spec["pad"], chat_template=template("qwen2_5")
    )
    tokenizer.add_tokens(spec["added"])
    tokenizer.save_pretrained(directory)
