"""vllm_mode="server" against an in-process stand-in for vLLM's server (tests/fake_vllm_server.py; the real server's
tests are tests/test_vllm_server.py, in the vLLM environment): GRPO and on-policy distillation train on it, the server
holds the policy's weights before each generation (a skipped update is caught by the weight version), each step is
exact over what it sampled, and every fault ends in its one named line within its bound.
"""

import copy
import time

import pytest
import torch

from hfacc import GRPOArguments
from hfacc.generation.engine_weights import decode_weights, encode_weights
from hfacc.generation.server_engine import ServerEngine, ServerError
from hfacc.generation.vllm_engine import get_server_url
from tests.fake_vllm_server import FakeVLLMServer
from tests.grpo_setup import build_policy, rollout_rows, run_grpo
from tests.helpers import relative_error
from tests.rollouts import reference_gradient

pytestmark = pytest.mark.xdist_group("server_engine")


def server_settings(server, **more):
    return dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=60, **more)


@pytest.fixture(scope="module")
def policy():
    return build_policy(0)


@pytest.fixture(scope="module")
def grpo_run(policy, tmp_path_factory):
    """2 GRPO steps sampled on the stand-in server: (trainer, capture, start, server)."""
    model, tokenizer = copy.deepcopy(policy[0]), policy[1]
    with FakeVLLMServer(model, tokenizer) as server:
        trainer, capture, start = run_grpo(
            tmp_path_factory.mktemp("grpo"),
            steps=2,
            policy=(model, tokenizer),
            learning_rate=1e-3,
            **server_settings(server),
        )
    return trainer, capture, start, server


def test_the_weights_travel_as_they_are():
    weights = [("a.weight", torch.randn(3, 5)), ("b", torch.arange(4, dtype=torch.int64)), ("c", torch.zeros(0))]
    chunks = encode_weights(weights, chunk_bytes=40)
    assert len(chunks) >= 2  # split by size, a tensor never split
    back = [pair for chunk in chunks for pair in decode_weights(chunk)]
    assert [n for n, _ in back] == [n for n, _ in weights]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(weights, back, strict=True))


def test_grpo_trains_on_the_server_with_the_policy_s_weights_and_each_step_is_exact(grpo_run):
    trainer, capture, start, server = grpo_run
    assert trainer.engine.name == "vllm-server" and server.updates == 2  # the start's, then step 1's
    assert server.version == "1" and trainer.engine.version == 1
    # The server sampled from the weights each step started from: its copy now is step 1's start.
    served = dict(server.model.named_parameters())
    for name, tensor in capture.weights[1].items():
        if name in served:
            assert torch.equal(served[name], tensor), name
    for step in range(2):
        model = copy.deepcopy(start)
        model.load_state_dict(capture.weights[step])
        rows = rollout_rows(capture.rollouts[step])
        assert all("importance_weights" in r for r in rows)  # the server returns the sampler's log-probs
        want, _ = reference_gradient(model, rows, "token", eps=0.2, eps_high=0.2)
        assert relative_error(capture.grads[step], want) <= 1e-6
    history = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    # the stand-in samples with the policy's own forward: the sampler's log-probs are the policy's
    assert len(history) == 2 and all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in history)


def test_a_skipped_weight_update_is_caught_by_the_weight_version(policy):
    model, tokenizer = policy
    with FakeVLLMServer(model, tokenizer) as server:
        engine = ServerEngine(model, tokenizer, base_url=server.url, timeout=5)
        engine.update(model, version=0)
        engine.sample([[5, 6, 7]], settings(), seed=0)
        engine.sync_weights = lambda model, version=None: None  # an update that never reaches the server
        engine.update(model, version=1)
        with pytest.raises(ServerError, match=r"holds weight version '0', the policy is at step 1: a weight update"):
            engine.sample([[5, 6, 7]], settings(), seed=0)


def settings():
    from hfacc.generation.engine import SamplingSettings

    return SamplingSettings(max_completion_length=4)


def test_no_server_is_one_line_naming_the_start_command_after_the_timeout(policy):
    model, tokenizer = policy
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"no vLLM server answered at http://127.0.0.1:9 within .*=1\.5 s: start one "
                                          r"with `hfacc vllm-serve --model .* --port 9`"):  # fmt: skip
        ServerEngine(model, tokenizer, base_url="http://127.0.0.1:9", timeout=1.5)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    "fault, match",
    [
        (dict(vocabulary_shift=1), r"tokenizes with another vocabulary than the policy's"),
        (
            dict(signature={"vocab_size": 7}),
            r"serves another model than the trainer's policy \(vocab_size 7 on the server, 320 in the policy\): start",
        ),
        (dict(dev_mode=False), r"has no weight-transfer routes .*VLLM_SERVER_DEV_MODE=1.*hfacc vllm-serve"),
        (dict(max_model_len=8), r"serves at most 8 tokens .* restart it with --max_model_len 64"),
    ],
)
def test_a_server_the_trainer_cannot_use_is_one_named_line(policy, fault, match):
    model, tokenizer = policy
    with FakeVLLMServer(model, tokenizer, **fault) as server:
        with pytest.raises(ServerError, match=match) as info:
            ServerEngine(model, tokenizer, base_url=server.url, timeout=5, max_model_len=64)
    assert "\n" not in str(info.value)


def test_a_server_killed_mid_run_ends_in_a_named_line_not_a_hang(policy):
    model, tokenizer = policy
    server = FakeVLLMServer(model, tokenizer).__enter__()
    engine = ServerEngine(model, tokenizer, base_url=server.url, timeout=5)
    engine.update(model, version=0)
    server.stop()
    start = time.monotonic()
    with pytest.raises(
        ServerError, match=r"stopped answering .* restart it .* resume the run from its last checkpoint"
    ):
        engine.sample([[5, 6, 7]], settings(), seed=0)
    assert time.monotonic() - start < 15  # 3 retries, 1 s apart


def test_the_settings_name_the_server_and_refuse_what_cannot_work():
    args = GRPOArguments(output_dir="/tmp/x", use_vllm=True, vllm_mode="server", vllm_server_port=8123, use_cpu=True)
    assert get_server_url(args) == "http://127.0.0.1:8123"  # TRL's default host 0.0.0.0, reached on this machine
    with pytest.raises(ValueError, match="async_generation=True samples on a vLLM server.*vllm_mode='server'"):
        GRPOArguments(output_dir="/tmp/x", async_generation=True, use_cpu=True)
    with pytest.raises(ValueError, match="vllm_server_base_url='localhost:8000': give it as http://host:port"):
        GRPOArguments(output_dir="/tmp/x", use_vllm=True, vllm_mode="server", vllm_server_base_url="localhost:8000")


def test_vllm_serve_refuses_a_port_in_use_in_one_line(capsys):
    import socket

    from hfacc.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as done:
            main(["vllm-serve", "--model", "some/dir", "--port", str(port)])
    assert done.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"127.0.0.1:{port} is in use" in lines[0], lines


@pytest.mark.parametrize("async_generation", [False, True])
def test_on_policy_distillation_trains_on_the_server(policy, tmp_path, async_generation):
    """The student samples on the server (lmbda 1), sync and async: the server gets its weights before each
    generation, serves every on-policy micro-batch, and async takes the prefetched samples (staleness logged)."""
    from hfacc import DistillationArguments, DistillationTrainer
    from tests.grpo_setup import build_prompts

    student, tokenizer = copy.deepcopy(policy[0]), policy[1]
    teacher = build_policy(1)[0]
    with FakeVLLMServer(student, tokenizer) as server:
        args = DistillationArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, lmbda=1.0,
            max_completion_length=6, max_steps=3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            disable_tqdm=True, async_generation=async_generation, **server_settings(server),
        )  # fmt: skip
        prompts = build_prompts(16).remove_columns(["answer", "task"])
        trainer = DistillationTrainer(student, teacher, args, train_dataset=prompts, processing_class=tokenizer)
        trainer.train()
    assert (
        trainer.engine.name == "vllm-server" and server.version == "2" and server.updates == 3
    )  # the start, steps 1 and 2
    # one request per prompt, 4 prompts a step; async sends the generation after the last step too (discarded)
    assert server.completion_requests == (3 + async_generation) * 4
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    staleness = [h["sampling/staleness/max"] for h in logs]
    assert staleness == ([0.0, 1.0, 1.0] if async_generation else [0.0, 0.0, 0.0])


# ---- the served teacher (TRL's use_teacher_server): its top-K of the student's samples, trained as stored top-K ----
TOP_K = 6


@pytest.fixture(scope="module")
def distill_setting():
    from datasets import Dataset

    from hfacc import build_default_tokenizer, generate_instruction_examples
    from tests.distillation_reference import make_teacher

    tokenizer = build_default_tokenizer()
    rows = [{"prompt": e["messages"][:-1]} for e in generate_instruction_examples(9, seed=5)]
    teacher = make_teacher(rows=len(tokenizer), init=0.1)
    with FakeVLLMServer(teacher, tokenizer) as server:
        yield tokenizer, Dataset.from_list(rows), teacher, server


def distill_on_served_teacher(distill_setting, bs, ga, tmp_path):
    """One optimizer step (lr 0) of on-policy distillation from the served teacher: (gradient, the step's rows)."""
    from hfacc import DistillationArguments, DistillationTrainer
    from tests.distillation_reference import make_student
    from tests.helpers import CaptureGradients, train_args

    tokenizer, prompts, _, server = distill_setting
    student = make_student(vocab=len(tokenizer), init=0.1)
    capture = CaptureGradients(student)
    args = train_args(
        tmp_path, bs, ga, args_class=DistillationArguments, lmbda=1.0, beta=0.5, temperature=2.0, ce_weight=0.5,
        max_completion_length=8, max_steps=1, seed=3, use_teacher_server=True, teacher_model_server_url=server.url,
        loss_top_k=TOP_K, vllm_server_timeout=30,
    )  # fmt: skip
    trainer = DistillationTrainer(student, None, args, train_dataset=prompts, processing_class=tokenizer,
                                  callbacks=[capture])  # fmt: skip
    recorded, make = [], trainer.generate_micro_batches
    trainer.generate_micro_batches = lambda indices, generation=0: (
        make(indices, generation),
        recorded.extend(trainer.last_rows),
    )[0]
    torch.manual_seed(0)
    trainer.train()
    assert len(capture.grads) == 1
    return capture.grads[0], recorded


@pytest.mark.parametrize(("bs", "ga"), [(8, 1), (2, 4), (1, 8), (3, 3)])
def test_the_served_teacher_s_rows_are_the_local_top_k_and_each_step_is_the_big_batch(
    distill_setting, bs, ga, tmp_path
):
    from datasets import Dataset

    from hfacc import precompute_teacher_logprobs
    from tests.distillation_reference import big_batch, make_student

    tokenizer, _, teacher, _ = distill_setting
    grad, rows = distill_on_served_teacher(distill_setting, bs, ga, tmp_path)
    assert len(rows) == bs * ga
    local = precompute_teacher_logprobs(
        Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows]), teacher,
        top_k=TOP_K, show_progress=False,
    )  # fmt: skip
    for row, want in zip(rows, local, strict=True):
        targets = [t for t in range(1, len(row["labels"])) if row["labels"][t] != -100]  # row t: token t's
        assert targets and [row["target_token_ids"][t] for t in targets] == [
            want["target_token_ids"][t] for t in targets
        ]
        served = torch.tensor([row["target_logprobs"][t] for t in targets])
        assert torch.allclose(served, torch.tensor([want["target_logprobs"][t] for t in targets]), atol=1e-5)
    want, _, _ = big_batch(
        make_student(vocab=len(tokenizer), init=0.1), teacher, rows, beta=0.5, temperature=2.0, ce_weight=0.5,
        top_k=TOP_K, vocab=len(tokenizer),
    )  # fmt: skip
    assert relative_error(grad, want) <= 1e-6


def test_served_rows_misaligned_by_one_fail_the_big_batch(distill_setting, tmp_path, monkeypatch):
    """The control: the teacher's row of token t - 1 given to token t (prompt_logprobs read as 'predicted at t')."""
    from hfacc.generation.server_engine import ServedTeacher
    from tests.distillation_reference import big_batch, make_student

    tokenizer, _, teacher, _ = distill_setting
    aligned = ServedTeacher.request_rows

    def misaligned(self, ids):
        got_ids, got_logps = aligned(self, ids)
        return [got_ids[0]] + got_ids[:-1], [got_logps[0]] + got_logps[:-1]

    monkeypatch.setattr(ServedTeacher, "request_rows", misaligned)
    grad, rows = distill_on_served_teacher(distill_setting, 2, 4, tmp_path)
    want, _, _ = big_batch(
        make_student(vocab=len(tokenizer), init=0.1), teacher, rows, beta=0.5, temperature=2.0, ce_weight=0.5,
        top_k=TOP_K, vocab=len(tokenizer),
    )  # fmt: skip
    assert relative_error(grad, want) > 1e-3


def test_a_teacher_server_the_trainer_cannot_use_is_one_named_line(distill_setting):
    from hfacc.generation.server_engine import ServedTeacher

    tokenizer, _, teacher, server = distill_setting
    with pytest.raises(ServerError, match=r"does not return 30 prompt log-probs .* --max_logprobs 30 or more"):
        ServedTeacher(server.url, tokenizer, top_k=30, timeout=5)
    with FakeVLLMServer(teacher, tokenizer, vocabulary_shift=1) as other:
        with pytest.raises(ServerError, match=r"tokenizes with another vocabulary than the student's"):
            ServedTeacher(other.url, tokenizer, top_k=4, timeout=5)
    with pytest.raises(ServerError, match=r"no vLLM server answered .* --max_logprobs <loss_top_k>` \(or set "
                                          r"teacher_model_server_url"):  # fmt: skip
        ServedTeacher("http://127.0.0.1:9", tokenizer, top_k=4, timeout=1)


SERVED_RUN = [
    "--use_teacher_server", "true", "--loss_top_k", str(TOP_K), "--lmbda", "1", "--max_steps", "2",
    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_completion_length", "8",
    "--num_exact_match_examples", "2", "--max_new_tokens", "4", "--report_to", "none", "--save_strategy", "no",
    "--disable_tqdm", "true", "--torch_threads", "1", "--seed", "1",
]  # fmt: skip


def test_hfacc_distill_trains_on_the_served_teacher_without_one_of_its_own(
    distill_setting, tmp_path, monkeypatch, capsys
):
    """`hfacc distill --use_teacher_server true`: no teacher is loaded or trained here (no SFT of one either), each
    step's rows carry the server's top-K, and the summary names the server; beside a teacher of its own, a
    precomputation or lmbda 0, one named line (exit 2)."""
    import json

    from hfacc import DistillationTrainer
    from hfacc.cli import main as cli_main
    from hfacc.jobs import distill as job

    _, _, _, server = distill_setting
    rows, make = [], DistillationTrainer.generate_micro_batches

    def recording(self, indices, generation=0):
        batches = make(self, indices, generation)
        rows.extend(dict(r) for r in self.last_rows)
        return batches

    monkeypatch.setattr(DistillationTrainer, "generate_micro_batches", recording)
    monkeypatch.setattr(job, "load_teacher", lambda *a, **k: pytest.fail("a served teacher loads no teacher here"))
    out = tmp_path / "out"
    served = ["distill", "--teacher_model_server_url", server.url, "--output_dir", str(out), *SERVED_RUN]
    assert cli_main(served) == 0
    assert len(rows) == 8 and all(len(r["target_logprobs"]) == len(r["input_ids"]) for r in rows)
    assert server.completion_requests >= 8  # the student's samples were scored by the server
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["teacher"] == f"served at {server.url} (top-{TOP_K})" and metrics["steps"] == 2
    assert "exact_match_before" in metrics and "exact_match_teacher" not in metrics
    for extra, said in [
        (["--teacher_model_name_or_path", "my-teacher"], "the teacher is the one on teacher_model_server_url"),
        (["--precompute_teacher_logprobs", "true", "--lmbda", "0"], "precomputing needs the teacher here"),
        (["--lmbda", "0"], "Set --lmbda above 0"),
    ]:
        with pytest.raises(SystemExit) as stop:
            cli_main([*served, *extra])
        assert stop.value.code == 2 and said in capsys.readouterr().err, extra
    # No server where the URL says: one line naming the command that starts one (not a ServerError traceback).
    nowhere = [*served[:2], "http://127.0.0.1:9", *served[3:], "--vllm_server_timeout", "1"]
    assert nowhere[2] == "http://127.0.0.1:9" and served[2] == server.url
    with pytest.raises(SystemExit) as stop:
        cli_main(nowhere)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no vLLM server answered at http://127.0.0.1:9" in err, err
    assert "hfacc vllm-serve --model" in err and "Traceback" not in err


def test_the_served_teacher_s_settings_refuse_what_cannot_work(distill_setting):
    from hfacc import DistillationArguments, DistillationTrainer

    tokenizer, prompts, teacher, server = distill_setting
    common = dict(output_dir="/tmp/x", use_cpu=True)
    with pytest.raises(ValueError, match=r"use_teacher_server=True needs teacher_model_server_url=http://host:port"):
        DistillationArguments(use_teacher_server=True, **common)
    with pytest.raises(ValueError, match=r"loss_top_k and teacher_model_server_url apply to a served teacher"):
        DistillationArguments(loss_top_k=8, **common)
    args = DistillationArguments(use_teacher_server=True, teacher_model_server_url=server.url, **common)
    assert args.loss_top_k == 20  # vLLM's default --max-logprobs
    with pytest.raises(ValueError, match=r"the teacher is the one on teacher_model_server_url; pass no teacher_model"):
        DistillationTrainer(teacher, teacher, args, train_dataset=prompts, processing_class=tokenizer)


def test_hfacc_grpo_names_a_missing_server_before_it_loads_or_trains(monkeypatch, capsys, tmp_path):
    """No server at the port: one line naming the command that starts one, within the timeout, before the policy
    loads or a short SFT runs (it came after them, minutes in)."""
    from hfacc.cli import main as cli_main
    from hfacc.jobs import grpo as job

    monkeypatch.setattr(job, "load_policy", lambda *a, **k: pytest.fail("the policy loaded before the server check"))
    argv = ["grpo", "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_port", "9",
            "--vllm_server_timeout", "1", "--output_dir", str(tmp_path)]  # fmt: skip
    with pytest.raises(SystemExit) as stop:
        cli_main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no vLLM server answered at http://127.0.0.1:9" in err, err
    assert "hfacc vllm-serve --model <the policy's directory> --port 9" in err and "Traceback" not in err
