"""What a run prints: the compact console (bar / lines, eval lines, no raw dicts) and user errors as one message."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from huggingface_hub import errors as hub_errors
from transformers import PrinterCallback, ProgressCallback

from hfacc import DataCollatorForCausalLM, TokenWeightedTrainer
from hfacc.data.embedded import build_tiny_llama
from hfacc.data.formats import DataError
from hfacc.jobs.console import (
    EXIT_USER_ERROR,
    ConsoleCallback,
    describe_user_error,
    format_duration,
    pop_debug_flag,
    run_recipe,
    use_console,
)
from hfacc.runtime.config import ConfigError
from tests.helpers import ROOT, load_recipe, make_examples, recipe_types, train_args

COLLATE = DataCollatorForCausalLM(pad_token_id=0)


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def build_trainer(tmp_path, **overrides):
    from datasets import Dataset

    examples = make_examples(16)
    args = train_args(tmp_path, 2, 2, learning_rate=1e-3, eval_strategy="steps", eval_steps=2, **overrides)
    return TokenWeightedTrainer(
        model=build_tiny_llama(vocab_size=64),
        args=args,
        train_dataset=Dataset.from_list(examples),
        eval_dataset=Dataset.from_list(examples[:4]),
        data_collator=COLLATE,
    )


def test_use_console_replaces_the_stock_printer_and_logs_lines(tmp_path, capsys):
    trainer = build_trainer(tmp_path, max_steps=4)  # disable_tqdm: the stock Trainer would print dicts
    use_console(trainer)
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    assert "ConsoleCallback" in names and "PrinterCallback" not in names and "ProgressCallback" not in names
    trainer.train()
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/4", "2/4", "3/4", "4/4"]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert f"loss {logged[0]['loss']:.4f}" in steps[0]  # the exact token-weighted loss that was logged
    assert "token acc" in steps[0] and "target tok/s" in steps[0]
    assert sum(line.startswith("eval   step 2") for line in out.splitlines()) == 1
    assert "train  4 steps in" in out
    assert "{" not in out  # no raw dicts


def test_stock_trainer_output_stays_without_opting_in(tmp_path):
    trainer = build_trainer(tmp_path, max_steps=1)
    names = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert PrinterCallback in names and not any(
        isinstance(cb, ConsoleCallback) for cb in trainer.callback_handler.callbacks
    )
    try:
        verbose = build_trainer(tmp_path, max_steps=1, disable_tqdm=False, log_level="info")
        use_console(verbose)  # --log_level info: the stock bar and its dicts
        assert ProgressCallback in [type(cb) for cb in verbose.callback_handler.callbacks]
    finally:
        transformers.logging.set_verbosity_warning()  # the Trainer set transformers' verbosity for the process


def test_the_bar_carries_loss_accuracy_and_throughput(tmp_path):
    terminal = FakeTerminal()
    trainer = build_trainer(tmp_path, max_steps=4, disable_tqdm=False)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(ConsoleCallback(stream=terminal))
    trainer.train()
    text = terminal.getvalue()
    last = text.replace("\r", "\n").splitlines()
    bar = [line for line in last if line.startswith("train") and "4/4" in line]
    assert bar and "loss " in bar[-1] and "token acc" in bar[-1] and "target tok/s" in bar[-1]
    assert "eval   step 2" in text and "{" not in text


def test_format_duration():
    assert format_duration(65) == "1:05" and format_duration(3725) == "1:02:05" and format_duration(0.4) == "0:00"


def test_debug_flag_is_taken_out_unless_it_has_a_value(monkeypatch):
    monkeypatch.delenv("HFACC_DEBUG", raising=False)
    assert pop_debug_flag(["--lr", "1", "--debug"]) == (True, ["--lr", "1"])
    assert pop_debug_flag(["--debug", "--lr", "1"]) == (True, ["--lr", "1"])
    assert pop_debug_flag(["--debug", "underflow_overflow"]) == (False, ["--debug", "underflow_overflow"])
    monkeypatch.setenv("HFACC_DEBUG", "1")
    assert pop_debug_flag([]) == (True, [])


def chained(top: BaseException, *causes: BaseException) -> BaseException:
    err = top
    for cause in causes:
        err.__cause__ = cause
        err = cause
    return top


def test_user_errors_and_bugs_are_told_apart(monkeypatch):
    from huggingface_hub import constants

    assert describe_user_error(DataError("row 3: no field 'messages'")) == "row 3: no field 'messages'"
    assert describe_user_error(ConfigError("bad")) == "bad"
    assert describe_user_error(KeyError("x")) is None and describe_user_error(ValueError("x")) is None
    assert "lower per_device_train_batch_size" in describe_user_error(torch.OutOfMemoryError("CUDA oom")).lower()
    denied = PermissionError(13, "Permission denied", "/root/out")
    assert describe_user_error(denied).startswith("permission denied: /root/out.")

    class Settings:
        model_name_or_path = "nobody/no-such-model"
        dataset_name = None

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    network = chained(OSError("We couldn't connect"), hub_errors.LocalEntryNotFoundError("cache"), ConnectionError())
    message = describe_user_error(network, [Settings()])
    assert (
        message.startswith("cannot reach the Hugging Face Hub")
        and "--model_name_or_path nobody/no-such-model" in message
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE=1" in describe_user_error(network, [Settings()])
    datasets_offline = ConnectionError("Couldn't reach 'nobody/data' on the Hub (OfflineModeIsEnabled)")
    assert "HF_HUB_OFFLINE=1" in describe_user_error(datasets_offline)
    assert describe_user_error(ConnectionResetError("peer")) is None  # a network error, but not the Hub's


def run_sft(capsys, *argv):
    """recipes/sft.py's __main__ in-process: (exit code, stdout, stderr)."""
    module = load_recipe()
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(module.main, recipe_types(module), module.DEFAULT_CONFIG, argv=list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--no_such_flag", "1"], "unknown argument(s): --no_such_flag 1. Run with --help"),
        (["--learning_rate", "abc"], "invalid float value: 'abc'"),
        (["--lora_r", "0"], "lora_r=0: the LoRA rank must be >= 1."),
        (["--config", "missing.yaml"], "--config missing.yaml: no such file."),
        (["--dataset_name", "missing.jsonl"], "dataset missing.jsonl: no such file."),
        (["--resume_from_checkpoint", "nowhere/checkpoint-9"], "Cannot resume from nowhere/checkpoint-9"),
    ],
    ids=["flag", "value", "check", "config", "data-file", "checkpoint"],
)
def test_user_errors_end_in_one_message(capsys, tmp_path, monkeypatch, argv, expected):
    monkeypatch.delenv("HFACC_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_sft(capsys, *argv, "--output_dir", str(tmp_path / "out"))
    assert code == EXIT_USER_ERROR
    assert err.startswith("error: ") and expected in err and "Traceback" not in err + out
    assert "HFACC_DEBUG=1 shows the traceback" in err


def test_a_bad_row_names_row_and_line(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("HFACC_DEBUG", raising=False)
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 3
    path = tmp_path / "my.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*rows, {"prompt": "x", "completion": "y"}]) + "\n")
    code, _, err = run_sft(capsys, "--dataset_name", str(path), "--output_dir", str(tmp_path / "out"))
    assert code == EXIT_USER_ERROR
    assert err.splitlines()[0] == (
        "error: row 3 (line 4 of my.jsonl): no field 'messages', which the other rows (messages format) have."
    )


def test_debug_shows_the_traceback_and_bugs_keep_theirs(capsys, tmp_path):
    module = load_recipe()
    with pytest.raises(ConfigError):
        run_recipe(module.main, recipe_types(module), module.DEFAULT_CONFIG, argv=["--no_such_flag", "1", "--debug"])

    def buggy(*settings):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_recipe(buggy, recipe_types(module), module.DEFAULT_CONFIG, argv=["--output_dir", str(tmp_path)])


def test_the_hfacc_command_handles_user_errors_the_same_way(capsys, monkeypatch):
    from hfacc.cli import main as cli_main

    monkeypatch.delenv("HFACC_DEBUG", raising=False)
    for argv, expected in (
        (["verify", "--no_such_flag", "1"], "error: unknown argument(s): --no_such_flag 1."),
        (["show-mask", "--dataset_name", "missing.jsonl"], "error: dataset missing.jsonl: no such file."),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == EXIT_USER_ERROR and err.startswith(expected) and "Traceback" not in err


def run_command(*cmd, env=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("HFACC_DEBUG", None)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


# `hfacc ...` in a process where huggingface_hub's retries do not sleep: it retries a refused connection 5 times per
# request, after 1 + 2 + 4 + 8 + 8 s, so an unreachable Hub cost this test ~70 s of waiting before the message. The
# requests, the retries and hfacc's handling of the final error are unchanged.
HFACC_WITHOUT_BACKOFF = (
    "import sys, types; import huggingface_hub.utils._http as http; "
    "http.time = types.SimpleNamespace(sleep=lambda seconds: None); "
    "from hfacc.cli import main; sys.exit(main(sys.argv[1:]))"
)


def start_command(*cmd, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("HFACC_DEBUG", None)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_hub_failures_offline_and_unreachable():
    """A hub id while offline, and a hub that cannot be reached (a proxy nobody listens on): one message each. The
    two commands run side by side (each waits on its own imports and connections)."""
    model = ["--model_name_or_path", "nobody/no-such-model"]
    offline = start_command(sys.executable, "recipes/sft.py", *model, env={"HF_HUB_OFFLINE": "1"})
    proxy = "http://127.0.0.1:9"  # the discard port: refused at once, whatever the machine's network
    unreachable = start_command(
        sys.executable,
        "-c",
        HFACC_WITHOUT_BACKOFF,
        "verify",
        *model,
        env={"HF_HUB_OFFLINE": "0", "HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy},
    )
    _, offline_err = offline.communicate(timeout=300)
    _, unreachable_err = unreachable.communicate(timeout=300)
    assert offline.returncode == EXIT_USER_ERROR, offline_err[-3000:]
    assert "Traceback" not in offline_err and "HF_HUB_OFFLINE=1 forbids downloading it" in offline_err
    assert "--model_name_or_path nobody/no-such-model" in offline_err
    assert unreachable.returncode == EXIT_USER_ERROR, unreachable_err[-3000:]
    assert "Traceback" not in unreachable_err and "Retrying in" in unreachable_err  # huggingface_hub did retry
    assert "error: cannot reach the Hugging Face Hub to load (--model_name_or_path nobody/no-such-model)" in (
        unreachable_err
    )


@pytest.mark.slow
def test_through_accelerate_launch_quiet_leaves_one_message():
    """`accelerate launch` adds its own CalledProcessError traceback on any failure; `-q` leaves only ours."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    quiet = run_command(*launch, "-q", "recipes/sft.py", "--no_such_flag", "1")
    assert quiet.returncode != 0
    assert quiet.stderr.strip().splitlines() == [
        "error: unknown argument(s): --no_such_flag 1. Run with --help for the settings.",
        "(--debug or HFACC_DEBUG=1 shows the traceback)",
    ]
    loud = run_command(*launch, "recipes/sft.py", "--no_such_flag", "1")
    assert loud.returncode != 0 and "error: unknown argument(s): --no_such_flag 1." in loud.stderr
    assert loud.stderr.count("Traceback") == 1 and "CalledProcessError" in loud.stderr  # accelerate's, not ours


SHORT = "--max_steps 4 --num_embedded_examples 240 --per_device_train_batch_size 4 --gradient_accumulation_steps 2"
SHORT += " --eval_steps 2 --save_steps 2 --logging_steps 1 --num_exact_match_examples 12 --max_new_tokens 8"


@pytest.mark.slow
def test_the_recipe_console_is_a_bar_eval_lines_and_the_summary(tmp_path):
    """The README command as a newcomer runs it: apart from accelerate's launch notice, only hfacc's lines."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "recipes/sft.py",
        *SHORT.split(),
        "--output_dir",
        str(out),
    ]
    proc = run_command(*cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model  LlamaForCausalLM, ")
    assert lines[1] == "run    fp32 on cpu, world size 1"  # the precision that runs, the device, the world size
    assert lines[2].startswith("data   228 training / 12 held-out")
    assert lines[3] == "batch  4 sequences x 2 micro-batches x 1 process(es)"
    assert lines[4].startswith("eval   before training loss ")
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/4", "2/4", "3/4", "4/4"]
    # steps 2 and 4; the recipe reuses the Trainer's evaluation of the last step instead of evaluating again
    assert [line.split()[2] for line in lines if line.startswith("eval   step ")] == ["2", "4"]
    assert any(line.startswith("train  4 steps in ") for line in lines)
    summary = proc.stdout[proc.stdout.index("=== hfacc SFT summary ===") :]
    assert "exact match          " in summary and "  by task: " in summary and "wall time" in summary
    everything = proc.stdout + proc.stderr
    for noise in ("Traceback", "{'", "\x1b[A", "Tokenizing", "Writing model shards", "INFO", "real_accelerator"):
        assert noise not in everything, noise
    # stderr holds accelerate's notice about the launch values it guessed, and nothing else
    notice = [line for line in proc.stderr.splitlines() if line.strip()]
    assert all("accelerate" in line or line.startswith("\t`--") for line in notice), notice


def test_a_job_that_ends_destroys_its_process_group(tmp_path):
    """A gloo rank exiting with its group alive aborts now and then (SIGABRT after the work is done): a finished job
    destroys the group, as ``Accelerator.end_training`` does, and one that never formed a group is left as it was."""
    from dataclasses import dataclass

    import torch.distributed as dist

    @dataclass
    class Settings:
        steps: int = 1

    seen = []
    run_recipe(lambda s: seen.append(dist.is_initialized()), [Settings], argv=[])  # no group: nothing to do
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert run_recipe(lambda s: seen.append(dist.is_initialized()), [Settings], argv=["--steps", "2"]) == 0
        assert seen == [False, True] and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
