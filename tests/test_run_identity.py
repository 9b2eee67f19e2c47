"""A run's identity includes its data (issue 44), for every job: two runs in one output directory that differ only in
their data (its rows, max_length, packing, the chat template, a stream's first rows) never continue each other's
checkpoints. The second is refused with one line naming what differs and the fix, for auto-resume and `last` alike;
the first run's requeue afterwards ends with its own uninterrupted weights; the override continues deliberately, and
says so once. The jobs' main functions run in-process on a tiny model (hidden 32, one layer), 2 steps each.
docs/reliability.md ("A run's data is part of the run") has the table of what each job compares."""

import contextlib
import importlib
import io
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hfacc.data.embedded import CHAT_TEMPLATE, build_default_model, build_default_tokenizer
from hfacc.data.embedded import generate_instruction_examples as examples
from hfacc.runtime.config import ConfigError, parse_args
from hfacc.training import checkpoint as checkpoints
from hfacc.training.checkpoint import MARKER, get_dataset_identity

TOL = 1e-6
ROWS = 24
COMMON = [
    "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1", "--eval_strategy", "no",
    "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-2",
    "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--logging_steps", "1", "--report_to", "none",
    "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--seed", "0",
    "--auto_resume_from_checkpoints", "true",
]  # fmt: skip
ARGUMENTS = {
    "sft": "SFT_ARGUMENTS",
    "sft_stream": "SFT_ARGUMENTS",  # hfacc sft --streaming true: the stream's first rows identify it
    "dpo": "DPO_ARGUMENTS",
    "kto": "KTO_ARGUMENTS",
    "reward": "REWARD_ARGUMENTS",
    "distill": "DISTILL_ARGUMENTS",
    "grpo": "GRPO_ARGUMENTS",
}


def chats(seed: int) -> list[dict]:
    """``ROWS`` one-turn conversations of the embedded tasks."""
    rows = examples(ROWS, seed=seed)
    return [{"messages": [m for m in r["messages"] if m["role"] != "system"][:2]} for r in rows]


def rows_of(job: str, seed: int) -> list[dict]:
    """The rows ``job`` reads from its --dataset_name: conversations, pairs, or prompts with their answers."""
    rows = chats(seed)
    if job in ("sft", "sft_stream", "distill"):
        return rows
    if job == "grpo":
        return [{"prompt": r["messages"][:1], "answer": r["messages"][1]["content"]} for r in rows]
    answers = [r["messages"][1]["content"] for r in rows]
    return [
        {"prompt": r["messages"][0]["content"], "chosen": a, "rejected": answers[i - 1]}
        for i, (r, a) in enumerate(zip(rows, answers, strict=True))
    ]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny policy (and a teacher of another seed) with the embedded BPE tokenizer, and that tokenizer with
    another chat template (a default system turn first)."""
    root = tmp_path_factory.mktemp("assets")
    corpus = [m["content"] for r in chats(0) + chats(1) for m in r["messages"]]
    tokenizer = build_default_tokenizer(corpus, vocab_size=200)
    for name, seed in (("model", 0), ("teacher", 1)):
        build_default_model(tokenizer, hidden_size=32, num_layers=1, seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    tokenizer.chat_template = "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}" + CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "other_template")
    return root


def run(job: str, assets: Path, out: Path, *argv: str) -> dict:
    """``hfacc <job>`` in this process, into ``out``, on ``data.jsonl`` beside it (the job's rows, named by the same
    relative path in every test: one run's rows are its rows wherever the test copies it)."""
    module = importlib.import_module(f"hfacc.jobs.{job.removesuffix('_stream')}")
    own = ["--model_name_or_path", str(assets / "model"), "--dataset_name", "data.jsonl"]
    if job == "grpo":
        own += ["--num_train_prompts", "16", "--num_eval_prompts", "0", "--num_generations", "2"]
        own += ["--max_completion_length", "4", "--reward_funcs", "similarity"]
    else:
        own += ["--num_exact_match_examples", "0", "--max_length", "128"]
    if job == "sft_stream":
        own += ["--streaming", "true", "--stream_eval_examples", "2"]
    if job == "distill":
        own += ["--teacher_model_name_or_path", str(assets / "teacher"), "--lmbda", "0"]
    settings = parse_args(list(getattr(module, ARGUMENTS[job])), [*COMMON, *own, "--output_dir", str(out), *argv])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(out.parent):
        return module.main(*settings)


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory, assets):
    """Per job, run A uninterrupted (2 steps, a checkpoint after each): ``(its folder, its final weights)``."""
    done = {}

    def get(job: str):
        if job not in done:
            root = tmp_path_factory.mktemp(job)
            write_rows(root / "data.jsonl", rows_of(job, seed=0))
            run(job, assets, root / "out")
            done[job] = root, load_file(root / "out" / "model.safetensors")
        return done[job]

    return get


@pytest.fixture(autouse=True)
def fresh_messages(monkeypatch):
    """Each test's launches say their one-time lines again (they are said once per process). Not tested here, and
    slow: the PNG plots (matplotlib), and the full gc.collect() accelerate runs at every train() (about 0.5 s each,
    over the objects of the runs before; tiny CPU models free nothing)."""
    import accelerate.utils.memory

    monkeypatch.setattr(accelerate.utils.memory, "gc", SimpleNamespace(collect=lambda: 0))
    for name in ("_said", "_said_auto", "_said_data"):
        monkeypatch.setattr(checkpoints, name, set())
    for job in ARGUMENTS:
        module = importlib.import_module(f"hfacc.jobs.{job.removesuffix('_stream')}")
        for plot in ("save_loss_curve", "save_reward_curve"):
            if hasattr(module, plot):
                monkeypatch.setattr(module, plot, lambda *args, **kwargs: None)


def killed_after_checkpoint_1(first_runs, job: str, tmp_path: Path) -> Path:
    """A's folder as A left it when killed after checkpoint-1, with A's data beside it: the output directory."""
    root, _ = first_runs(job)
    shutil.copy(root / "data.jsonl", tmp_path / "data.jsonl")
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    shutil.rmtree(out / "checkpoint-2")
    (out / "model.safetensors").unlink()  # written at the end of a run: A never got there
    return out


def relative_error(weights: dict, reference: dict) -> float:
    assert weights.keys() == reference.keys()
    a = torch.cat([weights[k].double().flatten() for k in sorted(weights)])
    b = torch.cat([reference[k].double().flatten() for k in sorted(reference)])
    return ((a - b).norm() / b.norm()).item()


def steps_trained(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


def said(caplog, needle: str) -> int:
    return sum(needle in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("job", list(ARGUMENTS))
def test_a_run_on_other_data_is_refused_and_the_first_runs_requeue_ends_with_its_own_weights(
    first_runs, assets, job, tmp_path
):
    """Run B, the same command on other rows (the same file, rewritten: the same settings), in A's directory after A
    was killed: refused for auto-resume and for `last`, with one line naming what differs and the fix. Then A's
    requeue resumes its own checkpoint-1 and ends with A's uninterrupted weights.

    Before: SFT resumed A's checkpoint as its own (the job resolved it without the rows, the trainer took the path
    for a named checkpoint: a WARNING); DPO, KTO and reward resolved `last` without any settings, to the same
    effect; distill and GRPO ignored --resume_from_checkpoint (`last` read as a new run); a stream had no identity
    of its rows."""
    out = killed_after_checkpoint_1(first_runs, job, tmp_path)
    write_rows(tmp_path / "data.jsonl", rows_of(job, seed=7))  # B: other rows under the same name
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run \(checkpoint-1: data\.") as err:
        run(job, assets, out)
    assert ("first_rows_sha256" if job == "sft_stream" else "rows_sha256") in str(err.value)
    assert "--output_dir" in str(err.value) and "--resume_with_changed_data true" in str(err.value)
    # `last`, on other rows that the job's settings already show (refused before the model loads).
    name, value = ("max_prompt_length", "64") if job == "grpo" else ("max_length", "100")
    last = ["--resume_from_checkpoint", "last", "--auto_resume_from_checkpoints", "false"]
    with pytest.raises(ConfigError, match=rf"no checkpoint of this run in .*data\.{name} \w+ there, {value} here"):
        run(job, assets, out, f"--{name}", value, *last)
    assert steps_trained(out) == ["checkpoint-1"]  # B wrote nothing
    shutil.copy(first_runs(job)[0] / "data.jsonl", tmp_path / "data.jsonl")  # A, requeued with its own command
    run(job, assets, out)
    assert steps_trained(out) == ["checkpoint-1", "checkpoint-2"]
    assert relative_error(load_file(out / "model.safetensors"), first_runs(job)[1]) <= TOL


def test_the_requeue_may_name_its_data_file_by_an_absolute_path(first_runs, assets, tmp_path):
    """A's requeue naming the same file by its absolute path (A named it relative to its directory) is A's own run:
    it resumes checkpoint-1 and ends with A's uninterrupted weights. Before: refused as another run's data
    (data.dataset_name 'data.jsonl' there, '/.../data.jsonl' here), with the override as the fix."""
    out = killed_after_checkpoint_1(first_runs, "sft", tmp_path)
    run("sft", assets, out, "--dataset_name", str(tmp_path / "data.jsonl"))
    assert steps_trained(out) == ["checkpoint-1", "checkpoint-2"]
    assert relative_error(load_file(out / "model.safetensors"), first_runs("sft")[1]) <= TOL


def test_max_length_packing_and_the_chat_template_are_part_of_an_sft_run(first_runs, assets, tmp_path):
    """Run B with another max_length, with packing, or with a tokenizer of another chat template, in A's
    directory: refused for auto-resume and `last`, naming the setting. Before: the chat template (not among the
    job's settings) was only a WARNING, and B continued A's checkpoint."""
    out = killed_after_checkpoint_1(first_runs, "sft", tmp_path)
    for change, differs in [
        (["--max_length", "40"], "data.max_length 128 there, 40 here"),
        (["--packing", "true"], "data.packing False there, True here"),
        (["--tokenizer_name_or_path", str(assets / "other_template")], "data.chat_template '"),
    ]:
        with pytest.raises(ConfigError, match=r"holds checkpoints of another run") as err:
            run("sft", assets, out, *change)
        assert differs in str(err.value)
        if "chat_template" in differs:  # seen by the trainer only, as auto-resume's is (a model loaded)
            continue
        last = ["--resume_from_checkpoint", "last", "--auto_resume_from_checkpoints", "false"]
        with pytest.raises(ConfigError, match=r"no checkpoint of this run") as err:
            run("sft", assets, out, *change, *last)
        assert differs in str(err.value)
    assert steps_trained(out) == ["checkpoint-1"]


def test_an_early_refusal_comes_before_the_model_loads(first_runs, assets, tmp_path, monkeypatch):
    """A difference the job's settings show (here max_length) is refused before the model loads (or a short SFT
    runs); the trainer checks the rows again later. Before, DPO resolved `last` without any settings."""
    out = killed_after_checkpoint_1(first_runs, "dpo", tmp_path)
    dpo = importlib.import_module("hfacc.jobs.dpo")

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(dpo, "load_model_and_tokenizer", never)
    last = ["--resume_from_checkpoint", "last", "--auto_resume_from_checkpoints", "false"]
    with pytest.raises(ConfigError, match=r"no checkpoint of this run .*data.max_length 128 there, 40 here"):
        run("dpo", assets, out, "--max_length", "40", *last)


def test_the_override_continues_another_datas_checkpoint_and_says_so_once(first_runs, assets, tmp_path, caplog):
    """--resume_with_changed_data true with `last`: B continues A's checkpoint-1 on its own rows (one step left),
    said once at WARNING, and its checkpoint records B's data (auto-resume: tests/test_resume.py). Before: the GRPO
    job ignored `last` (a fresh start into A's directory)."""
    out = killed_after_checkpoint_1(first_runs, "grpo", tmp_path)
    write_rows(tmp_path / "data.jsonl", rows_of("grpo", seed=7))
    argv = ["--resume_with_changed_data", "true", "--resume_from_checkpoint", "last"]
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        run("grpo", assets, out, *argv, "--auto_resume_from_checkpoints", "false")
    assert said(caplog, "resume_with_changed_data: a checkpoint in") == 1
    assert steps_trained(out) == ["checkpoint-1", "checkpoint-2"]
    first = json.loads((out / "checkpoint-1" / MARKER).read_text())["run"]
    second = json.loads((out / "checkpoint-2" / MARKER).read_text())["run"]
    assert second["data.rows_sha256"] != first["data.rows_sha256"]  # the new checkpoint records B's rows
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2]  # step 1 is A's, resumed


def test_a_packed_streams_read_ahead_buffer_is_part_of_its_run(first_runs, assets, tmp_path):
    """A stream packs (or cuts token-budget micro-batches from) the rows of its read-ahead buffer: B, A's packed
    stream with another --stream_buffer_size, packs other rows and is refused; without packing the buffer changes
    nothing, and A's requeue with another one resumes and ends with A's weights. Before: B continued A's checkpoint
    silently (0.005 off A's run in a CLI run of 8 steps)."""
    packed = ["--packing", "true", "--max_length", "64"]
    (tmp_path / "a").mkdir()
    write_rows(tmp_path / "a" / "data.jsonl", rows_of("sft_stream", seed=0))
    run("sft_stream", assets, tmp_path / "a" / "out", *packed, "--stream_buffer_size", "4")
    shutil.rmtree(tmp_path / "a" / "out" / "checkpoint-2")
    with pytest.raises(ConfigError, match=r"data\.stream_buffer_size 4 there, 8 here"):
        run("sft_stream", assets, tmp_path / "a" / "out", *packed, "--stream_buffer_size", "8")
    out = killed_after_checkpoint_1(first_runs, "sft_stream", tmp_path)
    run("sft_stream", assets, out, "--stream_buffer_size", "8")
    assert relative_error(load_file(out / "model.safetensors"), first_runs("sft_stream")[1]) <= TOL


def test_a_streams_identity_is_a_hash_of_its_first_rows(assets, tmp_path):
    """A stream has no length: its identity hashes its first 16 rows (after the held-out ones), read again from its
    start without encoding them (training counts and says what it cuts). Before: a stream had no identity of its
    rows."""
    from transformers import AutoTokenizer

    from hfacc.data.sft import DataArguments, build_datasets

    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    identities = []
    for seed in (0, 0, 7):
        write_rows(tmp_path / "data.jsonl", chats(seed))
        data = DataArguments(dataset_name=str(tmp_path / "data.jsonl"), streaming=True, max_length=40)
        data.stream_eval_examples = 2
        stream, _, _ = build_datasets(data, tokenizer)
        identities.append(get_dataset_identity(stream, tokenizer))
        assert stream.truncated == stream.dropped == 0  # nothing encoded
    assert "first_rows_sha256" in identities[0] and "num_rows" not in identities[0]
    assert identities[0] == identities[1]  # the same stream: the same run (a requeue)
    assert identities[0]["first_rows_sha256"] != identities[2]["first_rows_sha256"]
