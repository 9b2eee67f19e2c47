"""Which characters of a rendered conversation the assistant wrote, read from the chat template itself.

A chat template renders a whole conversation in one pass, and many rewrite earlier turns depending on what follows:
Qwen3 drops the reasoning of turns before the last user query, GPT-OSS ends the last answer with ``<|return|>`` and
earlier ones with ``<|end|>``, Phi-3 appends EOS unless a generation prompt is asked for, Mistral moves the system
prompt into the last user message. So "the prompt for turn k" and "the conversation through turn k" are not prefixes
of the conversation, and a mask built from them, or from searching the answer's text, trains the wrong characters.

hfacc trains exactly the tokens the full conversation renders, and finds the assistant's characters in that one
rendering (:func:`get_assistant_spans`):

1. Where the template has ``{% generation %}`` markers, they are the answer (transformers' own tracker).
2. Otherwise the template is compiled once more with a marker at the start of every iteration of its top-level
   loops (and after each loop). Rendering the conversation with it gives, for every message, the *segment* of the
   output the template wrote while its loop was at that message. The text is the same as
   ``tokenizer.apply_chat_template`` writes (checked once for every shape of conversation); only the positions are
   new. Inside an assistant message's segment:

   - the turn starts where its prompt ends. The prompt for turn k ends with what the template writes after the
     conversation so far when asked for a generation prompt (``<|im_start|>assistant\\n``, ``<|start|>assistant``,
     ``[/INST]`` already in the user's segment, ``<｜tool▁outputs▁end｜>`` after tool results, ...). That text is
     matched where the previous message's segment ends, never searched for; where the template indents its loop
     body and its generation prompt differently, up to whitespace (``"  <｜Assistant｜>"`` against
     ``"      <｜Assistant｜>"``). A turn rendered with only the first tokens of it (a past turn whose empty
     thinking block the template drops) starts after those tokens, when they hold a special token: a prefix of plain
     text (the whitespace before ``###Assistant:``) would be a guess, and the row is refused instead. A turn with no
     earlier segment (a conversation that opens with the assistant, or a first user message a template renders
     before its loop) is placed behind a probe user message, where the conversation-opening text the template
     writes into the turn's segment (BOS, a default system prompt) moves to the probe;
   - the turn ends where its segment ends, less trailing whitespace (scaffolding such as the newline after
     ``<|im_end|>``), or earlier, where the template writes the messages that follow into the turn's segment while
     their own iterations write nothing (Gemma 4 renders the tool results after a call inside the call's
     iteration): there the turn's text is what its iteration writes without them, and, where the template writes
     the turn's text after them (Gemma 4's answer after the results, before ``<turn|>``), that text to the segment's
     end as well. A segment that does not end in a special token has no end-of-turn marker of its own: the
     template ends the turn with the next message's role marker (GLM-4 ``<|user|>``, ``<|observation|>``) or, after
     the last turn, with the special token it writes once its loop is done (Jamba's ``<|eom|>``, Metharme's EOS).
     The model must learn to emit it to stop, so that token is trained with the turn.

   Because segments come from the full rendering, everything the template writes for the turn there (reasoning it
   keeps, tool calls, channel headers, the end-of-turn marker) is trained, and nothing of another message is:
   system, user and tool text, tool schemas and default system prompts lie in other segments or outside all loops.
3. A turn the template writes outside its loops (Nemotron-Nano-v2 writes the last assistant turn after its loop), or
   every turn of a template whose loops cannot be traced (it iterates over indices, or renders inside a macro),
   comes from the prefix renders above, accepted only when they are true prefixes of the conversation; otherwise the
   row is refused with an error that names it.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

METHODS = {
    "generation": "{% generation %} markers",
    "segments": "the template's message segments",
    "prefix": "prefix renders",
    "segments_and_prefix": "the template's message segments and prefix renders",
}
PROBE_TEXT = "hfacc probe"
_MARK = "hfacc_loop_mark"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
logger = logging.getLogger(__name__)


class ChatTemplateError(ValueError):
    """The chat template's output cannot be split into the assistant's text and the rest."""


class AssistantSpans(NamedTuple):
    """The rendered conversation, the character spans to train, how they were found, and open turns.

    ``unclosed`` counts trained turns that end without an end-of-turn marker to train (a template that ends turns
    with the next message's marker, on the conversation's last turn).
    """

    text: str
    spans: list[tuple[int, int]]
    method: str
    unclosed: int


@dataclass
class Rendering:
    """A rendered conversation; ``segments[i]`` is the ``(start, end)`` the template wrote for message i, or None."""

    text: str
    segments: list[tuple[int, int] | None] | None
    generation: list[tuple[int, int]]


def get_assistant_spans(
    tokenizer,
    messages: list[dict],
    trainable: Sequence[int],
    tools: list[dict] | None = None,
    chat_template: str | None = None,
) -> AssistantSpans:
    """Render ``messages`` with the tokenizer's chat template; return the text and the spans of ``trainable`` turns.

    ``messages`` are plain dicts (see :func:`hfacc.data.formats.normalize_messages`); ``trainable`` are indices of
    assistant messages. The method is described in this module's docstring. Raises :class:`ChatTemplateError` when the
    template's output cannot be attributed to messages. ``chat_template`` renders instead of the tokenizer's own (a
    vision-language processor's template, :mod:`hfacc.data.vision`).
    """
    renderer = get_renderer(tokenizer, tools, chat_template)
    messages = renderer.adapt_content(messages)
    full = renderer.render(messages, tools)
    if full is None or not renderer.same_as_reference(full.text, messages, tools):
        text = renderer.reference(messages, tools)
        _check_fields_rendered(renderer, messages, trainable, tools, text)
        return _prefix_spans(renderer, messages, trainable, tools, text)
    _check_fields_rendered(renderer, messages, trainable, tools, full.text)
    if renderer.has_generation:
        return _generation_spans(renderer, messages, trainable, full)
    if full.segments is None:
        return _prefix_spans(renderer, messages, trainable, tools, full.text)
    spans, unclosed, by_prefix = [], 0, 0
    for k in trainable:
        if full.segments[k] is None:  # written outside the template's loops (Nemotron-Nano-v2's last turn)
            start, end = _prefix_span(renderer, messages, k, tools, full.text, "the template writes it after its loop")
            turn, closed, by_prefix = [(start, end)], renderer.special_at_end(full.text, end), by_prefix + 1
        else:
            turn, closed = _turn_spans(
                renderer, messages, k, tools, full, _turn_start(renderer, messages, k, tools, full)
            )
            _warn_text_left_out(renderer, messages[k], k, full, turn)
        unclosed += not closed
        spans += [(a, b) for a, b in turn if b > a]
    method = "segments" if not by_prefix else "prefix" if by_prefix == len(trainable) else "segments_and_prefix"
    return AssistantSpans(full.text, spans, METHODS[method], unclosed)


def get_renderer(tokenizer, tools=None, chat_template: str | None = None) -> ChatRenderer:
    """The (cached) renderer of the template ``apply_chat_template`` would use for these tools (or of
    ``chat_template``, given)."""
    template = chat_template or tokenizer.get_chat_template(None, tools)
    per_tokenizer = _RENDERERS.setdefault(tokenizer, {})
    if template not in per_tokenizer:
        per_tokenizer[template] = ChatRenderer(tokenizer, template)
    return per_tokenizer[template]


_RENDERERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ChatRenderer:
    """One chat template, compiled twice: as transformers compiles it, and with loop-iteration markers."""

    def __init__(self, tokenizer, template: str):
        # A weak reference: the renderer is cached against the tokenizer and must not keep it alive.
        self._tokenizer = weakref.ref(tokenizer)
        self.template = template
        self.has_generation = bool(_GENERATION_TAG.search(template))
        self.template_kwargs = dict(tokenizer.special_tokens_map)
        specials = set(tokenizer.all_special_tokens)
        specials |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        self.specials = sorted((s for s in specials if s), key=len, reverse=True)
        self.traced, self.loop_depths = _compile_traced(template)
        self._boundaries: dict[str, list[int]] = {}
        self._checked: set = set()
        self.content_mode = self._probe_content_mode()
        self.warned_left_out = False

    def same_as_reference(self, text: str, messages, tools) -> bool:
        """Whether ``text`` is what ``apply_chat_template`` renders. Checked once per shape of conversation (its
        keys and value types, recursively): only the shape can make transformers prepare the inputs differently."""
        shape = _shape((messages, tools))
        if shape in self._checked:
            return True
        if text != self.reference(messages, tools):
            return False
        if len(self._checked) < 100_000:
            self._checked.add(shape)
        return True

    @property
    def tokenizer(self):
        return self._tokenizer()

    def reference(self, messages, tools, add_generation_prompt=False) -> str:
        """The text ``apply_chat_template`` renders: the tokens trained on are always the template's own."""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.template,
            )
        except Exception as err:  # jinja raises its own errors ("roles must alternate", ...)
            raise ChatTemplateError(f"the chat template refused this conversation: {err}") from err

    def render(self, messages, tools, add_generation_prompt=False) -> Rendering | None:
        """Render with the traced template: the text and each message's segment (None: cannot be traced)."""
        if self.traced is None:
            return None
        events: list[tuple[int, Any, int]] = []
        blocks: list[str] = []
        generation: list[tuple[int, int]] = []
        position = [0]

        def mark(loop, item):
            events.append((loop, item, position[0]))
            return ""

        kwargs = dict(self.template_kwargs)
        kwargs[_MARK] = mark
        try:
            with self.traced.environment.activate_tracker(blocks, generation):
                for block in self.traced.generate(
                    messages=messages,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **kwargs,
                ):
                    blocks.append(block)
                    position[0] += len(block)
        except Exception as err:
            raise ChatTemplateError(f"the chat template refused this conversation: {err}") from err
        text = "".join(blocks)
        return Rendering(text, _segments(events, messages, self.loop_depths, text), generation)

    def adapt_content(self, messages: list[dict]) -> list[dict]:
        """Content as the template reads it: text parts joined for string-only templates, strings wrapped as one
        text part for templates that only read parts (Idefics3, LLaVA-NeXT), and as given for those that read both."""
        if self.content_mode == "either":
            return messages
        out = []
        for message in messages:
            content = message.get("content")
            if self.content_mode == "string" and isinstance(content, list):
                if any(part.get("type") != "text" for part in content):  # an image part (hfacc.data.vision)
                    raise ChatTemplateError(
                        "the chat template reads message content as a string, so it has no place for an image part"
                    )
                message = {**message, "content": "".join(part["text"] for part in content)}
            elif self.content_mode == "parts" and isinstance(content, str):
                message = {**message, "content": [{"type": "text", "text": content}]}
            out.append(message)
        return out

    def special_at_end(self, text: str, end: int) -> bool:
        return any(text.endswith(s, 0, end) for s in self.specials)

    def special_at(self, text: str, start: int) -> str | None:
        return next((s for s in self.specials if text.startswith(s, start)), None)

    def token_boundaries(self, text: str) -> list[int]:
        """Character offsets where the tokenizer's tokens of ``text`` end (cached: prompt tails repeat)."""
        if text not in self._boundaries:
            offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            self._boundaries[text] = sorted({b for _, b in offsets if b > 0})
        return self._boundaries[text]

    def _probe_content_mode(self) -> str:
        """Render probe conversations with string and with text-part content: which does the template read?

        Read means every probe text is in the output and no part was dumped as a dict (:func:`_dumped_parts`).
        The probe with a system message counts only where the template accepts a system message at all.
        """

        def reads(content, system: bool) -> bool:
            conversation = [
                {"role": "user", "content": content(PROBE_TEXT + " one")},
                {"role": "assistant", "content": content(PROBE_TEXT + " two")},
            ]
            if system:
                conversation.insert(0, {"role": "system", "content": content(PROBE_TEXT + " zero")})
            try:
                text = self.reference(conversation, None)
            except ChatTemplateError:
                return False
            probes = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"] for m in conversation]
            return all(p in text for p in probes) and not _dumped_parts(text, probes)

        def as_parts(text):
            return [{"type": "text", "text": text}]

        strings, parts = reads(str, False), reads(as_parts, False)
        system_strings, system_parts = reads(str, True), reads(as_parts, True)
        strings = strings and (system_strings or not system_parts)
        parts = parts and (system_parts or not system_strings)
        if strings and not parts:
            return "string"
        if parts and not strings:
            return "parts"
        return "either"


def _dumped_parts(text: str, probes: Sequence[str]) -> bool:
    """Whether a rendering shows a probe's content part as a dict or JSON (``{'type': 'text', 'text': 'hfacc
    probe one'}``): the probe's text right after a ``text`` key. Not ``"type"`` anywhere: a template's own text may
    hold it (Hermes' tool prompt does)."""
    return any(f"{q}text{q}: {q}{p}" in text for p in probes for q in "'\"")


def _compile_traced(template: str):
    """The template compiled in transformers' own environment, with a marker call opening every loop iteration.

    Only loops whose output is yielded directly are traced (not those inside macros, call or filter blocks, or
    ``{% set %}`` blocks, whose output is buffered and placed later). Returns ``(template, depth of each loop)``.
    """
    try:
        from jinja2 import nodes
        from transformers.utils.chat_template_utils import _compile_jinja_template

        environment = _compile_jinja_template(template).environment
        tree = environment.parse(template)
    except Exception:  # an older transformers, or a template jinja cannot parse: no tracing
        return None, []
    depths: list[int] = []

    def marker(loop_id: int, item, lineno: int):
        call = nodes.Call(nodes.Name(_MARK, "load"), [nodes.Const(loop_id), item], [], None, None)
        return nodes.Output([call]).set_lineno(lineno).set_environment(environment)

    def walk(body: list, depth: int, buffered: bool) -> None:
        out = []
        for node in body:
            if isinstance(node, nodes.For):
                walk(node.body, depth + 1, buffered)
                walk(node.else_, depth, buffered)
                if not buffered and isinstance(node.target, nodes.Name):
                    loop_id = len(depths)
                    depths.append(depth)
                    node.body.insert(0, marker(loop_id, nodes.Name(node.target.name, "load"), node.lineno))
                    out += [node, marker(loop_id, nodes.Const(None), node.lineno)]
                    continue
            elif isinstance(node, nodes.If):
                walk(node.body, depth, buffered)
                for branch in node.elif_:
                    walk(branch.body, depth, buffered)
                walk(node.else_, depth, buffered)
            elif isinstance(node, (nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.AssignBlock)):
                walk(node.body, depth, True)
            elif isinstance(getattr(node, "body", None), list):  # With, Scope, ...
                walk(node.body, depth, buffered)
            out.append(node)
        body[:] = out

    try:
        walk(tree.body, 0, False)
        return environment.from_string(tree), depths
    except Exception:
        return None, []


def _segments(events, messages, depths, text):
    """Each message's segment: from its iteration's marker to the next marker of the same loop.

    A message met by several loops (a template that first scans the conversation) takes the outermost loop that
    wrote something other than whitespace there. None where the template's loops never reached a message, or when
    two segments are ambiguous or overlap (the rendering cannot be traced then).
    """
    index = {id(m): i for i, m in enumerate(messages)}
    found: dict[int, list[tuple[int, int, int]]] = {}
    open_: dict[int, tuple[Any, int]] = {}
    for loop, item, position in events:
        if loop in open_:
            previous, start = open_.pop(loop)
            if id(previous) in index and position > start:
                found.setdefault(index[id(previous)], []).append((depths[loop], start, position))
        if item is not None:
            open_[loop] = (item, position)
    segments: list[tuple[int, int] | None] = [None] * len(messages)
    for i, candidates in found.items():
        written = [c for c in candidates if text[c[1] : c[2]].strip()] or candidates
        top = min(c[0] for c in written)
        outermost = [c for c in written if c[0] == top]
        if len(outermost) > 1:
            return None
        segments[i] = outermost[0][1:]
    placed = sorted(s for s in segments if s is not None)
    if any(a[1] > b[0] for a, b in zip(placed, placed[1:], strict=False)):
        return None
    return segments


def _turn_start(renderer: ChatRenderer, messages, k, tools, full: Rendering) -> int:
    """Where assistant message k's own text begins in the full rendering (see the module docstring)."""
    if _previous_segment(full, k) is not None:
        return _anchored_start(renderer, messages, k, tools, full)
    return _start_behind_probe(renderer, messages, k, tools, full)


def _previous_segment(rendering: Rendering, k: int) -> int | None:
    return next((j for j in range(k - 1, -1, -1) if rendering.segments[j] is not None), None)


def _anchored_start(renderer: ChatRenderer, messages, k, tools, full: Rendering) -> int:
    """Start of turn k: its prompt's tail, matched where the previous segment ends."""
    start_k, end_k = full.segments[k]
    previous = _previous_segment(full, k)
    tail = _prompt_tail(renderer, messages[:k], previous, tools, full)
    anchor = full.segments[previous][1]
    matched = _match_prefix(renderer, tail, full.text, anchor)
    if matched is None:
        raise ChatTemplateError(
            f"assistant message {k} does not begin with the prompt the template writes for it ({tail!r}); hfacc "
            "cannot tell where the answer starts. Add {% generation %} markers to the chat template."
        )
    return min(max(anchor + matched, start_k), end_k)


def _start_behind_probe(renderer: ChatRenderer, messages, k, tools, full: Rendering) -> int:
    """Start of a turn with no earlier segment, read off the same conversation with a probe user message before it.

    Behind the probe, the turn has an earlier segment to anchor its prompt to; the text the template wrote into the
    turn's own segment only because it opened the conversation (BOS, a default system prompt) moves to the probe.
    The turn's text from its start to its segment's end must be the same in both renderings. A template that
    renders its first user message before its loop (Llama 3.1 with tools) gets a second probe.
    """
    probe = {"role": "user", "content": PROBE_TEXT}
    shifted, position = list(messages), k
    for _ in range(2):
        shifted = renderer.adapt_content(shifted[:position] + [probe] + shifted[position:])
        position += 1
        try:
            behind = renderer.render(shifted, tools)
            if behind.segments is None or behind.segments[position] is None:
                break
            if _previous_segment(behind, position) is None:
                continue
            start = _anchored_start(renderer, shifted, position, tools, behind)
        except ChatTemplateError:
            break
        own = behind.text[start : behind.segments[position][1]]
        seg_start, seg_end = full.segments[k]
        if full.text[seg_start:seg_end].endswith(own):
            return seg_end - len(own)
        break
    raise ChatTemplateError(
        f"assistant message {k} opens the conversation and hfacc cannot tell the template's opening text from the "
        "answer. Start the conversation with a user (or system) message, or add {% generation %} markers."
    )


def _prompt_tail(renderer: ChatRenderer, head: list[dict], previous: int, tools, full: Rendering) -> str:
    """What the template writes, when asked for a generation prompt, after the segment of message ``previous``.

    Read from the prompt rendering where that segment is written as in the full conversation; a template that
    writes its generation prompt into the last message's segment (OLMo 2) is read against the rendering without it.
    """
    with_prompt = renderer.render(head, tools, add_generation_prompt=True)
    segment = with_prompt.segments[previous] if with_prompt.segments is not None else None
    start, end = full.segments[previous]
    if segment is not None and with_prompt.text[segment[0] : segment[1]] == full.text[start:end]:
        return with_prompt.text[segment[1] :]
    without = renderer.render(head, tools, add_generation_prompt=False)
    segment = without.segments[previous] if without.segments is not None else None
    cut = segment[1] if segment is not None else None
    if cut is None or with_prompt.text[:cut] != without.text[:cut]:
        cut = _common_prefix(with_prompt.text, without.text, renderer.specials)
    return with_prompt.text[cut:]


def _match_prefix(renderer: ChatRenderer, tail: str, text: str, at: int) -> int | None:
    """Length of the text at ``text[at:]`` that is the prompt ``tail``, or None where it is not there.

    In this order: all of ``tail``; all of it up to whitespace (templates indent their loop body and their
    generation prompt differently: ``"  <｜Assistant｜>"`` after the loop, ``"      <｜Assistant｜>"`` inside it);
    or its longest prefix of whole tokens that holds a special token (a past turn whose empty thinking block the
    template drops: ``<|im_start|>assistant\\n`` of ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n``). A prefix
    without a special token is never taken: it would be a guess (the whitespace before ``###Assistant:`` matches,
    and the header would be trained).
    """
    if text.startswith(tail, at):
        return len(tail)
    loose = _match_ignoring_whitespace(tail, text, at)
    if loose is not None:
        return loose
    for boundary in reversed(renderer.token_boundaries(tail)):
        if text.startswith(tail[:boundary], at) and any(s in tail[:boundary] for s in renderer.specials):
            return boundary
    return None


def _match_ignoring_whitespace(tail: str, text: str, at: int) -> int | None:
    """Length of ``text[at:]`` holding ``tail`` with its whitespace runs matched by any whitespace (or none), and
    the whitespace that follows where ``tail`` ends in whitespace; None if it does not hold it."""
    pieces = tail.split()
    pattern = r"\s*" + r"\s*".join(map(re.escape, pieces)) + (r"\s*" if tail[-1:].isspace() else "")
    found = re.compile(pattern).match(text, at)
    return None if found is None else found.end() - at


def _turn_spans(renderer: ChatRenderer, messages, k, tools, full: Rendering, start: int):
    """The spans of assistant message k's trained text from ``start``, and whether the last ends on an end-of-turn
    marker: one span, or two where the template writes the turn's text after the tool results it renders inside
    the turn (Gemma 4: the call, the results, then the answer and ``<turn|>``): the text before them and the text
    after them, the results left out."""
    own, after = _own_end(renderer, messages, k, tools, full)
    if after is None:
        end, closed = _turn_end(renderer, full, k, own)
        return [(start, end)], closed
    end, closed = _turn_end(renderer, full, k, full.segments[k][1])
    return [(start, _trimmed(full.text, start, own)), (after, end)], closed


def _trimmed(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1].isspace():
        end -= 1  # the newline after the end-of-turn token is scaffolding, not something to learn to emit
    return end


def _turn_end(renderer: ChatRenderer, full: Rendering, k: int, own: int) -> tuple[int, bool]:
    """End of assistant message k's trained text, whose own text ends at ``own`` in its segment, and whether it
    ends on an end-of-turn marker."""
    start, end = full.segments[k]
    text = full.text
    trimmed = _trimmed(text, start, own)
    if renderer.special_at_end(text, trimmed):
        return trimmed, True
    if own < end:  # later messages' text follows in the segment: no marker of the next message to look for
        return trimmed, False
    following = [s for s in full.segments[k + 1 :] if s is not None]
    marker = renderer.special_at(text, end)
    # No marker of its own: the template ends the turn with the next message's role marker, right after it
    # (GLM-4 <|user|>), or, after its last turn, with the marker it writes once the loop is done (Jamba's <|eom|>,
    # Metharme's EOS): the model must learn to emit it to stop, so it is trained with the turn.
    if marker is not None and (not following or following[0][0] == end):
        return end + len(marker), True
    return trimmed, False


def _own_end(renderer: ChatRenderer, messages, k, tools, full: Rendering) -> tuple[int, int | None]:
    """Where assistant message k's own text ends in its segment: before what the template wrote there for the
    messages right after it whose own loop iterations wrote nothing (Gemma 4 renders the tool results that follow a
    tool call inside the call's iteration); and where it resumes after them (None: it does not).

    The turn's own text is what its iteration writes without those messages: the segment of the conversation
    rendered without them (or, where the template refuses that, ending with turn k), as far as it agrees with the
    full one. Cut only where the text beyond holds such a message's content; else the segments differ for another
    reason (a template that ends the last turn differently, GPT-OSS) and the segment stays whole. Where the
    template writes the turn's text after them (Gemma 4: ``<tool_response|>checking now<turn|>``), the turn
    resumes where the conversation rendered with the turn's text emptied departs from the full one, past their
    contents: from there to the segment's end the template wrote the turn's text and its end (:func:`_resumed`),
    and the cut before them is read with the text emptied on both sides (the call's stop token, not the text).
    """
    start, end = full.segments[k]
    silent = k + 1
    while silent < len(messages) and not _wrote(full, silent):
        silent += 1
    contents = [c for c in (_text_of(m) for m in messages[k + 1 : silent]) if c.strip()]
    if not any(c in full.text[start:end] for c in contents):
        return end, None
    resumed = _resumed(renderer, messages, k, tools, full, contents)
    if resumed is not None:
        bare_messages, bare, after = resumed
        return _cut_before(renderer, bare_messages, k, silent, tools, bare, contents), after
    return _cut_before(renderer, messages, k, silent, tools, full, contents), None


def _cut_before(renderer: ChatRenderer, messages, k, silent, tools, full: Rendering, contents) -> int:
    start, end = full.segments[k]
    for without in (messages[: k + 1] + messages[silent:], messages[: k + 1]):
        try:
            alone = renderer.render(without, tools)
        except ChatTemplateError:
            continue
        segment = alone.segments[k] if alone.segments is not None else None
        if segment is None:
            continue
        own = alone.text[segment[0] : segment[1]]
        if own == full.text[start:end]:
            return end  # the same text without them: theirs is not in it (the content matched by chance)
        cut = start + _common_prefix(full.text[start:end], own, renderer.specials)
        if any(c in full.text[cut:end] for c in contents):
            return cut
    raise ChatTemplateError(
        f"the chat template writes message {k + 1} inside assistant message {k}'s turn, and hfacc cannot tell where "
        "the assistant's text ends. Add {% generation %} markers to the chat template."
    )


def _resumed(renderer: ChatRenderer, messages, k, tools, full: Rendering, contents):
    """``(messages with turn k's text emptied, their rendering, where turn k's text starts in full.text)`` where
    the template writes that text after the contents of the messages it renders inside the turn; else None.

    The two renderings agree up to the turn's text; it must start past every such content and be written there
    (the template may rewrite it: then it is not found, and :func:`_warn_text_left_out` says so)."""
    message = messages[k]
    own_text = _text_of(message).strip()
    if not own_text:
        return None
    emptied = {**message, "content": "" if isinstance(message.get("content"), str) else []}
    bare_messages = [*messages[:k], emptied, *messages[k + 1 :]]
    try:
        bare = renderer.render(bare_messages, tools)
    except ChatTemplateError:
        return None
    start, end = full.segments[k]
    segment = bare.segments[k] if bare.segments is not None else None
    if segment is None or segment[0] != start or bare.text[:start] != full.text[:start]:
        return None
    after = start + _common_prefix(full.text[start:end], bare.text[start : segment[1]], renderer.specials)
    # Every result the segment holds is written before the text (the text may quote one: "It is 22 C, sunny").
    written = [c for c in contents if c in full.text[start:end]]
    if any(c not in full.text[start:after] for c in written) or own_text not in full.text[after:end]:
        return None
    return bare_messages, bare, after


def _warn_text_left_out(renderer: ChatRenderer, message: dict, k: int, full: Rendering, turn) -> None:
    """WARNING (once per template) where a trained turn's text is rendered in its segment but lies in none of its
    trained spans: the template writes it among the messages it renders inside the turn, where hfacc cannot tell
    it from theirs."""
    own_text = _text_of(message).strip()
    start, end = full.segments[k]
    if renderer.warned_left_out or not own_text or own_text not in full.text[start:end]:
        return
    if any(own_text in full.text[a:b] for a, b in turn):
        return
    renderer.warned_left_out = True
    logger.warning(
        "hfacc: the chat template writes the text of assistant message %d (%r) among the tool results it renders "
        "inside the same turn, where hfacc cannot tell the assistant's text from theirs: that text is not trained "
        "(the turn's tool calls are). Add {%% generation %%} markers to the chat template to train it.",
        k,
        own_text[:40],
    )


def _wrote(rendering: Rendering, j: int) -> bool:
    """Whether message j's own loop iteration wrote anything but whitespace."""
    segment = rendering.segments[j]
    return segment is not None and bool(rendering.text[segment[0] : segment[1]].strip())


def _text_of(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _check_fields_rendered(renderer: ChatRenderer, messages, trainable, tools, text: str) -> None:
    """Refuse a trained turn whose tool calls, or whose reasoning where it has no text, the template never writes.

    Many templates have no place for ``tool_calls`` (Llama 3, Gemma 3, Phi-3, Zephyr, ...): the turn renders as
    its content alone, often as nothing, and training it would teach the model to answer the request with its
    text alone, or with the end-of-turn marker alone (an empty answer, which hfacc refuses as data). Seen by
    rendering the conversation once more without those fields: the template ignores them where the text is the
    same.
    """
    for k in trainable:
        message = messages[k]
        if message.get("tool_calls"):
            keys, what = ("tool_calls",), "tool calls"
        elif any(message.get(key) for key in _REASONING_KEYS) and not _text_of(message).strip():
            keys, what = _REASONING_KEYS, "reasoning"
        else:
            continue
        stripped = {key: value for key, value in message.items() if key not in keys}
        stripped.setdefault("content", "")
        try:
            same = renderer.reference([*messages[:k], stripped, *messages[k + 1 :]], tools) == text
        except ChatTemplateError:  # the template needs them (it writes them): rendered
            continue
        if same:
            left = "its text alone" if _text_of(message).strip() else "its end-of-turn marker alone (an empty answer)"
            raise ChatTemplateError(
                f"the chat template does not render the {what} of assistant message {k}: it writes the same text "
                f"with and without them, so the model would be trained on {left}. Use a chat template that renders "
                f"{what} (the model's own, for tool calling), or leave those messages out of the data."
            )


def _generation_spans(renderer: ChatRenderer, messages, trainable, full: Rendering) -> AssistantSpans:
    """The template's ``{% generation %}`` blocks (less trailing whitespace), kept for the trainable turns."""
    text = full.text
    blocks = []
    for start, end in full.generation:
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            blocks.append((start, end))
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if set(trainable) != set(assistants):  # keep the blocks of the trainable turns only
        owner = _owners(blocks, full.segments) if full.segments is not None else None
        if owner is None:
            if len(blocks) != len(assistants):
                raise ChatTemplateError(
                    "the chat template's {% generation %} blocks cannot be matched to assistant messages; train on "
                    "every assistant turn (last_turn_only=False)."
                )
            owner = assistants
        blocks = [b for b, i in zip(blocks, owner, strict=True) if i in set(trainable)]
    unclosed = sum(not renderer.special_at_end(text, end) for _, end in blocks)
    return AssistantSpans(text, blocks, METHODS["generation"], unclosed)


def _owners(blocks, segments) -> list[int] | None:
    owners = []
    for start, end in blocks:
        inside = [i for i, s in enumerate(segments) if s is not None and s[0] <= start and end <= s[1]]
        if len(inside) != 1:
            return None
        owners.append(inside[0])
    return owners


def _prefix_spans(renderer: ChatRenderer, messages, trainable, tools, text: str) -> AssistantSpans:
    """Fallback for untraceable templates: every trainable turn by :func:`_prefix_span`."""
    why = "the template's loops cannot be traced"
    spans = [_prefix_span(renderer, messages, k, tools, text, why) for k in trainable]
    unclosed = sum(not renderer.special_at_end(text, end) for _, end in spans)
    return AssistantSpans(text, spans, METHODS["prefix"], unclosed)


def _prefix_span(renderer: ChatRenderer, messages, k, tools, text: str, why: str) -> tuple[int, int]:
    """Turn k from the prompt for it and the conversation through it, when both are true prefixes of the full
    rendering ``text`` (a template that rewrites earlier turns is refused, never guessed)."""
    before = renderer.reference(messages[:k], tools, add_generation_prompt=True) if k else ""
    through = renderer.reference(messages[: k + 1], tools).rstrip()
    if not (text.startswith(before) and text.startswith(through) and len(through) > len(before)) or not k:
        raise ChatTemplateError(
            f"hfacc cannot attribute the chat template's output to assistant message {k}: {why} and it renders "
            "the conversation differently from its prefixes. Add {% generation %} markers to the chat template."
        )
    return len(before), len(through)


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple((k, _shape(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_shape(v) for v in value)
    return type(value).__name__


def _common_prefix(a: str, b: str, specials: Sequence[str] = ()) -> int:
    """Length of the common prefix of ``a`` and ``b``, moved back to the start of a special token it would cut
    (``<|endoftext|>`` and ``<|assistant|>`` share ``<|``, but no token)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    for s in specials:
        first = a.rfind(s, max(0, n - len(s) + 1), n + len(s) - 1)
        if 0 <= first < n < first + len(s):
            return first
    return n
