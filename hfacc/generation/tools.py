"""Multi-turn rollouts with tools: token in, token out, and one target mask made once.

A trajectory is a chat prompt followed by turns: the policy samples an assistant turn (to its EOS); the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in it (the Hermes / Qwen format most published
templates write) are parsed and run; their results are appended as ``tool`` messages; the policy samples again from
the whole trajectory, and so on until a turn calls no tool, or a bound is reached. What the rows train on:

- **Token in, token out.** Every sampled id is kept as sampled (never decoded and re-tokenized). A tool message is
  tokenized as the chat template's rendering of *just that appended part*: the conversation is rendered without it
  (cut after its last EOS: the policy's turn ends at its EOS) and with it (plus the next generation prompt), and the
  ids the second adds are the tool tokens (:func:`get_tool_suffix_ids`). Where the template's rendering of the
  conversation so far is not the ids the trajectory holds (a template that is not append-only, e.g. one that drops
  earlier reasoning, or a turn the policy sampled in a tokenization the tokenizer would not produce), hfacc says so
  once at WARNING and goes on with the ids as sampled.
- **One mask.** A token is a target iff the policy sampled it. Prompt and tool tokens are context: ``labels`` -100,
  attended, in no count (:func:`hfacc.generation.rollout.build_rollout_rows` writes the labels from this mask;
  nothing downstream keeps another).
- **Budgets.** ``max_completion_length`` bounds the whole trajectory after the prompt, model and tool tokens
  together: each turn may sample at most what is left. A tool result is appended only if it leaves room for at
  least one more sampled token; otherwise the trajectory ends just before it, as sampled (the call stays as text,
  its result is not in the row) and counts as clipped. ``max_tool_calling_iterations`` (TRL's name; None: only the
  token budget) bounds the rounds of tool results; a call after the last round is not run and ends the trajectory.
  A turn cut by the budget (no EOS) is not parsed for calls: the trajectory ends, clipped.
- **Failures never crash the run.** A call of an unknown tool, one with arguments the function does not take, a
  tool that raises, one that returns something other than a string, or one that does not answer within
  ``tool_timeout`` seconds each become a ``tool`` message with the error (counted in ``tools/failure_frequency``);
  a ``<tool_call>`` block that is not a JSON object with a string ``name`` and an object ``arguments`` stays plain
  text (not a call).

:class:`EnvironmentPool` is TRL's ``environment_factory`` (one callable): an environment per completion whose
methods are that trajectory's tools and whose ``get_reward()`` may score it.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .engine import GenerationEngine, Samples, SamplingSettings

logger = logging.getLogger(__name__)

TOOL_CALL_PATTERN = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def get_tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """The JSON schema of each tool, from its type hints and docstring (transformers' ``get_json_schema``), as the
    chat template's ``tools`` takes them. A tool that has none, or two tools of one name, are a ``ValueError``."""
    from transformers.utils import get_json_schema

    schemas, names = [], set()
    for tool in tools:
        if not callable(tool):
            raise ValueError(
                f"tools: {tool!r} is not a function; give Python functions with type hints and docstrings."
            )
        try:
            schema = get_json_schema(tool)
        except Exception as err:  # transformers raises its own DocstringParsingException / TypeHintParsingException
            raise ValueError(
                f"tools: {getattr(tool, '__name__', tool)!r} has no JSON schema ({err}); give it type hints and a "
                "Google-style docstring with an Args: section (transformers' get_json_schema)."
            ) from err
        name = schema["function"]["name"]
        if name in names:
            raise ValueError(f"tools: two tools are named {name!r}; a call names its tool, so names must differ.")
        names.add(name)
        schemas.append(schema)
    return schemas


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """``(content, tool_calls)`` of a sampled assistant turn: its well-formed ``<tool_call>`` blocks as calls in the
    chat-template format ``{"type": "function", "function": {"name", "arguments"}}`` and the text around them. A
    malformed block (not JSON, no string ``name``, ``arguments`` not an object) stays in the content as text.

    >>> parse_tool_calls('Let me see. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    ('Let me see.', [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}])
    >>> parse_tool_calls("<tool_call>{oops}</tool_call>")[1]
    []
    """
    calls, kept, last = [], [], 0
    for match in TOOL_CALL_PATTERN.finditer(text):
        call = _as_call(match.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _as_call(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some formats write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": value["name"], "arguments": arguments}}


def run_tool_call(tools: Mapping[str, Callable], call: dict, timeout: float | None = None) -> tuple[str, bool]:
    """``(content, failed)``: the result of one parsed call as the text of its ``tool`` message. An unknown tool,
    arguments the function refuses, an exception, a result that is not a string, or no answer within ``timeout``
    seconds give an ``"Error: ..."`` text and ``failed=True``; nothing raises."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if name not in tools:
        return f"Error: there is no tool named {name!r} (tools: {', '.join(sorted(tools))}).", True
    try:
        if timeout is None:
            result = tools[name](**arguments)
        else:
            # The tool runs in a thread of its own, waited for at most `timeout` seconds. A thread cannot be killed:
            # one that never returns keeps running in the background, the trajectory goes on with the error.
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
            try:
                result = pool.submit(tools[name], **arguments).result(timeout=timeout)
            finally:
                pool.shutdown(wait=False)
    except concurrent.futures.TimeoutError:
        return f"Error: tool {name!r} did not answer within {timeout} s.", True
    except Exception as err:
        return f"Error: tool {name!r} raised {type(err).__name__}: {err}", True
    if not isinstance(result, str):
        return f"Error: tool {name!r} returned {type(result).__name__}, not a string.", True
    return result, False


def render_ids(tokenizer, messages: Sequence[Mapping], tools: list[dict] | None, add_generation_prompt: bool):
    """The chat template's ids of ``messages`` (rendered as text, tokenized without adding special tokens: the
    template wrote them), as :func:`hfacc.generation.rollout.get_prompt_ids` tokenizes a prompt."""
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def cut_after_last(ids: list[int], token_id: int | None) -> list[int]:
    """``ids`` up to and including the last ``token_id`` (all of them when it does not occur)."""
    if token_id is None or token_id not in ids:
        return ids
    return ids[: len(ids) - ids[::-1].index(token_id)]


def renders_as(tokenizer, messages: Sequence[Mapping], tools: list[dict] | None, held_ids: Sequence[int]) -> bool:
    """Whether the template's rendering of ``messages`` (whose last is the policy's turn), cut after its last EOS,
    is ``held_ids``: the trajectory's ids, as sampled and appended, are the conversation as the template writes it."""
    rendered = cut_after_last(render_ids(tokenizer, messages, tools, False), tokenizer.eos_token_id)
    return rendered == list(held_ids)


def get_tool_suffix_ids(
    tokenizer,
    messages: Sequence[Mapping],
    tool_messages: Sequence[Mapping],
    tools: list[dict] | None,
    held_ids: Sequence[int] | None = None,
) -> tuple[list[int] | None, bool]:
    """``(suffix, append_only)``: the ids the template adds for ``tool_messages`` appended to ``messages`` (whose
    last is the policy's turn), the next generation prompt included, and whether the template's rendering of
    ``messages`` is ``held_ids`` (the prompt's rendering and every id of the trajectory so far, as sampled).

    The suffix is cut from the rendering with the tool messages after the rendering without them, itself cut after
    its last EOS (where the policy's turn ended; a template may write more, such as a newline, after it, which then
    belongs to the suffix). It is None where the rendering with the tool messages does not start with the one
    without (the template writes the earlier turns differently once a tool result follows): no ids are the
    rendering of just the appended part then."""
    before = cut_after_last(render_ids(tokenizer, messages, tools, False), tokenizer.eos_token_id)
    after = render_ids(tokenizer, list(messages) + list(tool_messages), tools, True)
    append_only = held_ids is None or list(held_ids) == before
    if after[: len(before)] != before:
        return None, False
    return after[len(before) :], append_only


class EnvironmentPool:
    """TRL's ``environment_factory`` (one callable): one environment per completion, whose public methods are its
    tools and which may give the reward.

    ``factory()`` makes an environment; it must have a ``reset(**row)`` that returns None or a text appended to the
    prompt's last message (``row``: the prompt's dataset row). Its public methods other than ``reset`` and
    ``get_reward`` are tools (type hints and docstrings, as ``tools``); a ``get_reward()`` returning a float makes it a
    reward source of weight 1, named after its class. Environments are made once and reset for each completion (a
    generation of N completions holds N; the pool grows to the largest generation).

    Not yet: TRL's dict of several environments selected per row, async methods.
    """

    def __init__(self, factory: Callable[[], Any]):
        if not callable(factory):
            raise ValueError("environment_factory must be a callable that returns an environment.")
        probe = factory()
        if not callable(getattr(probe, "reset", None)):
            raise ValueError(
                f"environment_factory made a {type(probe).__name__} without a callable reset(**row); each environment "
                "must define one (it returns None, or a text appended to the prompt's last message)."
            )
        self.factory, self.instances = factory, [probe]
        self.name = type(probe).__name__
        self.tool_names = [
            name
            for name, _ in inspect.getmembers(probe, predicate=inspect.ismethod)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]
        self.has_reward = callable(getattr(probe, "get_reward", None))

    def methods(self, environment) -> list[Callable]:
        """The environment's tools, bound to it."""
        return [getattr(environment, name) for name in self.tool_names]

    def take(self, n: int) -> list:
        """``n`` environments (made once, reused across generations; reset by the caller)."""
        while len(self.instances) < n:
            self.instances.append(self.factory())
        return self.instances[:n]

    def reward_function(self) -> Callable:
        """The environments' ``get_reward()`` as a reward function (named after the class), or a ``ValueError``."""
        if not self.has_reward:
            raise ValueError(f"{self.name} has no get_reward()")

        def reward(prompts, completions, environments, **kwargs):
            return [environment.get_reward() for environment in environments]

        reward.__name__ = self.name
        return reward


@dataclass
class Trajectory:
    """One multi-turn completion: what was sampled and appended after the prompt, with its target mask.

    Args:
        prompt: the prompt's messages.
        ids: every id after the prompt, in order: the policy's turns and the tool messages' tokens.
        mask: per id of ``ids``, True where the policy sampled it (a target), False for tool tokens (context).
        messages: the completion as messages (assistant turns, with their parsed ``tool_calls``, and tool results),
            as the reward functions get it.
        logps: the sampler's log-prob of each id (0.0 on tool tokens), when the engine gives them (vLLM); else None.
        turns: assistant turns sampled; tool_calls, tool_failures: calls run, and those that failed.
        truncated: the trajectory ended on the token budget (a turn without EOS, or a tool result that did not fit).
    """

    prompt: list[dict]
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    logps: list[float] | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    truncated: bool = False
    done: bool = False

    @property
    def num_model_tokens(self) -> int:
        return sum(self.mask)


class MultiTurnSampler:
    """Samples multi-turn trajectories with tools (the module docstring gives the rules).

    Args:
        tools: Python functions (type hints and a docstring each: their schemas are transformers' ``get_json_schema``).
        tokenizer: the policy's tokenizer; its chat template must render ``tools``, ``tool_calls`` and ``tool``
            messages, and its EOS must end an assistant turn (the engine stops there).
        max_tool_calling_iterations: the most rounds of tool results per trajectory (None: only the token budget).
        tool_timeout: seconds a tool may take before its call fails (None: no limit; the tool runs in this thread).
        environments: an :class:`EnvironmentPool`: each trajectory's environment's methods are tools too.

    >>> sampler = MultiTurnSampler([multiply], tokenizer, max_tool_calling_iterations=2)  # doctest: +SKIP
    >>> trajectories = sampler.sample(engine, prompts, prompt_ids, SamplingSettings(64))  # doctest: +SKIP
    >>> trajectories[0].ids, trajectories[0].mask  # doctest: +SKIP
    """

    def __init__(
        self,
        tools: Sequence[Callable],
        tokenizer,
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = None,
        environments: EnvironmentPool | None = None,
    ):
        if max_tool_calling_iterations is not None and max_tool_calling_iterations < 0:
            raise ValueError(f"max_tool_calling_iterations={max_tool_calling_iterations}: it must be >= 0 (or None).")
        if tool_timeout is not None and not tool_timeout > 0:
            raise ValueError(f"tool_timeout={tool_timeout}: it must be > 0 seconds (or None).")
        tools = list(tools)
        self.environments = environments
        probe = environments.methods(environments.instances[0]) if environments is not None else []
        self.schemas = get_tool_schemas(tools + probe)  # one schema per name, environment methods included
        self.tools = {s["function"]["name"]: t for s, t in zip(self.schemas, tools, strict=False)}
        self.tokenizer = tokenizer
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.tool_timeout = tool_timeout
        self.warned: set[str] = set()

    def prompt_ids(self, prompt: Sequence[Mapping]) -> list[int]:
        """The prompt's ids with the tools' schemas and the generation prompt."""
        return render_ids(self.tokenizer, prompt, self.schemas, True)

    def sample(
        self,
        engine: GenerationEngine,
        prompts: Sequence[Sequence[Mapping]],
        prompt_ids: Sequence[Sequence[int]],
        settings: SamplingSettings,
        *,
        seed: int | None = None,
        environments: Sequence[Any] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per prompt (repeat a prompt for several). ``prompt_ids`` are what the rows start with
        (:meth:`prompt_ids`, maybe cut to ``max_prompt_length``); each round samples every unfinished trajectory in
        one engine call, from its prompt and everything after it. ``environments``: one per prompt (already reset),
        whose methods are that trajectory's tools besides the shared ones."""
        budget = settings.max_completion_length
        trajectories = [Trajectory(prompt=[dict(m) for m in p]) for p in prompts]
        tools = [self.tools] * len(trajectories)
        if environments is not None:
            pool = self.environments
            tools = [{**self.tools, **{m.__name__: m for m in pool.methods(e)}} for e in environments]
        full_prompts = [self.prompt_ids(p) for p in prompts]  # the template's, for the append-only check
        rounds = 0
        while True:
            active = [i for i, t in enumerate(trajectories) if not t.done]
            if not active:
                return trajectories
            room = {i: budget - len(trajectories[i].ids) for i in active}
            samples = engine.sample(
                [list(prompt_ids[i]) + trajectories[i].ids for i in active],
                replace(settings, max_completion_length=max(room.values())),
                seed=None if seed is None else seed + 7919 * rounds,
            )
            # Sampling n tokens and keeping the first k is sampling with a limit of k: each keeps what fits its room.
            for j, i in enumerate(active):
                ids = list(samples.completion_ids[j])[: room[i]]
                logps = None if samples.logps is None else list(samples.logps[j])[: room[i]]
                self._add_turn(trajectories[i], ids, logps, full_prompts[i], budget, tools[i])
            rounds += 1

    def answer(
        self, engine: GenerationEngine, prompts: Sequence[Sequence[Mapping]], max_completion_length: int
    ) -> list[Trajectory]:
        """Greedy trajectories of ``prompts`` (held-out evaluation with tools): each turn is ``engine.answer``'s
        greedy completion, the tools run between turns as in :meth:`sample`."""
        return self.sample(
            _GreedyEngine(engine, self.tokenizer.eos_token_id),
            prompts,
            [self.prompt_ids(p) for p in prompts],
            SamplingSettings(max_completion_length),
        )

    # ---- one turn of one trajectory --------------------------------------------------------------------------
    def _add_turn(self, t: Trajectory, ids: list[int], logps, full_prompt: list[int], budget: int, tools) -> None:
        tokenizer, eos = self.tokenizer, self.tokenizer.eos_token_id
        t.ids += ids
        t.mask += [True] * len(ids)
        if logps is not None or t.logps is not None:
            t.logps = (t.logps or [0.0] * (len(t.ids) - len(ids))) + (logps or [0.0] * len(ids))
        t.turns += 1
        content, calls = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True))
        stopped = bool(ids) and ids[-1] == eos
        if not stopped:  # cut by the budget: no calls are read from a turn that did not end
            t.messages.append({"role": "assistant", "content": content})
            t.truncated = t.done = True
            return
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        t.messages.append(message)
        rounds = sum(1 for m in t.messages if m["role"] == "assistant") - 1
        limit = self.max_tool_calling_iterations
        if not calls or (limit is not None and rounds >= limit):
            t.done = True
            if t.tool_calls and not renders_as(tokenizer, t.prompt + t.messages, self.schemas, full_prompt + t.ids):
                self._warn_history()
            return
        results = []
        for call in calls:
            text, failed = run_tool_call(tools, call, self.tool_timeout)
            t.tool_calls += 1
            t.tool_failures += failed
            results.append({"role": "tool", "name": call["function"]["name"], "content": text})
        suffix, append_only = get_tool_suffix_ids(
            tokenizer, t.prompt + t.messages, results, self.schemas, full_prompt + t.ids
        )
        if not append_only and suffix is not None:
            self._warn_history()
        if suffix is None:
            self._warn_once(
                "suffix",
                "hfacc: the chat template renders the conversation before a tool result differently once the result "
                "is appended, so no ids are the rendering of just the tool message: such trajectories end before "
                "their tool result (said once).",
            )
            t.done = True
            return
        if len(t.ids) + len(suffix) >= budget:  # no room left for a sampled token after it: the trajectory ends
            t.truncated = t.done = True
            return
        t.ids += suffix
        t.mask += [False] * len(suffix)
        if t.logps is not None:
            t.logps += [0.0] * len(suffix)
        t.messages += results

    def _warn_history(self) -> None:
        self._warn_once(
            "history",
            "hfacc: the chat template's rendering of a multi-turn conversation is not the ids the trajectory holds "
            "(a template that is not append-only, e.g. one that drops earlier reasoning or writes a tool result "
            "differently once a turn follows it, or a turn the policy sampled in another tokenization than the "
            "tokenizer's): training goes on with the ids as sampled, each tool result tokenized as the template "
            "renders it appended (said once).",
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message)


class _GreedyEngine(GenerationEngine):
    """An engine's greedy answers in :meth:`GenerationEngine.sample`'s form: each stopped answer ends with EOS."""

    def __init__(self, engine: GenerationEngine, eos_token_id: int):
        super().__init__()
        self.engine, self.eos_token_id = engine, eos_token_id

    def sample(self, prompt_ids, settings, *, seed=None) -> Samples:
        limit, eos = settings.max_completion_length, self.eos_token_id
        answers = self.engine.answer(prompt_ids, limit)  # EOS left out: it is put back where the answer stopped
        ids = [a + [eos] if len(a) < limit else a for a in answers]
        return Samples(ids, [len(a) >= limit for a in answers])

    def answer(self, prompt_ids, max_new_tokens):
        return self.engine.answer(prompt_ids, max_new_tokens)

    def sync_weights(self, model) -> None:
        self.engine.sync_weights(model)


__all__ = [
    "EnvironmentPool",
    "MultiTurnSampler",
    "Trajectory",
    "get_tool_schemas",
    "get_tool_suffix_ids",
    "parse_tool_calls",
    "render_ids",
    "renders_as",
    "run_tool_call",
]
