"""GRPO on a colocated vLLM engine (one engine for the whole module, in this process): every step samples from the
weights it trains (the logged sampler/policy log-prob difference stays <= 1e-3 in fp32), a skipped weight copy shows
in that metric, and each step is exact over the rollout it sampled, importance weights included.

Runs in the vLLM environment (README "Generation on vLLM", .ci/run); elsewhere it is skipped. The two-process run and
``hfacc grpo --use_vllm true`` are in tests/test_vllm_processes.py.
"""

import copy
import hashlib
import random
import re

import numpy as np
import pytest
import torch

from hfacc.generation.engine import GenerationEngine, Samples, SamplingSettings
from hfacc.generation.evaluation import generate_answers
from hfacc.generation.vllm_engine import is_vllm_available
from tests.grpo_setup import build_policy, build_prompts, rollout_rows, run_grpo
from tests.helpers import relative_error
from tests.rollouts import reference_gradient, token_logps

pytestmark = pytest.mark.skipif(
    not is_vllm_available(),
    reason="vLLM is not installed here: the vLLM tests run in the vLLM environment (README 'Generation on vLLM')",
)
STEPS, TEMPERATURE = 4, 0.8
# vLLM's CPU attention takes heads of >= 32 dimensions: hidden 64 in 2 heads.
POLICY = {"hidden_size": 64, "num_heads": 2}


def digest(prompts, completions, **kwargs):
    """A reward nothing can learn in 4 steps (a hash of the text; 0 for an empty answer, which the policy would
    otherwise learn at once): every step's groups keep their spread, so every step has a gradient to compare."""
    texts = [c[0]["content"] for c in completions]
    return [int(hashlib.sha256(t.encode()).hexdigest()[:8], 16) / 2**32 if t else 0.0 for t in texts]


SETTINGS = dict(
    use_vllm=True, temperature=TEMPERATURE, learning_rate=1e-2, lr_scheduler_type="constant", reward_funcs=(digest,)
)


@pytest.fixture(scope="module")
def in_step(tmp_path_factory):
    """A GRPO run of 4 steps on vLLM, at a learning rate that moves the weights: (trainer, capture, start)."""
    return run_grpo(tmp_path_factory.mktemp("in_step"), steps=STEPS, policy=build_policy(0, **POLICY), **SETTINGS)


@pytest.fixture(scope="module")
def engine(in_step):
    return in_step[0].engine


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def step_gradient_error(capture, step, rows, start):
    """The step's gradient against the hand-written big batch of its rollout, at the weights the step started from."""
    model = copy.deepcopy(start)
    model.load_state_dict(capture.weights[step])
    want, _ = reference_gradient(model, rows, "token", eps=0.2, eps_high=0.2, temperature=TEMPERATURE)
    return relative_error(capture.grads[step], want)


def test_every_step_samples_from_the_weights_it_trains(in_step, engine):
    trainer, capture, start = in_step
    assert engine.name == "vllm" and engine.syncs == STEPS - 1  # built from the start; a copy after each step
    differences = logged(trainer, "sampling/sampling_logp_difference/max")
    assert len(differences) == STEPS and max(differences) <= 1e-3, differences
    assert all(0 <= m <= 1e-3 for m in logged(trainer, "sampling/sampling_logp_difference/mean"))
    for key in ("min", "mean", "max"):  # in step: every ratio is 1 (sequence_mask, TRL's default)
        assert all(abs(r - 1) <= 1e-2 for r in logged(trainer, f"sampling/importance_sampling_ratio/{key}"))
    moved = max(
        (a - b).abs().max().item() for a, b in zip(trainer.model.parameters(), start.parameters(), strict=True)
    )
    assert moved > 1e-2, moved  # the learning rate moves the weights: the copies carry real changes


def test_each_step_is_exact_over_the_rollout_it_sampled(in_step):
    """Every step (after 0 to 3 weight copies) against a big batch of its rollout, importance weights included."""
    _, capture, start = in_step
    for step in range(STEPS):
        rows = rollout_rows(capture.rollouts[step])
        assert all(len(r["importance_weights"]) == len(r["input_ids"]) for r in rows)
        assert "old_logps" not in rows[0]  # one generation per step: the ratio is 1, the sampler enters by weights
        assert any(r["advantages"] != 0 for r in rows)
        assert step_gradient_error(capture, step, rows, start) <= 1e-6, step


def test_a_skipped_weight_copy_shows_in_the_metric(tmp_path, in_step, engine):
    """The same run with the copy after step 1 skipped: step 2 samples from step 1's weights, and its logged
    difference jumps; the copies before and after keep it <= 1e-3. The stale step is still exact over its rollout,
    whose importance weights now differ from 1."""
    _, _, start = in_step
    sync, calls = engine.sync_weights, []

    def skip_the_second(model):
        calls.append(len(calls))
        if len(calls) != 2:
            sync(model)

    engine.sync_weights = skip_the_second
    try:
        policy = (copy.deepcopy(start), build_policy(0, **POLICY)[1])
        trainer, capture, _ = run_grpo(tmp_path, steps=STEPS, policy=policy, engine=engine, **SETTINGS)
    finally:
        engine.sync_weights = sync
    assert len(calls) == STEPS  # the first one: the new policy into the engine
    differences = logged(trainer, "sampling/sampling_logp_difference/max")
    assert differences[1] > 100 * max(differences[0], differences[2], differences[3]), differences
    assert differences[1] > 1e-2 and max(differences[0], differences[2], differences[3]) <= 1e-3
    rows = rollout_rows(capture.rollouts[1])
    weights = [w for r in rows for w, y in zip(r["importance_weights"], r["labels"], strict=True) if y != -100]
    assert any(abs(w - 1) > 1e-2 for w in weights)
    assert step_gradient_error(capture, 1, rows, start) <= 1e-6


def test_the_trainers_randomness_is_untouched(in_step, engine):
    """vLLM reseeds and advances the global generators; the engine restores them around every call."""
    trainer = in_step[0]
    policy, tokenizer = trainer.model, trainer.processing_class
    engine.sync_weights(policy)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
    ids = [tokenizer("Count down from 5 to 0.")["input_ids"]] * 4
    samples = engine.sample(ids, SamplingSettings(8), seed=11)
    assert samples.completion_ids == engine.sample(ids, SamplingSettings(8), seed=11).completion_ids  # seeded
    engine.sync_weights(policy)
    after = random.getstate(), np.random.get_state()[1], torch.random.get_rng_state()
    assert before[0] == after[0] and (before[1] == after[1]).all() and torch.equal(before[2], after[2])


def test_sampling_settings_map_to_vllm(in_step, engine):
    """Temperature and max tokens as transformers' generate takes them; the log-probs are those of the distribution
    sampled from: with top-k on, the trained policy's full softmax differs, by design (the ratio corrects it)."""
    trainer = in_step[0]
    policy, tokenizer = trainer.model, trainer.processing_class
    engine.sync_weights(policy)
    ids = [tokenizer("Repeat 'tiger' 3 times.")["input_ids"]] * 8
    for settings, in_step_bound in (
        (SamplingSettings(10, temperature=1.3), 1e-3),
        (SamplingSettings(10, top_k=5), None),
    ):
        samples = engine.sample(ids, settings, seed=3)
        assert all(len(c) <= 10 for c in samples.completion_ids)
        worst = 0.0
        for c, logps, done in zip(samples.completion_ids, samples.logps, samples.truncated, strict=True):
            assert done == (len(c) == 10 and tokenizer.eos_token_id not in c)
            with torch.no_grad():
                ours = token_logps(policy, ids[0] + c, settings.temperature)[len(ids[0]) - 1 :]
            worst = max(worst, (ours - torch.tensor(logps)).abs().max().item())
        assert worst <= 1e-3 if in_step_bound else worst > 1e-2, (settings, worst)


def test_a_lora_policy_is_merged_for_the_copy_and_unmerged_after(in_step, engine):
    from peft import LoraConfig, get_peft_model

    base, tokenizer = build_policy(1, **POLICY)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    policy = get_peft_model(base, config)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    engine.sync_weights(policy)
    after = policy.state_dict()
    assert all((before[k] - after[k]).abs().max() <= 1e-6 for k in before)  # merged, then unmerged again
    ids = [tokenizer("Spell 'cloud' letter by letter.")["input_ids"]] * 4
    samples = engine.sample(ids, SamplingSettings(8), seed=5)
    worst = 0.0
    for c, logps in zip(samples.completion_ids, samples.logps, strict=True):
        with torch.no_grad():
            ours = token_logps(policy, ids[0] + c)[len(ids[0]) - 1 :]
        worst = max(worst, (ours - torch.tensor(logps)).abs().max().item())
    assert worst <= 1e-3, worst  # the adapters are in the engine's weights
    engine.sync_weights(in_step[0].model)


def test_a_wrong_weight_never_reaches_the_engine(in_step, engine):
    """Names and shapes are checked against the architecture first (a reload with a wrong one leaves vLLM unusable)."""
    from hfacc.generation.vllm_engine import check_engine_weights, get_engine_weights

    policy = in_step[0].model
    weights = get_engine_weights(policy)
    renamed = [("model.layers.0.mlp.gate.weight", t) if i == 3 else (n, t) for i, (n, t) in enumerate(weights)]
    with pytest.raises(ValueError, match="'model.layers.0.mlp.gate.weight' is not a weight of its architecture"):
        check_engine_weights(renamed, engine.expected)
    cut = [(n, t[:-1]) if i == 0 else (n, t) for i, (n, t) in enumerate(weights)]
    with pytest.raises(ValueError, match="has shape"):
        check_engine_weights(cut, engine.expected)
    with pytest.raises(ValueError, match="lack"):
        check_engine_weights(weights[1:], engine.expected)


def test_sleep_mode_copies_the_weights_in_again(in_step, engine):
    """With sleep mode (GPUs), the engine sleeps after each generation and gets the policy's weights again before
    the next. On a CPU vLLM's sleep does nothing, so this checks the order of the calls and what is sampled after."""
    trainer = in_step[0]
    policy, tokenizer = trainer.model, trainer.processing_class
    engine.sync_weights(policy)
    ids = [tokenizer("What is 3 + 4?")["input_ids"]] * 4
    awake = engine.sample(ids, SamplingSettings(8), seed=9)
    engine.sleeps = True
    try:
        first = engine.sample(ids, SamplingSettings(8), seed=9)
        assert engine.asleep
        second = engine.sample(ids, SamplingSettings(8), seed=9)
    finally:
        engine.sleeps = False
    assert first.completion_ids == awake.completion_ids == second.completion_ids
    assert engine.asleep and engine.cache_asleep
    assert engine.sample(ids, SamplingSettings(8), seed=9).completion_ids == awake.completion_ids  # woken fully
    assert not engine.asleep and not engine.cache_asleep


def test_held_out_answers_are_the_same_greedy_answers(in_step, engine):
    trainer = in_step[0]
    policy, tokenizer = trainer.model, trainer.processing_class
    engine.sync_weights(policy)
    conversations = [p for p in build_prompts(6)["prompt"]]
    ours = generate_answers(policy, tokenizer, conversations, max_new_tokens=10, engine=engine)
    assert ours == generate_answers(policy, tokenizer, conversations, max_new_tokens=10)


# ---- on-policy distillation: the same engine ----------------------------------------------------------------------
def test_on_policy_distillation_samples_on_vllm(in_step, engine, tmp_path):
    """DistillationTrainer(use_vllm=True): the student's completions come from the engine, which gets the student's
    weights before each generation after a step (its log-probs are the student's at that step), and each step is the
    big batch of the completions it trained."""
    from hfacc import DistillationArguments, DistillationTrainer
    from tests.distillation_reference import big_batch
    from tests.helpers import CaptureGradients, train_args

    student, tokenizer = build_policy(0, **POLICY)
    teacher = build_policy(1, **POLICY)[0]
    args = train_args(
        tmp_path, 2, 2, args_class=DistillationArguments, use_vllm=True, lmbda=1.0, beta=0.5, max_steps=3,
        max_completion_length=12, learning_rate=1e-2, lr_scheduler_type="constant", optim="sgd", seed=3,
    )  # fmt: skip
    capture = CaptureGradients(student)
    trainer = DistillationTrainer(
        student, teacher, args, train_dataset=build_prompts(12), processing_class=tokenizer, callbacks=[capture]
    )
    trainer._engine, engine.version = engine, None  # the module's engine: this student goes in at the first generation
    steps, make, sample = [], trainer.generate_micro_batches, engine.sample

    def record(indices, generation=0):
        steps.append({"weights": copy.deepcopy(trainer.model.state_dict()), "samples": []})
        batches = make(indices, generation)
        steps[-1]["rows"] = list(trainer.last_rows)
        return batches

    def sampled(prompt_ids, settings, *, seed=None):
        out = sample(prompt_ids, settings, seed=seed)
        steps[-1]["samples"] += list(zip(map(list, prompt_ids), out.completion_ids, out.logps, strict=True))
        return out

    trainer.generate_micro_batches, engine.sample, syncs = record, sampled, engine.syncs
    try:
        trainer.train()
    finally:
        engine.sample = sample
    assert len(steps) == len(capture.grads) == 3 and engine.syncs - syncs == 3  # the first, then after each step
    model = copy.deepcopy(student)
    for step, record_ in enumerate(steps):
        model.load_state_dict(record_["weights"])
        assert len(record_["samples"]) == 4  # every prompt of the step sampled by the engine (lmbda 1)
        for prompt, completion, logps in record_["samples"]:
            mine = token_logps(model, prompt + completion)[len(prompt) - 1 :]
            assert (mine - torch.tensor(logps)).abs().max() <= 1e-3, step
        want, _, _ = big_batch(
            copy.deepcopy(model), teacher, record_["rows"], beta=0.5, temperature=1.0, ce_weight=0.0,
            vocab=len(tokenizer),
        )  # fmt: skip
        assert relative_error(capture.grads[step], want) <= 1e-6, step
    first, last = steps[0]["weights"], steps[-1]["weights"]
    assert max((first[k] - last[k]).abs().max().item() for k in first) > 1e-3  # the copies carry real changes


# ---- multi-turn rollouts with tools and environments: the same engine ---------------------------------------------
class FirstTurnCallsOnVLLM(GenerationEngine):
    """vLLM's samples, except that a trajectory's first turn is ``forced`` (a call: a tiny random policy would rarely
    write one), with the policy's own log-probs of it at the sampling temperature (in step, the engine's weights are
    the policy's, so these are what vLLM would give). Every later
    turn is vLLM's, with vLLM's log-probs; the tool results between are context."""

    name, returns_logps = "vllm", True

    def __init__(self, engine, model, tokenizer, forced: str):
        super().__init__()
        self.engine, self.model, self.tokenizer = engine, model, tokenizer
        self.forced = tokenizer(forced, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def sample(self, prompt_ids, settings, *, seed=None):
        out = self.engine.sample(prompt_ids, settings, seed=seed)
        ids, logps = list(out.completion_ids), list(out.logps)
        for i, prompt in enumerate(prompt_ids):
            if "<|im_start|>tool" not in self.tokenizer.decode(prompt):  # the first turn: no tool result yet
                with torch.no_grad():
                    mine = token_logps(self.model, list(prompt) + self.forced, settings.temperature)[len(prompt) - 1 :]
                ids[i], logps[i] = list(self.forced), mine.tolist()
        return Samples(ids, [c[-1] != self.tokenizer.eos_token_id for c in ids], logps)

    def answer(self, prompt_ids, max_new_tokens):
        return self.engine.answer(prompt_ids, max_new_tokens)

    def sync_weights(self, model):
        self.engine.sync_weights(model)
        self.model = model


def last_turn_digest(prompts, completions, **kwargs):
    """:func:`digest` of the last turn (the first is the forced call)."""
    return digest(prompts, [[c[-1]] for c in completions])


def run_multi_turn(engine, tmp_path, forced, **kwargs):
    """Two GRPO steps on the module's engine with multi-turn rollouts: (trainer, capture, start)."""
    from hfacc import GRPOArguments, GRPOTrainer
    from tests.grpo_setup import CaptureSteps

    model, tokenizer = build_policy(0, **POLICY)
    start = copy.deepcopy(model)
    engine.version = None  # this policy's weights go in at the first generation
    args = GRPOArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=100, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, disable_tqdm=True, seed=0, max_grad_norm=0.0, max_tool_calling_iterations=1, use_vllm=True,
        temperature=TEMPERATURE, lr_scheduler_type="constant",
    )  # fmt: skip
    wrapper = FirstTurnCallsOnVLLM(engine, model, tokenizer, forced)
    trainer = GRPOTrainer(
        model, kwargs.pop("reward_funcs", last_turn_digest), args, train_dataset=build_prompts(),
        processing_class=tokenizer, engine=wrapper, **kwargs,
    )  # fmt: skip
    capture = CaptureSteps(trainer)
    trainer.add_callback(capture)
    trainer.train()
    return trainer, capture, start


def check_multi_turn_steps(trainer, capture, start, tool_result):
    """Each step: the rows' targets are the policy's tokens only (the tool result -100, its sampler log-prob 0),
    the sampler/policy difference over those tokens <= 1e-3 (with the tool tokens' 0.0 in it, it would be about 5),
    and the step equals the hand-written big batch of its rollout, importance weights included."""
    assert trainer.state.global_step == 2 and len(capture.grads) == 2
    for step in range(2):
        rollout = capture.rollouts[step]
        assert sum(rollout.tool_calls) == 8 and sum(rollout.tool_failures) == 0 and min(rollout.turns) == 2
        rows = rollout_rows(rollout)
        for row in rows:
            targets = [i for i, y in enumerate(row["labels"]) if y != -100]
            gap = [i for i in range(targets[0], targets[-1]) if row["labels"][i] == -100]
            assert gap and all(row["sampler_logps"][i] == 0.0 for i in gap)  # the tool tokens: context
            assert all(len(row[k]) == len(row["input_ids"]) for k in ("importance_weights", "sampler_logps"))
        assert all(any(m["role"] == "tool" and m["content"] in tool_result for m in c) for c in rollout.completions)
        assert step_gradient_error(capture, step, rows, start) <= 1e-6, step
    assert max(logged(trainer, "sampling/sampling_logp_difference/max")) <= 1e-3
    assert logged(trainer, "tools/call_frequency") == [1.0, 1.0]


def test_grpo_with_a_python_tool_trains_on_vllm(engine, tmp_path):
    from tests.test_tools import call, multiply

    trainer, capture, start = run_multi_turn(engine, tmp_path, call("multiply", a=6, b=7), tools=[multiply])
    check_multi_turn_steps(trainer, capture, start, ["42"])


def test_grpo_with_an_environment_trains_on_vllm(engine, tmp_path):
    from tests.test_tools import Guessing, call

    trainer, capture, start = run_multi_turn(engine, tmp_path, call("guess", n=1), environment_factory=Guessing)
    check_multi_turn_steps(trainer, capture, start, ["right", "wrong"])
    assert "rewards/Guessing/mean" in trainer.state.log_history[0]


# ---- the jobs' held-out answers: the same switch ------------------------------------------------------------------
# Last in this module: after a job has built (and dropped) an engine of its own in this process, the module's engine
# failed to sample (vLLM's pipeline-parallel group was gone). A run has one engine per process.
JOB = ["--embedded_hidden_size", "128", "--embedded_num_layers", "1", "--num_exact_match_examples", "4"]
JOB += ["--max_new_tokens", "6", "--logging_steps", "1", "--disable_tqdm", "true", "--use_vllm", "true"]


@pytest.fixture(scope="module")
def sft_on_vllm(tmp_path_factory):
    """``hfacc sft --use_vllm true``, shortened: its held-out prompts answered by a vLLM engine (this process's
    second: one per run of a single process is no limit)."""
    from hfacc.cli import main as cli_main

    out = tmp_path_factory.mktemp("sft") / "out"
    argv = ["sft", *JOB, "--max_steps", "3", "--num_embedded_examples", "160", "--eval_strategy", "no"]
    assert cli_main([*argv, "--output_dir", str(out)]) == 0
    return out


@pytest.mark.slow
def test_hfacc_sft_answers_the_held_out_prompts_on_vllm(sft_on_vllm, capsys):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = json.loads((sft_on_vllm / "metrics.json").read_text())
    assert len(metrics["samples"]) == 4 and 0 <= metrics["exact_match"] <= 1
    model = AutoModelForCausalLM.from_pretrained(sft_on_vllm)
    tokenizer = AutoTokenizer.from_pretrained(sft_on_vllm)
    prompts = [[{"role": "user", "content": s["prompt"]}] for s in metrics["samples"]]
    # vLLM's greedy answers are transformers' (the embedded data has no system prompt on these rows).
    assert [s["answer"] for s in metrics["samples"]] == generate_answers(model, tokenizer, prompts, max_new_tokens=6)


@pytest.mark.slow
def test_hfacc_dpo_answers_the_held_out_prompts_on_vllm(sft_on_vllm, tmp_path, capsys):
    from hfacc.cli import main as cli_main

    argv = ["dpo", *JOB, "--sft_model_dir", str(sft_on_vllm), "--num_embedded_prompts", "40", "--max_steps", "2"]
    argv += ["--per_device_train_batch_size", "4", "--eval_steps", "2", "--output_dir", str(tmp_path / "dpo")]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    for when in ("before", "after"):
        assert re.search(rf"exact match {when} training: answering [1-4] held-out prompts greedily \(vLLM\)", out), out
