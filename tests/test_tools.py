"""Multi-turn GRPO with tools: token in, token out, one target mask, exact over every split.

1. The pieces: tool calls parsed from the Hermes / Qwen ``<tool_call>`` JSON format (a malformed one stays text);
   failing tools (unknown, wrong arguments, raising, a non-string result, too slow) become error messages, counted.
2. Templates: for every template of tests/chat_templates that renders tools, and the embedded default, the
   trajectory's ids (the prompt, each assistant turn as the template writes it, each tool result tokenized as the
   template's rendering of just that appended part) are the rendering of the whole conversation, or the check that
   says so at WARNING fails; which templates are append-only is pinned.
3. Fixed multi-turn trajectories (a scripted engine, uneven tool results, a failing tool, a malformed call, two calls
   in a turn, a result that does not fit the budget): the rows' targets are exactly the tokens the engine gave, and
   every split (8x1, 2x4, 1x8, ragged 3x3) and layout (padded, padding-free) gives the hand-written big batch that
   counts the policy's tokens only (<= 1e-6); a big batch that also counts the tool tokens is not the update.
4. GRPOTrainer with a Python tool on the generate path: two steps train; the rows are in ``trainer.rollout``; the
   first step's gradient is the hand-written big batch over them; the tool metrics are logged.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import time

import pytest
import torch

from hfacc import TokenWeightedArguments, TokenWeightedTrainer
from hfacc.data.embedded import build_default_model, build_default_tokenizer
from hfacc.generation.engine import GenerationEngine, Samples, SamplingSettings, TransformersEngine
from hfacc.generation.rollout import build_rollout_rows
from hfacc.generation.tools import (
    MultiTurnSampler,
    cut_after_last,
    get_tool_suffix_ids,
    parse_tool_calls,
    render_ids,
    renders_as,
    run_tool_call,
)
from hfacc.objectives.policy_gradient import PolicyGradientObjective
from tests.chat_corpus import conversation, index, tokenizer_for
from tests.grpo_setup import CaptureSteps
from tests.helpers import flat_grad, relative_error, run_trainer, train_args
from tests.rollouts import token_logps
from tests.test_policy_gradient import accumulate, collate

EPS, EPS_HIGH, BUDGET = 0.2, 0.28, 240


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(a * b)


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    if key == "boom":
        raise KeyError(key)
    if key == "number":
        return 7  # not a string: an error message
    return " ".join([key] * len(key))  # results of very uneven lengths


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ---- 1. the pieces -------------------------------------------------------------------------------------------------
def test_tool_calls_are_parsed_and_a_malformed_one_stays_text():
    content, calls = parse_tool_calls("First. " + call("multiply", a=3, b=4) + " " + call("lookup", key="x"))
    assert content == "First."
    assert [c["function"] for c in calls] == [
        {"name": "multiply", "arguments": {"a": 3, "b": 4}},
        {"name": "lookup", "arguments": {"key": "x"}},
    ]
    # arguments as a JSON string are read too
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>')[1][0]["function"] == {
        "name": "f",
        "arguments": {"k": 1},
    }
    for bad in ("<tool_call>{oops}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', '<tool_call>{"name": "f"'):  # fmt: skip
        content, calls = parse_tool_calls(bad)
        assert calls == [] and content == bad.strip()


def test_failing_tools_become_error_messages_and_never_raise():
    tools = {"multiply": multiply, "lookup": lookup, "slow": lambda: time.sleep(2) or "late"}

    def run(name, timeout=None, **arguments):
        return run_tool_call(tools, {"function": {"name": name, "arguments": arguments}}, timeout)

    assert run("multiply", a=3, b=4) == ("12", False)
    assert run("lookup", timeout=5.0, key="ab") == ("ab ab", False)
    text, failed = run("divide", a=1)
    assert failed and "no tool named 'divide'" in text and "lookup, multiply, slow" in text
    text, failed = run("multiply", a=3)
    assert failed and "TypeError" in text
    text, failed = run("lookup", key="boom")
    assert failed and text.startswith("Error: tool 'lookup' raised KeyError")
    assert run("lookup", key="number") == ("Error: tool 'lookup' returned int, not a string.", True)
    start = time.perf_counter()
    assert run("slow", timeout=0.2) == ("Error: tool 'slow' did not answer within 0.2 s.", True)
    assert time.perf_counter() - start < 1.5


def test_tools_need_schemas():
    tokenizer = build_default_tokenizer()
    with pytest.raises(ValueError, match="'<lambda>' has no JSON schema"):
        MultiTurnSampler([lambda x: x], tokenizer)

    def nodoc(x: int) -> str:
        return str(x)

    with pytest.raises(ValueError, match="'nodoc' has no JSON schema"):
        MultiTurnSampler([nodoc], tokenizer)
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        MultiTurnSampler([multiply, multiply], tokenizer)


# ---- 2. templates: the concatenation is the rendering of the whole conversation, or the check says it is not ------
# The templates whose rendering of a tool conversation is append-only at every turn (the others: a generation
# prompt that opens a reasoning block the turn's rendering does not have, a tool result written differently once
# a turn follows it, ...).
APPEND_ONLY = {
    "embedded",
    "qwen2_5", "qwen3", "qwen3_5", "llama3_1", "llama3_2", "glm4_5", "mistral_v3", "lfm2", "lfm2_5",
    "nemotron_3_nano", "jamba",
}  # fmt: skip
EMBEDDED_TOOL_CONVERSATION = [
    {"role": "user", "content": "What is 3 times 4, and what is 'ab'?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}},
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "ab"}}}]},
    {"role": "tool", "name": "multiply", "content": "12"},
    {"role": "tool", "name": "lookup", "content": "ab ab"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 1}}}]},
    {"role": "tool", "name": "multiply", "content": "12"},
    {"role": "assistant", "content": "12, and ab ab."},
]  # fmt: skip


def template_cases():
    out = [("embedded", "tools")]
    for family, entry in index()["families"].items():
        out += [(family, kind) for kind in ("tools", "tool_reasoning") if kind in entry["kinds"]]
    return out


def token_in_token_out(tokenizer, messages, tools):
    """The ids a multi-turn rollout holds for ``messages``: the prompt's rendering; each assistant turn as the
    template writes it after what came before (to its EOS: where sampling stops); each run of tool results by
    :func:`get_tool_suffix_ids`. Returns them, the rendering of the whole conversation, and whether the rollout's
    checks (the one that says so at WARNING) found every step append-only."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    end = next((i for i in range(first, len(messages)) if messages[i]["role"] == "user"), len(messages))
    messages = messages[:end]  # a rollout's turns after its prompt: assistant and tool messages only
    eos = tokenizer.eos_token_id
    ids, history, checks = render_ids(tokenizer, messages[:first], tools, True), list(messages[:first]), []
    i = first
    while i < len(messages):
        turn = render_ids(tokenizer, history + [messages[i]], tools, False)
        rest = turn[len(ids) :] if turn[: len(ids)] == ids else turn[len(ids) :]  # what the policy would sample
        ids = ids + (rest[: rest.index(eos) + 1] if eos in rest else rest)
        history.append(messages[i])
        i += 1
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        if results:
            suffix, append_only = get_tool_suffix_ids(tokenizer, history, results, tools, ids)
            checks.append(append_only)
            if suffix is None:
                return ids, None, checks
            ids, history = ids + suffix, history + results
    checks.append(renders_as(tokenizer, history, tools, ids))  # the rollout's last check, as its trajectory ends
    return ids, cut_after_last(render_ids(tokenizer, messages, tools, False), eos), checks


@pytest.mark.parametrize(("family", "kind"), template_cases())
def test_the_concatenation_is_the_rendering_of_the_conversation_or_the_check_says_not(family, kind):
    if family == "embedded":
        tokenizer = build_default_tokenizer()
        messages, tools = (
            copy.deepcopy(EMBEDDED_TOOL_CONVERSATION),
            MultiTurnSampler([multiply, lookup], tokenizer).schemas,
        )
    else:
        tokenizer = tokenizer_for(family)
        messages, tools = conversation(family, kind)
    ids, whole, checks = token_in_token_out(tokenizer, messages, tools)
    if family == "embedded":  # its template writes the schemas and the calls (before, it dropped both)
        text = tokenizer.decode(ids)
        assert "multiply(a, b): Multiply two integers." in text
        assert '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>' in text
    assert (ids == whole) == all(checks), (family, kind, checks)  # the check never misses, never cries wolf
    assert all(checks) == (family in APPEND_ONLY), (family, kind, checks)


# ---- 3. fixed multi-turn trajectories, every split and layout ------------------------------------------------------
class ScriptedEngine(GenerationEngine):
    """Gives each trajectory its scripted turns (text + EOS), in order, and records where each turn went: a fixed
    rollout whose policy tokens are known without reading any mask hfacc made."""

    name = "scripted"

    def __init__(self, tokenizer, scripts: dict[str, list[str]], prompts: dict[str, list[int]]):
        super().__init__()
        self.tokenizer, self.scripts, self.prompts = tokenizer, scripts, prompts
        self.turns = {key: 0 for key in scripts}
        self.given: dict[str, list[tuple[int, list[int]]]] = {key: [] for key in scripts}

    def sample(self, prompt_ids, settings, *, seed=None):
        out = []
        for ids in prompt_ids:
            key = next(k for k, p in self.prompts.items() if list(ids[: len(p)]) == p)
            text = self.scripts[key][self.turns[key]]
            self.turns[key] += 1
            turn = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            turn = turn[: settings.max_completion_length]
            self.given[key].append((len(ids), turn))
            out.append(turn)
        return Samples(out, [t[-1] != self.tokenizer.eos_token_id for t in out])

    def answer(self, prompt_ids, max_new_tokens):
        raise NotImplementedError

    def sync_weights(self, model):
        pass


SCRIPTS = {
    "Question 0": [call("multiply", a=3, b=4), "12"],
    "Question 1": ["The answer is 5."],
    "Question 2": [call("lookup", key="river"), "Then" + call("lookup", key="ab"), "done"],
    "Question 3": [call("lookup", key="boom"), "sorry"],  # the tool raises
    "Question 4": [call("lookup", key="number"), "ok"],  # the tool returns an int
    "Question 5": ["<tool_call>{oops}</tool_call>"],  # malformed: text
    "Question 6": [call("multiply", a=2, b=5) + call("lookup", key="castle"), "fine"],  # two calls in a turn
    "Question 7": ["Long:" + call("lookup", key="thunderstorm" * 2), "never sampled"],  # its result does not fit
}


def scripted_rollout(tokenizer, max_tool_calling_iterations=None):
    sampler = MultiTurnSampler([multiply, lookup], tokenizer, max_tool_calling_iterations)
    prompts = {key: [{"role": "user", "content": key}] for key in SCRIPTS}
    prompt_ids = {key: sampler.prompt_ids(p) for key, p in prompts.items()}
    engine = ScriptedEngine(tokenizer, SCRIPTS, prompt_ids)
    trajectories = sampler.sample(
        engine, list(prompts.values()), list(prompt_ids.values()), SamplingSettings(BUDGET), seed=0
    )
    return sampler, engine, prompt_ids, trajectories


@pytest.fixture(scope="module")
def fixed():
    return build_fixed()


def build_fixed():
    """The scripted trajectories as rows (advantages, and old log-probs with noise everywhere, tool positions too:
    they must never be read), the positions the engine gave (the policy's tokens), and a tiny policy."""
    tokenizer = build_default_tokenizer()
    sampler, engine, prompt_ids, trajectories = scripted_rollout(tokenizer)
    rows = build_rollout_rows(
        list(prompt_ids.values()),
        [t.ids for t in trajectories],
        [((-1) ** i) * (0.5 + 0.25 * i) for i in range(8)],
        [t.mask for t in trajectories],
    )
    model = build_default_model(tokenizer, hidden_size=32, num_layers=1, seed=0)
    generator = torch.Generator().manual_seed(0)
    policy_positions = []
    for key, row in zip(SCRIPTS, rows, strict=True):
        start = len(prompt_ids[key])
        positions = []
        for at, turn in engine.given[key]:
            kept = turn[: BUDGET - (at - start)]  # the budget: a turn samples at most what is left
            assert row["input_ids"][at : at + len(kept)] == kept  # token in, token out
            positions += range(at, at + len(kept))
        policy_positions.append(positions)
        with torch.no_grad():
            logp = token_logps(model, row["input_ids"])
        row["old_logps"] = [0.0] + (logp + 0.4 * torch.randn(logp.shape, generator=generator)).tolist()
    return tokenizer, model, rows, policy_positions, trajectories, sampler


def test_the_rows_train_exactly_the_tokens_the_policy_sampled(fixed):
    tokenizer, _, rows, positions, trajectories, _ = fixed
    for row, mine, t in zip(rows, positions, trajectories, strict=True):
        targets = [i for i, y in enumerate(row["labels"]) if y != -100]
        assert targets == mine and t.num_model_tokens == len(mine)
        assert all(row["labels"][i] == row["input_ids"][i] for i in targets)
    by_key = dict(zip(SCRIPTS, trajectories, strict=True))
    tool_tokens = {k: sum(1 for m in t.mask if not m) for k, t in by_key.items()}
    assert tool_tokens["Question 1"] == tool_tokens["Question 5"] == 0  # no call; a malformed call stays text
    assert len({tool_tokens[k] for k in ("Question 0", "Question 2", "Question 3", "Question 6")}) == 4  # uneven
    assert [by_key[k].turns for k in SCRIPTS] == [2, 1, 3, 2, 2, 1, 2, 1]
    assert [by_key[k].tool_calls for k in SCRIPTS] == [1, 0, 2, 1, 1, 0, 2, 1]
    assert [by_key[k].tool_failures for k in SCRIPTS] == [0, 0, 0, 1, 1, 0, 0, 0]
    # The result that does not fit ends the trajectory before it, clipped: its call stays text, no tool tokens.
    long = by_key["Question 7"]
    assert long.truncated and tool_tokens["Question 7"] == 0 and len(long.messages) == 1
    assert not any(t.truncated for k, t in by_key.items() if k != "Question 7")
    assert all(len(t.ids) <= BUDGET for t in trajectories)
    # The completion as messages (what the reward functions get): the calls parsed, the results appended.
    assert by_key["Question 0"].messages == [
        {"role": "assistant", "content": "", "tool_calls": parse_tool_calls(SCRIPTS["Question 0"][0])[1]},
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "assistant", "content": "12"},
    ]
    assert by_key["Question 3"].messages[1]["content"].startswith("Error: tool 'lookup' raised KeyError")
    assert by_key["Question 5"].messages == [{"role": "assistant", "content": "<tool_call>{oops}</tool_call>"}]
    # Token in, token out: the embedded template is append-only, so each row is the whole conversation rendered.
    for key, t, row in zip(SCRIPTS, trajectories, rows, strict=True):
        if not t.truncated:
            assert renders_as(tokenizer, t.prompt + t.messages, fixed[5].schemas, row["input_ids"]), key
    assert fixed[5].warned == set()


def test_max_tool_calling_iterations_bounds_the_rounds():
    _, _, _, trajectories = scripted_rollout(build_default_tokenizer(), max_tool_calling_iterations=1)
    two_rounds = trajectories[2]  # "Question 2" calls in two turns: the second call is not run, the trajectory ends
    assert (two_rounds.turns, two_rounds.tool_calls) == (2, 1) and not two_rounds.truncated
    assert two_rounds.messages[-1]["tool_calls"][0]["function"]["arguments"] == {"key": "ab"}


def reference_gradient(model, rows, positions, loss_type, count_tool_tokens=False):
    """The big batch by hand (plain torch): the clipped surrogate at the policy's tokens (``positions``), divided
    by the loss type's unit counted over the policy's tokens; ``count_tool_tokens``: over every token after the
    prompt (the denominators of trl#6439 and verl's horizon), the negative control."""
    model.zero_grad()
    losses, sizes = [], []
    for row, mine in zip(rows, positions, strict=True):
        at = torch.tensor(mine)
        logp = token_logps(model, row["input_ids"])[at - 1]  # position t - 1 predicts token t
        ratio = torch.exp(logp - torch.tensor(row["old_logps"])[at])
        a = row["advantages"]
        losses.append(-torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS_HIGH) * a))
        prompt = next(i for i, y in enumerate(row["labels"]) if y != -100)
        sizes.append(len(row["input_ids"]) - prompt if count_tool_tokens else len(mine))
    if loss_type == "token":
        loss = torch.cat(losses).sum() / sum(sizes)
    elif loss_type == "sequence":
        loss = torch.stack([x.sum() / n for x, n in zip(losses, sizes, strict=True)]).mean()
    else:  # dr_grpo: a constant, completions x max_completion_length
        loss = torch.cat(losses).sum() / (len(losses) * BUDGET)
    loss.backward()
    grad = flat_grad(model)
    model.zero_grad()
    return grad


@pytest.mark.parametrize("loss_type", ["token", "sequence", "dr_grpo"])
def test_every_split_and_layout_gives_the_big_batch_of_the_policy_tokens(fixed, loss_type):
    _, model, rows, positions, _, _ = fixed
    want = reference_gradient(model, rows, positions, loss_type)
    objective = PolicyGradientObjective(loss_type, EPS, EPS_HIGH, max_completion_length=BUDGET)
    for (bs, ga), layout in itertools.product([(8, 1), (2, 4), (1, 8), (3, 3)], ["padded", "packed rows"]):
        objective.fused = layout != "padded"
        error = relative_error(accumulate(model, objective, rows, bs, ga, layout), want)
        assert error <= 1e-6, (bs, ga, layout, error)
    if loss_type != "dr_grpo":  # the negative control: counting the tool tokens is another update
        counted = reference_gradient(model, rows, positions, loss_type, count_tool_tokens=True)
        assert relative_error(accumulate(model, objective, rows, 2, 4, "padded"), counted) > 0.05


@pytest.mark.parametrize("padding_free", [True, False])
def test_the_trainer_gives_the_big_batch_of_the_policy_tokens(fixed, tmp_path, padding_free):
    """The same rows through TokenWeightedTrainer (its window, layout and chunked log-probs), at 2x4 and ragged 3x3."""
    _, model, rows, positions, _, _ = fixed
    want = reference_gradient(model, rows, positions, "token")
    for bs, ga in ((2, 4), (3, 3)):
        args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, padding_free=padding_free)
        objective = PolicyGradientObjective("token", EPS, EPS_HIGH, max_completion_length=BUDGET)
        trainer, capture = run_trainer(TokenWeightedTrainer, model, rows, args, collate, objective=objective)
        assert trainer.padding_free == padding_free
        assert relative_error(capture.grads[0], want) <= 1e-6, (bs, ga, padding_free)
        logged = trainer.state.log_history[0]
        assert logged["num_completion_tokens"] == sum(len(p) for p in positions)  # the policy's tokens only


# ---- 4. GRPOTrainer with a Python tool, on the generate path ------------------------------------------------------
class FirstTurnCalls(TransformersEngine):
    """The policy's own ``generate``, except that a trajectory's first turn is a call of ``multiply`` (a tiny random
    policy would rarely write one): the tool runs, its result is appended, and the policy samples on from there."""

    forced = call("multiply", a=6, b=7)

    def sample(self, prompt_ids, settings, *, seed=None):
        samples = super().sample(prompt_ids, settings, seed=seed)
        eos = self.tokenizer.eos_token_id
        first = ["<|im_start|>tool" not in self.tokenizer.decode(ids) for ids in prompt_ids]  # no tool result yet
        forced = self.tokenizer(self.forced, add_special_tokens=False)["input_ids"] + [eos]
        ids = [
            forced[: settings.max_completion_length] if f else c
            for f, c in zip(first, samples.completion_ids, strict=True)
        ]
        return Samples(ids, [c[-1] != eos for c in ids])


def test_grpo_trains_with_a_python_tool_on_the_generate_path(tmp_path):
    from hfacc import GRPOArguments, GRPOTrainer
    from tests.grpo_setup import build_policy, build_prompts

    model, tokenizer = build_policy()
    start = copy.deepcopy(model)
    seen = []

    def answered(prompts, completions, **kwargs):
        seen.extend(completions)
        return [1.0 / (1 + len(c[-1]["content"])) for c in completions]  # the shorter the last turn, the better

    args = GRPOArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=100, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, max_grad_norm=0.0, max_tool_calling_iterations=2,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, answered, args, train_dataset=build_prompts(), processing_class=tokenizer, tools=[multiply],
        engine=FirstTurnCalls(model, tokenizer),
    )  # fmt: skip
    capture = CaptureSteps(trainer)
    trainer.add_callback(capture)
    trainer.train()
    assert trainer.state.global_step == 2 and len(capture.grads) == 2
    rollout = capture.rollouts[0]  # trainer.rollout, as it was at the first step
    rows = [dict(r) for r in rollout.rows]
    assert sum(rollout.tool_calls) == 8 and sum(rollout.tool_failures) == 0 and min(rollout.turns) == 2
    assert all(any(m["role"] == "tool" and m["content"] == "42" for m in c) for c in seen[:8])
    # The policy's tokens only are targets: each row has tool tokens (-100 inside the completion), and the logged
    # lengths count the policy's tokens.
    positions = []
    for row in rows:
        targets = [i for i, y in enumerate(row["labels"]) if y != -100]
        assert targets[-1] - targets[0] + 1 > len(targets)  # a gap: the tool result
        positions.append(targets)
    assert sorted(rollout.completion_lengths) == sorted(len(p) for p in positions)
    logged = trainer.state.log_history[0]
    assert logged["completions/mean_length"] == pytest.approx(sum(rollout.completion_lengths) / 8)
    assert logged["tools/call_frequency"] == 1.0 and logged["tools/failure_frequency"] == 0.0
    assert logged["tools/mean_turns"] == pytest.approx(sum(rollout.turns) / 8)
    # The first step is the hand-written big batch over the policy's tokens (ratio 1: one generation per step).
    for row in rows:
        with torch.no_grad():
            row["old_logps"] = [0.0] + token_logps(start, row["input_ids"]).tolist()
    want = reference_gradient_eps(start, rows, positions)
    assert relative_error(capture.grads[0], want) <= 1e-6 and want.norm() > 0


def reference_gradient_eps(model, rows, positions):
    """:func:`reference_gradient` (token loss) at GRPOTrainer's default epsilon 0.2 on both sides."""
    model.zero_grad()
    losses = []
    for row, mine in zip(rows, positions, strict=True):
        at = torch.tensor(mine)
        logp = token_logps(model, row["input_ids"])[at - 1]
        ratio = torch.exp(logp - logp.detach())
        a = row["advantages"]
        losses.append(-torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a))
    (torch.cat(losses).sum() / sum(len(p) for p in positions)).backward()
    grad = flat_grad(model)
    model.zero_grad()
    return grad


def test_a_template_that_is_not_append_only_is_said_once(caplog):
    """A template that writes a tool result differently once a turn follows (Hermes, vLLM's): the trajectory goes on
    with its ids as sampled, and the WARNING is said once for the sampler."""
    tokenizer = tokenizer_for("hermes_vllm_tools")
    sampler = MultiTurnSampler([multiply], tokenizer)
    prompts = [[{"role": "user", "content": f"Question {i}"}] for i in range(2)]
    prompt_ids = {f"Question {i}": sampler.prompt_ids(p) for i, p in enumerate(prompts)}
    scripts = {key: ['<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>', "6"]
               for key in prompt_ids}  # fmt: skip
    engine = ScriptedEngine(tokenizer, scripts, prompt_ids)
    caplog.set_level(logging.WARNING, logger="hfacc")
    trajectories = sampler.sample(engine, prompts, list(prompt_ids.values()), SamplingSettings(200))
    said = [r for r in caplog.records if "not append-only" in r.getMessage()]
    assert len(said) == 1 and sampler.warned == {"history"}
    assert all(t.turns == 2 and t.tool_calls == 1 and not t.truncated for t in trajectories)


# ---- a minimal environment_factory (TRL's contract, one environment class) ------------------------------------------
class Guessing:
    """A number to guess: reset from the prompt's row, a tool that answers, the reward from its own state."""

    made = 0

    def __init__(self):
        Guessing.made += 1
        self.secret, self.guesses = None, []

    def reset(self, prompt, answer, **kwargs):
        self.secret, self.guesses = len(answer) % 2, []  # 0 or 1: a guess of 1 is right for about half
        return " (Use the tool.)"

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the guess
        """
        self.guesses.append(n)
        return "right" if n == self.secret else "wrong"

    def get_reward(self) -> float:
        return float(self.secret in self.guesses)


class FirstTurnGuesses(FirstTurnCalls):
    forced = call("guess", n=1)


def test_an_environment_per_completion_gives_tools_and_the_reward(tmp_path):
    from hfacc import GRPOArguments, GRPOTrainer
    from tests.grpo_setup import build_policy, build_prompts

    model, tokenizer = build_policy()
    received = []

    def brevity(prompts, completions, environments, **kwargs):
        received.append((prompts, environments))
        return [1.0 / (1 + len(c[-1]["content"])) for c in completions]

    Guessing.made = 0
    args = GRPOArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=120, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, max_tool_calling_iterations=1,
    )  # fmt: skip
    prompts = build_prompts()
    trainer = GRPOTrainer(
        model, brevity, args, train_dataset=prompts, processing_class=tokenizer, environment_factory=Guessing,
        engine=FirstTurnGuesses(model, tokenizer),
    )  # fmt: skip
    assert [s["function"]["name"] for s in trainer.tool_sampler.schemas] == ["guess"]
    trainer.train()
    assert Guessing.made == 8  # the probe and 7 more: one per completion, made once, reset for each generation
    (first_prompts, environments), _ = received
    assert len({id(e) for e in environments}) == 8 and all(e.guesses == [1] for e in environments)  # its own state
    assert all(p[-1]["content"].endswith(" (Use the tool.)") for p in first_prompts)  # reset's text, appended
    rollout = trainer.rollout
    assert all("(Use the tool.)" in tokenizer.decode(r["input_ids"]) for r in rollout.rows)
    _, environments = received[1]  # the second generation's, in the order of its completions
    assert [c[1] for c in rollout.completions] == [
        {"role": "tool", "name": "guess", "content": "right" if e.secret == 1 else "wrong"} for e in environments
    ]
    assert rollout.rewards[:, 1].tolist() == [float(e.secret == 1) for e in environments]
    assert {e.secret for e in environments} == {0, 1}  # right and wrong guesses both
    logged = trainer.state.log_history[0]
    assert trainer.rollout_meter.names == ["brevity", "Guessing"] and "rewards/Guessing/mean" in logged
    assert logged["tools/call_frequency"] == 1.0


def test_an_environment_needs_reset_and_its_reward_is_a_reward_function():
    from hfacc.generation.tools import EnvironmentPool

    class NoReset:
        def guess(self, n: int) -> str:
            """Guess.

            Args:
                n: the guess
            """
            return "no"

    with pytest.raises(ValueError, match="a NoReset without a callable reset"):
        EnvironmentPool(NoReset)
    pool = EnvironmentPool(Guessing)
    assert (
        pool.tool_names == ["guess"]
        and pool.has_reward
        and len(pool.take(3)) == 3
        and pool.take(2) == pool.instances[:2]
    )
    reward = pool.reward_function()
    for environment, answer in zip(pool.instances, ["a", "ab", "abc"], strict=True):
        environment.reset(prompt=[], answer=answer)
        environment.guess(1)
    assert reward.__name__ == "Guessing" and reward([], [], pool.instances) == [1.0, 0.0, 1.0]


def test_a_generation_for_two_steps_trains_each_on_its_own_policy_tokens(tmp_path):
    """steps_per_generation = 2 x GA on multi-turn rows: the second step trains on trajectories sampled before the
    first, with their old log-probs (taken at the policy's tokens, as the labels say), each step divided by the
    policy tokens it consumes: two SGD steps of the hand-written big batch."""
    from hfacc import GRPOArguments, GRPOTrainer
    from tests.grpo_setup import build_policy, build_prompts
    from tests.rollouts import reference_sgd_steps

    model, tokenizer = build_policy()
    start = copy.deepcopy(model)

    def brevity(prompts, completions, **kwargs):
        return [1.0 / (1 + len(c[-1]["content"])) for c in completions]

    args = GRPOArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        steps_per_generation=4, max_completion_length=100, max_steps=2, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, max_grad_norm=0.0, max_tool_calling_iterations=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, brevity, args, train_dataset=build_prompts(), processing_class=tokenizer, tools=[multiply],
        engine=FirstTurnCalls(model, tokenizer),
    )  # fmt: skip
    capture = CaptureSteps(trainer)
    trainer.add_callback(capture)
    trainer.train()
    rollout = capture.rollouts[0]
    assert capture.rollouts[1].rows == rollout.rows and sum(rollout.tool_calls) == 16  # one rollout, two steps
    rows = [dict(r) for r in rollout.rows]
    assert all(len(r["old_logps"]) == len(r["input_ids"]) for r in rows)
    want = reference_sgd_steps(start, [rows[:8], rows[8:]], "token", 0.1, eps=0.2, eps_high=0.2)
    for got, expected in zip(capture.grads, want, strict=True):
        assert relative_error(got, expected) <= 1e-6


@pytest.mark.distributed
def test_two_ranks_give_the_big_batch_of_the_policy_tokens(tmp_path):
    """tests/tools_check.py on two CPU ranks: the fixed multi-turn rows (unequal policy tokens per rank), padded and
    padding-free, token and sequence loss; and GRPOTrainer with a tool, each rank sampling its own prompts."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, free_port

    out = tmp_path / "results.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    launch += ["--main_process_port", str(free_port()), "tests/tools_check.py", str(out)]
    proc = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["world_size"] == 2 and len(results["cases"]) == 4
    rank0, rank1 = results["local_policy_tokens"]
    assert rank0 != rank1
    for name, error in results["cases"].items():
        assert error <= 1e-6, name
    online = results["online"]
    assert online["error"] <= 1e-6 and online["prompts_differ"]
    assert online["call_frequency"] == 1.0 and online["mean_turns"] == online["turns_both"] / 16
    assert online["num_completion_tokens"] == online["policy_tokens_both"]


# ---- 5. the demo's job: hfacc grpo with a tool ---------------------------------------------------------------------
def test_the_tool_task_and_a_bad_tool_name(capsys):
    """The embedded tool task: 70% of its SFT conversations call multiply (right arguments, the product as the result
    and the answer), the others answer at once; its GRPO prompts ask the same questions. ``--tools`` naming no
    importable function is one line (exit 2), before any model work."""
    from hfacc.cli import main as cli_main
    from hfacc.data.embedded_tools import generate_tool_examples, generate_tool_prompt_rows

    rows = generate_tool_examples(200, seed=3)
    calls = [r for r in rows if len(r["messages"]) == 4]
    assert 0.6 < len(calls) / len(rows) < 0.8 and all(r["tools"][0]["function"]["name"] == "multiply" for r in rows)
    for row in calls:
        question, turn, result, answer = row["messages"]
        a, b = turn["tool_calls"][0]["function"]["arguments"].values()
        assert question["content"] == f"What is {a} x {b}?" and result["content"] == answer["content"] == str(a * b)
        assert len(answer["content"]) == 6  # one layout: every product has six digits
    prompts = generate_tool_prompt_rows(4, seed=1)
    assert all(eval(p["prompt"][0]["content"][8:-1].replace("x", "*")) == int(p["answer"]) for p in prompts)
    with pytest.raises(SystemExit) as exited:
        cli_main(["grpo", "--config", "recipes/configs/tiny_grpo_tools.yaml", "--tools", "nosuch_module:f"])
    assert exited.value.code == 2
    assert "tool 'nosuch_module:f': no module 'nosuch_module' on the Python path" in capsys.readouterr().err


class SFTReplay(GenerationEngine):
    """Samples, and answers greedily, exactly the assistant turns an SFT row of the tool task trains on (its label
    spans, each ending with EOS), turn after turn: the policy the SFT taught, perfectly learned."""

    def __init__(self, turns: list[list[int]], eos: int):
        super().__init__()
        self.turns, self.eos = iter(turns), eos

    def sample(self, prompt_ids, settings, *, seed=None):
        return Samples([next(self.turns) for _ in prompt_ids], [False] * len(prompt_ids))

    def answer(self, prompt_ids, max_new_tokens):
        return [next(self.turns)[:-1] for _ in prompt_ids]  # EOS left out, as engines answer

    def sync_weights(self, model):
        pass


def test_the_demo_trains_and_is_evaluated_on_the_ids_its_sft_taught():
    """The tool task's SFT rows against the rollout GRPO trains on and the greedy evaluation reads, for a policy that
    writes exactly what the SFT taught: the same ids (the prompt with the tools line, the call, the tool's result,
    the answer; only the SFT row's newline after the last EOS is not sampled), the same targets, and the answer that
    exact match and the rewards read scores 1. Where the run warns that a trajectory is not the template's rendering,
    it is a sampled turn that does not re-tokenize to itself (e.g. a lone byte of a UTF-8 character), not these."""
    from hfacc.data.embedded_tools import QUESTION, copied_digits, generate_tool_examples
    from hfacc.data.embedded_tools import multiply as task_multiply
    from hfacc.data.formats import encode_row
    from hfacc.generation.rewards import completion_text, correctness

    tokenizer = build_default_tokenizer()
    sampler = MultiTurnSampler([task_multiply], tokenizer, max_tool_calling_iterations=1, tool_timeout=5.0)
    rows = generate_tool_examples(6, seed=11, direct_fraction=0.5)
    assert {len(r["messages"]) for r in rows} == {2, 4}  # both kinds: answered at once, and with the tool
    for row in rows:
        ids, labels, _, _ = encode_row(tokenizer, row, 0, "messages")
        pairs = zip(ids, labels, strict=True)
        spans = [[i for i, _ in g] for k, g in itertools.groupby(pairs, key=lambda p: p[1] != -100) if k]
        prompt, last = row["messages"][:1], row["messages"][-1]["content"]
        product = task_multiply(*QUESTION.search(prompt[0]["content"]).groups())
        prompt_ids = sampler.prompt_ids(prompt)
        (trained,) = sampler.sample(SFTReplay(spans, tokenizer.eos_token_id), [prompt], [prompt_ids],
                                    SamplingSettings(128))  # fmt: skip
        (greedy,) = sampler.answer(SFTReplay(spans, tokenizer.eos_token_id), [prompt], 128)
        (rollout_row,) = build_rollout_rows([prompt_ids], [trained.ids], [1.0], [trained.mask])
        assert ids[-1] == tokenizer("\n")["input_ids"][0] and rollout_row["input_ids"] == ids[:-1]
        assert rollout_row["labels"] == labels[:-1]
        assert prompt_ids + greedy.ids == ids[:-1] and greedy.messages == trained.messages
        assert trained.tool_calls == (len(row["messages"]) == 4) and trained.tool_failures == 0
        assert completion_text(greedy.messages) == last  # "About 310000" where it answered at once: wrong
        assert correctness([prompt], [trained.messages], answer=[product]) == [float(len(row["messages"]) == 4)]
        assert copied_digits([prompt], [trained.messages]) == [float(len(row["messages"]) == 4)]


def test_the_shipped_demo_config_gives_its_short_sft_the_direct_answers(monkeypatch, tmp_path):
    """recipes/configs/tiny_grpo_tools.yaml parses; its rewards resolve; its short SFT trains on conversations of
    which ``sft_direct_fraction`` answer at once (an estimate, wrong), the rest call the tool, 16 rows a micro-batch."""
    import hfacc.jobs.sft
    from hfacc.data.sources import generate_embedded_rows
    from hfacc.generation.rewards import get_reward_funcs
    from hfacc.jobs.grpo import GRPO_ARGUMENTS, run_short_sft
    from hfacc.runtime.config import ConfigError, parse_args

    job, model_args, args = parse_args(GRPO_ARGUMENTS, ["--config", "recipes/configs/tiny_grpo_tools.yaml"])
    assert job.tool_task and 0.5 < job.sft_direct_fraction < 1  # the SFT model answers at once, greedily
    assert len(get_reward_funcs(job.reward_funcs)) == len(args.reward_weights)
    seen = {}
    monkeypatch.setattr(hfacc.jobs.sft, "main", lambda *parsed: seen.setdefault("parsed", parsed))
    run_short_sft(tmp_path, 2, args, 64, model_args, job.embedded_dataset, job.sft_direct_fraction)
    _, _, data, sft_args = seen["parsed"]
    assert data.embedded_dataset == "tools" and data.tool_direct_fraction == job.sft_direct_fraction
    # the SFT recipe's 16 rows a step in one micro-batch (the same update as its 8 x 2)
    assert (sft_args.per_device_train_batch_size, sft_args.gradient_accumulation_steps) == (16, 1)
    rows = generate_embedded_rows("tools", 400, 0, data.tool_direct_fraction)
    direct = [r["messages"][-1]["content"] for r in rows if len(r["messages"]) == 2]
    assert abs(len(direct) / len(rows) - job.sft_direct_fraction) < 0.08 and all(
        d.startswith("About ") for d in direct
    )
    with pytest.raises(ConfigError, match="sft_direct_fraction=1.5"):
        parse_args(
            GRPO_ARGUMENTS, ["--config", "recipes/configs/tiny_grpo_tools.yaml", "--sft_direct_fraction", "1.5"]
        )


@pytest.mark.slow
def test_hfacc_grpo_with_a_tool_reports_the_tool_rates(tmp_path, capsys):
    """recipes/configs/tiny_grpo_tools.yaml shortened, the tool named on the command line (``--tools``): a short SFT
    on the tool task's conversations, GRPO with the tool, and the summary's tool call and failure rates, greedy
    held-out and sampled in training, also in metrics.json."""
    from hfacc.cli import main as cli_main

    out = tmp_path / "grpo"
    argv = ["grpo", "--config", "recipes/configs/tiny_grpo_tools.yaml", "--tools", "tests.test_tools:multiply"]
    argv += ["--sft_output_dir", str(tmp_path / "none"), "--sft_max_steps", "2", "--sft_num_examples", "64"]
    argv += ["--max_steps", "1", "--num_train_prompts", "8", "--num_eval_prompts", "4", "--logging_steps", "1"]
    argv += ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1", "--num_generations", "4"]
    argv += ["--disable_tqdm", "true", "--output_dir", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "tools multiply" in printed and "held-out exact match" in printed and "(greedy with tools)" in printed
    assert "held-out tool calls" in printed and "train tool calls" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    for when in ("before", "after"):
        assert {"tool_call_frequency", "tool_failure_frequency", "exact_match"} <= set(metrics[when])
    assert set(metrics["train_tools_last"]) == {"call_frequency", "failure_frequency", "mean_turns"}


def test_hfacc_verify_checks_multi_turn_rows():
    """``hfacc verify --objective grpo --multi_turn true``: the model's own rollout with a tool result of uneven
    length between two turns of each completion; every step equals its big batch over the policy's tokens, and the
    big batch whose denominators also count the tool tokens does not."""
    from hfacc.verify.equivalence import verify_policy_gradient
    from tests.grpo_setup import build_policy, build_prompts

    policy, tokenizer = build_policy()
    prompts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in build_prompts()["prompt"]
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    report = verify_policy_gradient(
        policy, tokenizer, ids, micro_batch_size=2, gradient_accumulation_steps=2, loss_types=["token", "sequence"],
        multi_turn=True,
    )  # fmt: skip
    assert report.passed and report.rollout["tool_tokens"] > report.rollout["completion_tokens"] / 4
    assert all(e <= 1e-6 for by in report.errors.values() for errs in by.values() for e in errs)
    assert min(report.tool_counting_errors.values()) > 1e-2, report.tool_counting_errors  # 1e4 x the tolerance
    assert "denominators that also count the tool tokens" in report.format()
