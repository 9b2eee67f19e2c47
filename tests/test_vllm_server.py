"""vllm_mode="server" against a real vLLM server on 127.0.0.1, started once for the module by the documented command
(``hfacc vllm-serve``) and stopped at the end: GRPO sync and async and on-policy distillation train on it, the weights
sent through vLLM's weight-transfer routes (hfacc's loopback backend on a CPU) are the policy's (the server's
log-probs match the policy's), a skipped update is caught, and the faults end in their named lines: another model,
a port in use, the server killed mid-run.

Runs in the vLLM environment (docs/vllm.md's ci:vllm-test block); elsewhere it is skipped. The main suite's
tests/test_server_engine.py runs the same engine against an in-process stand-in.
"""

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hfacc.generation.engine import SamplingSettings
from hfacc.generation.server_engine import ServerEngine, ServerError
from hfacc.generation.vllm_engine import is_vllm_available, write_engine_directory
from tests.grpo_setup import build_policy, build_prompts, rollout_rows, run_grpo
from tests.helpers import relative_error
from tests.rollouts import reference_gradient
from tests.test_vllm import digest  # a reward with spread at every step: every step has a gradient

pytestmark = pytest.mark.skipif(
    not is_vllm_available(),
    reason="vLLM is not installed here: the vLLM tests run in the vLLM environment (docs/vllm.md#install)",
)
POLICY = {"hidden_size": 64, "num_heads": 2}  # vLLM's CPU attention: heads of >= 32 dimensions
START_TIMEOUT = 600  # seconds for the server to come up on a loaded 2-core machine (about a minute when idle)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module: ``hfacc vllm-serve`` on the policy's directory (config and tokenizer, no weights:
    the trainer's first generation sends them). Yields ``(url, port, process)``; stopped at the end."""
    model, tokenizer = build_policy(0, **POLICY)
    directory = write_engine_directory(model, tokenizer)
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "hfacc.cli", "vllm-serve", "--model", directory, "--port", str(port),
             "--max_num_seqs", "32"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, port, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def settings_for(server, **more):
    url, _, _ = server
    return dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=START_TIMEOUT, **more)


def test_grpo_trains_on_the_server_and_each_step_is_exact(server, tmp_path):
    model, tokenizer = build_policy(0, **POLICY)
    trainer, capture, start = run_grpo(
        tmp_path,
        steps=2,
        policy=(model, tokenizer),
        temperature=0.8,
        learning_rate=1e-3,
        reward_funcs=(digest,),
        **settings_for(server),
    )
    assert trainer.engine.name == "vllm-server" and trainer.engine.version == 1
    for step in range(2):
        policy = copy.deepcopy(start)
        policy.load_state_dict(capture.weights[step])
        rows = rollout_rows(capture.rollouts[step])
        want, _ = reference_gradient(policy, rows, "token", eps=0.2, eps_high=0.2, temperature=0.8)
        assert relative_error(capture.grads[step], want) <= 1e-6
    # The server's log-probs are the policy's own: the weights it holds are the ones sent (not its dummy ones).
    logged = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == 2 and max(logged) < 1e-3, logged


def test_async_grpo_trains_on_samples_one_step_stale_with_importance_weights(server, tmp_path):
    model, tokenizer = build_policy(0, **POLICY)
    trainer, capture, _ = run_grpo(
        tmp_path, steps=3, policy=(model, tokenizer), learning_rate=1e-2, async_generation=True, max_staleness=4,
        reward_funcs=(digest,),
        **settings_for(server),
    )  # fmt: skip
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert [h["sampling/staleness/max"] for h in logs] == [0.0, 1.0, 1.0]
    assert all(h["sampling/dropped_samples"] == 0 for h in logs)
    # one step stale: the sampler is the policy one step back, so the mismatch is real and corrected
    assert logs[1]["sampling/sampling_logp_difference/max"] > 1e-3
    assert all("importance_weights" in r for r in rollout_rows(capture.rollouts[2]))


def test_on_policy_distillation_trains_on_the_server(server, tmp_path):
    from hfacc import DistillationArguments, DistillationTrainer

    student, tokenizer = build_policy(0, **POLICY)
    teacher = build_policy(1, **POLICY)[0]
    args = DistillationArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, lmbda=1.0,
        max_completion_length=6, max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, **settings_for(server),
    )  # fmt: skip
    prompts = build_prompts(16).remove_columns(["answer", "task"])
    trainer = DistillationTrainer(student, teacher, args, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    assert trainer.engine.name == "vllm-server" and trainer.engine.version == 1
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2


def test_a_served_teacher_gives_the_teacher_s_top_k_and_distillation_trains_on_it(server, tmp_path):
    """The teacher on the server (use_teacher_server): the module's server serves one model, so the teacher is a
    policy of its shape whose weights are sent first; its prompt_logprobs are the teacher's own top-K."""
    from hfacc import DistillationArguments, DistillationTrainer
    from hfacc.generation.server_engine import ServedTeacher

    url, _, _ = server
    teacher, tokenizer = build_policy(2, **POLICY)
    ServerEngine(teacher, tokenizer, base_url=url, timeout=START_TIMEOUT).close()  # the server holds the teacher
    served = ServedTeacher(url, tokenizer, top_k=5, timeout=START_TIMEOUT, vocab_size=len(tokenizer))
    ids = tokenizer("Question: what is 12 + 30? Answer: 42.", add_special_tokens=False)["input_ids"]
    got_ids, got_logps = served.request_rows(ids)
    with torch.no_grad():
        local = teacher(input_ids=torch.tensor([ids])).logits[0, :-1, : len(tokenizer)].float().log_softmax(-1)
    for t in range(1, len(ids)):  # row t: token t given the tokens before it (the causal shift)
        want = local[t - 1]
        assert torch.allclose(torch.tensor(got_logps[t]), want[got_ids[t]], atol=1e-4), t
        assert min(got_logps[t]) >= float(want.topk(5).values[-1]) - 1e-4, t  # they are the top 5
    served.close()
    student = build_policy(0, **POLICY)[0]
    args = DistillationArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, lmbda=1.0,
        max_completion_length=6, max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, use_teacher_server=True, teacher_model_server_url=url, loss_top_k=5,
        vllm_server_timeout=START_TIMEOUT,
    )  # fmt: skip
    prompts = build_prompts(16).remove_columns(["answer", "task"])
    trainer = DistillationTrainer(student, None, args, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(len(r["target_token_ids"][1]) == 5 for r in trainer.last_rows)


def test_a_skipped_update_and_another_model_are_named(server):
    model, tokenizer = build_policy(0, **POLICY)
    url, _, _ = server
    engine = ServerEngine(model, tokenizer, base_url=url, timeout=START_TIMEOUT)
    engine.update(model, version=100)
    engine.sample([[5, 6, 7]], SamplingSettings(max_completion_length=4), seed=0)
    engine.sync_weights = lambda model, version=None: None  # an update that never reaches the server
    engine.update(model, version=101)
    with pytest.raises(ServerError, match=r"holds weight version '100', the policy is at step 101"):
        engine.sample([[5, 6, 7]], SamplingSettings(max_completion_length=4), seed=0)
    other, _ = build_policy(0, hidden_size=128, num_heads=4)
    with pytest.raises(ServerError, match=r"serves another model than the trainer's policy \(hidden_size 64 on the "):
        ServerEngine(other, tokenizer, base_url=url, timeout=30)


def test_a_port_in_use_is_one_line(server, capsys):
    from hfacc.cli import main

    _, port, _ = server
    with pytest.raises(SystemExit) as done:
        main(["vllm-serve", "--model", "some/dir", "--port", str(port)])
    assert done.value.code == 2 and f"127.0.0.1:{port} is in use" in capsys.readouterr().err


def test_the_server_killed_mid_run_ends_in_a_named_line(server):
    """Last: it stops the module's server."""
    model, tokenizer = build_policy(0, **POLICY)
    url, _, process = server
    engine = ServerEngine(model, tokenizer, base_url=url, timeout=START_TIMEOUT)
    engine.update(model, version=200)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"stopped answering .* resume the run from its last checkpoint"):
        engine.sample([[5, 6, 7]], SamplingSettings(max_completion_length=4), seed=0)
    assert time.monotonic() - start < 30
    assert torch.tensor(1)  # the trainer process is alive and well
