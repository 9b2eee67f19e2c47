"""What hfacc's commands print: one progress bar, compact lines, and user errors as one message.

By default a run shows one training progress bar whose postfix carries the exact token-weighted loss, the token
accuracy and the target tokens per second; one line per evaluation; hfacc's warnings without timestamps; no
datasets progress bars (hfacc reports what tokenization dropped), and transformers' bars only for work that takes
over a second. Piped output (a log file, CI) gets one line per log instead of a
bar redrawn in place. ``--log_level info`` (a ``TrainingArguments`` setting) brings back the stock output: the
Trainer's bar with its printed dicts, the datasets bars and hfacc's INFO notices.

User errors (a bad setting or flag, unusable data, a missing file, a model or dataset the Hub cannot give) end in
one message that names the fix and exit code 2, without a traceback; ``--debug`` or ``HFACC_DEBUG=1`` shows it.
Anything else is a bug in hfacc or in the code around it, and keeps its traceback.

    >>> describe_user_error(ConfigError("--config x.yaml: no such file."))
    '--config x.yaml: no such file.'
    >>> describe_user_error(KeyError("step")) is None   # a bug: the traceback stays
    True
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.training_args import trainer_log_levels

from ..data.formats import DataError
from ..runtime.config import ConfigError, parse_args

EXIT_USER_ERROR = 2  # as argparse does for a bad command line; `hfacc verify` keeps 1 for FAIL
EXIT_INTERRUPTED = 130
DEBUG_ENV = "HFACC_DEBUG"
DEBUG_HINT = f"(--debug or {DEBUG_ENV}=1 shows the traceback)"
HUB_SETTINGS = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name")
# How gloo and NCCL say that a peer process went away in the middle of a collective.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


# ---- user errors ------------------------------------------------------------------------------------------------
def pop_debug_flag(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """``(debug, argv without a bare --debug)``; ``--debug VALUE`` stays (it is a ``TrainingArguments`` setting)."""
    argv, debug = list(argv), os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")
    for i, arg in enumerate(argv):
        if arg == "--debug" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            del argv[i]
            return True, argv
    return debug, argv


def describe_user_error(err: BaseException, settings: Sequence[Any] = ()) -> str | None:
    """The message to show for a user error (with its fix), or ``None`` when ``err`` is a bug (keep the traceback).

    ``settings`` are the parsed argument dataclasses; a Hub failure names the settings that point at the Hub.
    """
    chain = list(_exception_chain(err))
    if isinstance(err, ConfigError | DataError):
        return str(err)
    gate = sys.modules.get("hfacc.training.step_gate")  # not imported: the error cannot have come from it
    if gate is not None and isinstance(err, gate.NonFiniteLossError):
        return f"{err} Lower the learning rate, or check the data for extreme values."
    server = sys.modules.get("hfacc.generation.server_engine")  # not imported: no server was asked
    if server is not None and isinstance(err, server.ServerError):  # no server, a stopped one, one we cannot use
        return str(err).removeprefix("hfacc: ")
    if _is_oom(err):
        return (
            "out of memory. Lower per_device_train_batch_size (or max_tokens_per_batch) and raise "
            "gradient_accumulation_steps by the same factor: the update stays exactly the same."
        )
    if isinstance(err, PermissionError):
        return f"permission denied: {err.filename}. Choose a path you can write to (e.g. --output_dir)."
    if any(_is_hub_error(e) for e in chain):
        return _hub_message(chain, settings)
    if any(isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_GONE) for e in chain):
        return (
            "another process of this run is gone (its connection closed: it failed or was killed), so this one "
            "stops too; that process's own message says why. A checkpoint it was writing is incomplete: "
            "--resume_from_checkpoint last resumes from the newest complete one."
        )
    return None


class _Guard:
    settings: Sequence[Any] = ()  # the parsed argument dataclasses, once known: a Hub error names its settings


@contextmanager
def user_errors(debug: bool = False) -> Iterator[_Guard]:
    """Inside: a user error prints one message and exits with code 2; a bug keeps its traceback.

    With ``debug`` every error keeps its traceback. Ctrl-C ends with "interrupted" and code 130. Set
    ``guard.settings`` to the parsed settings so that a Hub failure names the model or dataset it was loading::

        with user_errors(debug) as guard:
            guard.settings = parse_args(...)
            main(*guard.settings)
    """
    guard = _Guard()
    try:
        yield guard
    except KeyboardInterrupt:
        if debug:
            raise
        _print_error("interrupted.")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as err:
        message = None if debug else describe_user_error(err, guard.settings)
        if message is None:
            raise
        _print_error(message, hint=DEBUG_HINT)
        raise SystemExit(EXIT_USER_ERROR) from None


def run_recipe(
    main: Callable,
    dataclass_types: Sequence[type],
    default_config: str | Path | None = None,
    argv=None,
    prog: str | None = None,
) -> int:
    """Parse the settings of ``dataclass_types`` (YAML + flags) and call ``main(*settings)``, with clean errors.

    A recipe's ``__main__`` is ``sys.exit(run_recipe(main, [...], default_config))``; ``prog`` is the command
    ``--help`` names (``hfacc dpo``; default: the script's name). Returns 0; user errors exit
    with code 2 and one message (see :func:`user_errors`); ``--debug`` or ``HFACC_DEBUG=1`` shows tracebacks.
    """
    debug, argv = pop_debug_flag(sys.argv[1:] if argv is None else argv)
    with user_errors(debug) as guard:
        guard.settings = parse_args(dataclass_types, argv, default_config=default_config, prog=prog)
        main(*guard.settings)
    end_process_group()
    return 0


def answers_on_every_rank(trainer, engine=None) -> bool:
    """Whether every rank must take part in generating the held-out answers the main process reports: under ZeRO-3
    on several ranks each forward gathers every layer's parameters from all of them (generate's ``synced_gpus``, on
    by itself there), so the main process answering alone waits for peers that have left. Not with a vLLM engine,
    which holds the whole weights."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return engine is None and trainer.args.world_size > 1 and is_deepspeed_zero3_enabled()


def end_process_group() -> None:
    """Destroy the default process group after a job, as ``Accelerator.end_training`` does.

    A gloo rank can abort at interpreter exit after its work is done ("terminate called without an active
    exception", SIGABRT), and torchrun then reports a job that trained to its end as failed: gloo's worker threads
    free the last collective's tensors after the rank moved on, and need the GIL to do it (hfacc/runtime/shutdown.py).
    Destroying the group joins those threads where nothing else holds it; where something does (a prepared model),
    the wait that ``import hfacc`` registers at exit covers them.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exception_chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError)


def _is_hub_error(err: BaseException) -> bool:
    """An error of loading from the Hugging Face Hub (not any network error: a DDP peer's reset is not one)."""
    from huggingface_hub import errors as hub

    if isinstance(err, hub.LocalEntryNotFoundError | hub.HfHubHTTPError | hub.HFValidationError):
        return True
    if isinstance(err, hub.OfflineModeIsEnabled):
        return True
    # datasets wraps Hub failures in a plain ConnectionError("Couldn't reach 'name' on the Hub (...)")
    if isinstance(err, ConnectionError) and "on the Hub" in str(err):
        return True
    return type(err).__module__.startswith("datasets") and type(err).__name__ == "DatasetNotFoundError"


def _hub_message(chain: list[BaseException], settings: Sequence[Any]) -> str:
    from huggingface_hub import constants
    from huggingface_hub import errors as hub

    asked = []
    for obj in settings:
        for name in HUB_SETTINGS:
            value = getattr(obj, name, None)
            if value and not Path(value).exists():
                asked.append(f"--{name} {value}")
    what = f" ({', '.join(asked)})" if asked else ""
    first = next(e for e in chain if _is_hub_error(e))
    if constants.HF_HUB_OFFLINE or any(isinstance(e, hub.OfflineModeIsEnabled) for e in chain):
        return (
            f"cannot load{what}: it is neither a local path nor in the Hugging Face cache, and HF_HUB_OFFLINE=1 "
            "forbids downloading it. Download it once with network (`hf download NAME`), give a local directory, "
            "or unset HF_HUB_OFFLINE. Without --model_name_or_path and --dataset_name the embedded demo runs offline."
        )
    if isinstance(first, hub.HFValidationError):
        return f"cannot load{what}: no such local path, and not a valid Hub id either ({first}). Check the path."
    if isinstance(first, hub.GatedRepoError):
        return f"cannot load{what}: the repository is gated. Accept its terms on the Hub, then `hf auth login`."
    if isinstance(first, hub.RepositoryNotFoundError | hub.RevisionNotFoundError):
        return f"cannot load{what}: {str(first).splitlines()[0]} Check the name (and model_revision)."
    if isinstance(first, hub.HfHubHTTPError):
        return f"cannot load{what} from the Hugging Face Hub: {str(first).splitlines()[0]}"
    reason = str(chain[-1]).splitlines()[0] if str(chain[-1]) else type(chain[-1]).__name__
    return (
        f"cannot reach the Hugging Face Hub to load{what} ({reason}), and it is not in the local cache. Check the "
        "network or proxy, or give a local directory. Without --model_name_or_path and --dataset_name the embedded "
        "demo runs offline."
    )


def _print_error(message: str, hint: str = "") -> None:
    rank = os.environ.get("RANK", "0")
    prefix = f"[rank {rank}] " if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    tqdm.write(f"{prefix}error: {message}" + (f"\n{hint}" if hint else ""), file=sys.stderr)
    sys.stderr.flush()


# ---- the console of a run ---------------------------------------------------------------------------------------
def is_verbose(args) -> bool:
    """True when ``args.log_level`` asks for INFO or more: the stock Trainer output, not the compact console."""
    level = trainer_log_levels[getattr(args, "log_level", None) or "passive"]
    return 0 <= level <= logging.INFO


def setup_console(args=None) -> None:
    """Logging and progress bars for a run, from ``args.log_level`` (``TrainingArguments``); call it once, first.

    Default: hfacc's warnings as plain lines (no timestamps), no datasets bars, transformers' bars only when their
    work takes over a second. ``--log_level info``: hfacc's INFO notices and every bar.
    """
    verbose = is_verbose(args)
    handler = next((h for h in logging.getLogger("hfacc").handlers if isinstance(h, _ConsoleHandler)), None)
    if handler is None:
        handler = _ConsoleHandler()
        logging.getLogger("hfacc").addHandler(handler)
    # Records still propagate (pytest's caplog, a user's own handlers); the root logger has none of its own here.
    logging.getLogger("hfacc").setLevel(logging.INFO if verbose else logging.WARNING)
    if verbose:
        return
    import datasets
    from transformers.utils import logging as hf_logging

    # Tokenizing the embedded data takes seconds; its many map/filter bars hid the run. hfacc logs what it dropped.
    datasets.disable_progress_bars()
    # Writing a tiny model's shard takes milliseconds; loading a real model's weights takes long enough to show.
    hf_logging.set_tqdm_hook(lambda factory, a, kw: factory(*a, **{"delay": 1.0, **kw}))
    if not getattr(args, "deepspeed", None) and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") != "true":
        # DeepSpeed, when installed, is imported as a side effect and warns that it picked the CPU; not our run's news.
        logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    # Two checkpoints saved within a second (a short run): transformers says it orders them by step instead of mtime,
    # which is the right order anyway.
    logging.getLogger("transformers.trainer_utils").addFilter(
        lambda record: "mtime may not" not in record.getMessage()
    )


def use_console(trainer) -> None:
    """Show ``trainer``'s progress through :class:`ConsoleCallback` instead of transformers' bar and printed dicts.

    Does nothing with ``--log_level info`` (stock output). ``TokenWeightedTrainer`` alone keeps the stock output;
    the recipes and the ``hfacc`` command opt in with this call.
    """
    if is_verbose(trainer.args):
        return
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(ConsoleCallback())


def describe_run(model, args) -> str:
    """The console's ``run`` line: the precision training computes in (autocast over the weights' dtype, as
    accelerate runs it), the device and the world size, e.g. ``run    bf16 autocast, fp32 weights on cpu, world
    size 2``."""
    from ..ops.precision import dtype_name, get_training_autocast, get_weights_dtype

    weights, autocast = dtype_name(get_weights_dtype(model)), get_training_autocast(args)
    precision = f"{dtype_name(autocast)} autocast, {weights} weights" if autocast is not None else weights
    return f"run    {precision} on {args.device}, world size {args.world_size}"


def write(text: str, file=None) -> None:
    """Print a line without breaking a progress bar (stdout by default)."""
    tqdm.write(text, file=file or sys.stdout)
    (file or sys.stdout).flush()


class ConsoleCallback(TrainerCallback):
    """Training progress as one bar whose postfix carries the logged loss, token accuracy and target tokens/s.

    Replaces transformers' ``ProgressCallback`` / ``PrinterCallback``: evaluations become one line each, the end of
    training one line, and nothing is printed as a raw dict. In a terminal the bar redraws in place; otherwise
    (``disable_tqdm``, or output to a file) each log becomes one line. Only the main process prints.

    Args:
        stream: where the bar and lines go (default: the bar to stderr, lines to stdout).
        bar: force the bar on or off (default: on when ``stream`` is a terminal and ``disable_tqdm`` is off).
    """

    def __init__(self, stream=None, bar: bool | None = None):
        self.stream, self.force_bar = stream, bar
        self.bar = self.eval_bar = None
        self.start = time.perf_counter()

    def _write(self, text: str) -> None:
        write(text, self.stream)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()
        if not state.is_world_process_zero:
            return
        stream = self.stream or sys.stderr
        use_bar = self.force_bar
        if use_bar is None:
            use_bar = not args.disable_tqdm and hasattr(stream, "isatty") and stream.isatty()
        if use_bar:
            self.bar = tqdm(
                total=state.max_steps, initial=state.global_step, desc="train", unit="step", file=stream, leave=True
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "num_targets" in logs or "loss" in logs:  # a training log (without a loss when every step was skipped)
            fields = format_train_log(logs)
            if self.bar is not None:
                self.bar.set_postfix_str(fields)
            else:
                elapsed = time.perf_counter() - self.start
                done = max(state.global_step, 1)
                left = elapsed / done * (state.max_steps - state.global_step)
                self._write(
                    f"step {state.global_step:>{len(str(state.max_steps))}}/{state.max_steps}  {fields}  "
                    f"[{format_duration(elapsed)} < {format_duration(left)}]"
                )
        elif "train_runtime" in logs:
            self._close_bar()
            runtime = format_duration(logs["train_runtime"])
            self._write(f"train  {state.global_step} steps in {runtime}  {format_train_log(logs, prefix='train_')}")

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero or self.bar is None or eval_dataloader is None:
            return
        if self.eval_bar is None:
            # Short evaluations never show a bar (delay); long ones get a temporary one under the training bar.
            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            self.eval_bar = tqdm(total=total, desc="eval", leave=False, delay=2.0, file=self.bar.fp, position=1)
        self.eval_bar.update(1)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None
        if state.is_world_process_zero and metrics:
            when = "before training" if state.global_step == 0 else f"step {state.global_step}"
            self._write(f"eval   {when:<16s}{format_eval_metrics(metrics)}")

    def on_train_end(self, args, state, control, **kwargs):
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_train_log(logs: dict[str, float], prefix: str = "") -> str:
    """``loss 0.4319  token acc 0.859  1,432 target tok/s`` from a Trainer log (keys ``{prefix}loss`` ...)."""
    loss = logs.get(prefix + "loss")
    parts = [f"loss {loss:.4f}" if loss is not None else "no step applied"]
    if prefix + "token_accuracy" in logs:
        parts.append(f"token acc {logs[prefix + 'token_accuracy']:.3f}")
    if prefix + "reward" in logs:  # online RL (GRPOTrainer): the sampled completions' mean reward
        parts.append(f"reward {logs[prefix + 'reward']:.3f}")
    if prefix + "rewards/accuracies" in logs:  # preference pairs
        parts.append(f"reward acc {logs[prefix + 'rewards/accuracies']:.3f}")
    if prefix + "accuracy" in logs:  # a reward model: the share of pairs it ranks right
        parts.append(f"pair acc {logs[prefix + 'accuracy']:.3f}")
    if prefix + "kl" in logs:  # KTO: the reference point
        parts.append(f"kl {logs[prefix + 'kl']:.3f}")
    if "target_tokens_per_second" in logs:
        parts.append(f"{logs['target_tokens_per_second']:,.0f} target tok/s")
    if "completion_tokens_per_second" in logs:
        parts.append(f"{logs['completion_tokens_per_second']:,.0f} completion tok/s")
    if "pairs_per_second" in logs:
        parts.append(f"{logs['pairs_per_second']:,.1f} pairs/s")
    if "examples_per_second" in logs:
        parts.append(f"{logs['examples_per_second']:,.1f} examples/s")
    if logs.get(prefix + "skipped_steps"):
        parts.append(f"skipped steps {logs[prefix + 'skipped_steps']}")
    if "accumulation_audit_error" in logs:
        parts.append(f"audit error {logs['accumulation_audit_error']:.1e}")
    return "  ".join(parts)


def format_eval_metrics(metrics: dict[str, float], prefix: str = "eval_") -> str:
    """``loss 0.4319  token acc 0.859  (5,039 targets, 3.9 s)`` from ``Trainer.evaluate``'s metrics."""
    parts = [f"loss {metrics[prefix + 'loss']:.4f}"] if prefix + "loss" in metrics else []
    if prefix + "token_accuracy" in metrics:
        parts.append(f"token acc {metrics[prefix + 'token_accuracy']:.3f}")
    if prefix + "rewards/accuracies" in metrics:  # preference pairs
        parts.append(f"reward acc {metrics[prefix + 'rewards/accuracies']:.3f}")
        parts.append(f"margin {metrics[prefix + 'rewards/margins']:.3f}")
    if prefix + "accuracy" in metrics:  # a reward model
        parts.append(f"pair acc {metrics[prefix + 'accuracy']:.3f}")
        parts.append(f"margin {metrics[prefix + 'margin']:.3f}")
    if prefix + "kl" in metrics:  # KTO
        parts.append(f"kl {metrics[prefix + 'kl']:.3f}")
        if prefix + "rewards/margins" in metrics and prefix + "rewards/accuracies" not in metrics:
            parts.append(f"margin {metrics[prefix + 'rewards/margins']:.3f}")
    detail = []
    if prefix + "num_targets" in metrics:
        detail.append(f"{metrics[prefix + 'num_targets']:,} targets")
    if prefix + "num_pairs" in metrics:
        detail.append(f"{metrics[prefix + 'num_pairs']:,} pairs")
    if prefix + "num_examples" in metrics:
        detail.append(f"{metrics[prefix + 'num_examples']:,} examples")
    if prefix + "runtime" in metrics:
        detail.append(f"{metrics[prefix + 'runtime']:.1f} s")
    return "  ".join(parts) + (f"  ({', '.join(detail)})" if detail else "")


def format_duration(seconds: float) -> str:
    """``1:05`` for 65 seconds, ``1:01:05`` past an hour."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}:{rest // 60:02d}:{rest % 60:02d}") if hours else f"{rest // 60}:{rest % 60:02d}"


class _ConsoleHandler(logging.Handler):
    """hfacc's log records as plain lines (warnings marked), written around the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.levelno >= logging.WARNING:
                text = f"{record.levelname.lower()}: {text}"
            tqdm.write(text, file=sys.stderr)
        except Exception:  # logging must never raise into the run
            self.handleError(record)
