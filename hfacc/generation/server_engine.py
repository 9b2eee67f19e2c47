"""A vLLM server beside the trainer (TRL's ``vllm_mode="server"``): the engine samples over HTTP and copies the
policy's weights in through vLLM's weight-transfer routes (:mod:`hfacc.generation.engine_weights`).

Start the server with ``hfacc vllm-serve --model <the policy's directory>`` (docs/vllm.md#server-mode). Then:

- **Connect** (:meth:`ServerEngine.__init__`): ``/health`` is polled until it answers, for at most
  ``vllm_server_timeout`` seconds; no server by then is one line naming the command that starts one. A server without
  vLLM's RL routes, with a shorter ``max_model_len`` than the trainer's prompts and completions, another vocabulary
  or another model, is each one named line.
- **Weights** (:meth:`ServerEngine.sync_weights`): on the main process, ``/pause?mode=wait`` (requests still running
  finish first), ``/start_weight_update``, the policy's weights in ``/update_weights`` chunks, ``/finish_weight_update`` with the policy's version (its optimizer step), then
  ``/reset_prefix_cache``, ``/resume``; every rank waits for it (a barrier).
- **Before each generation** the server's ``/weight_info`` must name the policy's version: a skipped update (or
  another trainer writing to the same server) is a named error, not samples from other weights.
- **Samples** (:meth:`ServerEngine.sample`): one ``/v1/completions`` request per prompt (``n`` completions, its own
  seed, the sampled tokens' log-probs), sent together; each :class:`Samples` is tagged with the weight version it
  was sampled under.
- **Ahead of time** (``async_generation``): :meth:`ServerEngine.prefetch` sends the next generation's requests in a
  thread while the current step trains; :meth:`sample` for the same prompts and seed takes them, unless they are
  more than ``max_staleness`` optimizer steps older than the policy (then they are dropped, counted, and sampled
  again). A weight update waits for the requests in flight first, so each sample has one version.

Every request is bounded: ``vllm_server_timeout`` seconds each, and a refused connection is retried 3 times (1 s
apart) before the run stops with a line saying the server stopped and how to resume.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import astuple, replace

import torch
from torch import nn

from ..models.reference import unwrap_model
from ..ops.model_io import get_base_model
from .engine import GenerationEngine, Samples, SamplingSettings, group_prompts
from .engine_weights import encode_weights, get_engine_weights, get_model_signature

logger = logging.getLogger(__name__)

START_COMMAND = "hfacc vllm-serve --model <the policy's directory> --port {port}"
RETRIES = 3  # a refused connection is tried this many more times, 1 s apart, before the run stops
TEACHER_COMMAND = "hfacc vllm-serve --model <the teacher's directory> --port {port} --max_logprobs <loss_top_k>"
SERVER_SETTING = "vllm_server_base_url / vllm_server_host and vllm_server_port"
PROBE = "The quick brown fox: 12 + 30 = 42."


class ServerError(RuntimeError):
    """The vLLM server is missing, stopped, or cannot serve this trainer: the message names which and the fix."""


class ServerClient:
    """JSON over HTTP to one vLLM server, every call bounded by ``timeout`` seconds (stdlib only)."""

    def __init__(self, base_url: str, timeout: float):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def request(self, path: str, body: dict | None = None, method: str | None = None, retries: int = RETRIES):
        """The decoded JSON answer of ``path`` (POST with ``body``, else GET). A refused connection is retried
        ``retries`` times; then, as an HTTP error or a timeout, it is a :class:`ServerError` naming the route."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method or ("GET" if body is None else "POST"),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        for attempt in range(retries + 1):
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read()
                    return json.loads(text) if text else None
            except urllib.error.HTTPError as err:
                detail = err.read().decode(errors="replace")[:500]
                raise ServerError(f"hfacc: the vLLM server at {self.base_url} refused {path} (HTTP {err.code}): "
                                  f"{detail}") from None  # fmt: skip
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                reason = getattr(err, "reason", err)
                if attempt < retries and not isinstance(reason, TimeoutError) and "timed out" not in str(reason):
                    time.sleep(1.0)
                    continue
                raise ServerError(
                    f"hfacc: the vLLM server at {self.base_url} stopped answering ({path}: {reason}); restart it "
                    "(hfacc vllm-serve ...) and resume the run from its last checkpoint (--resume_from_checkpoint)."
                ) from None
        raise AssertionError("unreachable")

    def wait_until_up(self, timeout: float, command: str = START_COMMAND, setting: str = SERVER_SETTING) -> None:
        """Poll ``/health`` once a second for at most ``timeout`` seconds; none: :class:`ServerError` naming the
        command that starts one (``command``, with ``{port}``)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=min(5.0, timeout)) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise ServerError(
                    f"hfacc: no vLLM server answered at {self.base_url} within vllm_server_timeout={timeout:g} s: "
                    f"start one with `{command.format(port=urllib.parse.urlsplit(self.base_url).port or 80)}` (or set "
                    f"{setting} to where it runs)."
                )
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))


class ServerEngine(GenerationEngine):
    """Samples on a vLLM server started apart (``hfacc vllm-serve``), from the policy's weights sent to it.

    Args:
        model: the policy; its config is checked against the served model's, its weights are sent at once.
        tokenizer: its tokenizer (the server's must tokenize alike).
        base_url: the server, ``http://host:port``.
        timeout: seconds to wait for the server to come up, and for any one request.
        max_model_len: the longest prompt + completion the trainer asks for (None: not checked).
        max_staleness: with :meth:`prefetch`, the most optimizer steps a sample may lag the policy when it is taken.
        main_process: whether this process sends the weights (the others wait at a barrier).
    """

    name = "vllm-server"
    returns_logps = True

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        base_url: str,
        timeout: float = 240.0,
        max_model_len: int | None = None,
        max_staleness: int = 4,
        main_process: bool = True,
    ):
        super().__init__()
        self.tokenizer, self.max_staleness, self.main_process = tokenizer, max_staleness, main_process
        self.client = ServerClient(base_url, timeout)
        self.client.wait_until_up(timeout)
        self.check_server(model, max_model_len)
        self.pending: dict[tuple, Future] = {}
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hfacc-vllm-server")
        self.lock = threading.Lock()
        self.staleness: list[int] = []  # per generation taken, since the last read (the logged metrics)
        self.dropped = 0  # samples dropped as too stale, since the last read
        self.sync_weights(model)  # the server holds weight version "initial" ...
        self.fresh = True  # ... until the trainer names the version those weights are (``engine.version = step``)

    @property
    def version(self) -> int | None:
        """The policy version the server holds. Set by the trainer right after the engine is built (the weights sent
        at the start are the policy's at that step): the server's version is renamed to it (``/update_weight_version``)."""
        return self._version

    @version.setter
    def version(self, value: int | None) -> None:
        if getattr(self, "fresh", False) and value is not None:
            if self.main_process:
                self.client.request("/update_weight_version", {"new_version": str(value)})
            self.fresh = False
        self._version = value

    # ---- connecting -----------------------------------------------------------------------------------------------
    def check_server(self, model: nn.Module, max_model_len: int | None) -> None:
        """One named :class:`ServerError` for a server this trainer cannot use."""
        client = self.client
        models = client.request("/v1/models")["data"]
        self.served_model, served_len = models[0]["id"], models[0].get("max_model_len")
        if max_model_len is not None and served_len is not None and served_len < max_model_len:
            raise ServerError(
                f"hfacc: the vLLM server serves at most {served_len} tokens (its --max-model-len), and the trainer "
                f"asks for {max_model_len} (max_prompt_length + max_completion_length): restart it with "
                f"--max_model_len {max_model_len} or more."
            )
        try:
            client.request("/weight_info", retries=0)
        except ServerError as err:
            if "HTTP 404" not in str(err):
                raise
            raise ServerError(
                f"hfacc: the vLLM server at {client.base_url} has no weight-transfer routes (it was started without "
                "VLLM_SERVER_DEV_MODE=1): start it with `hfacc vllm-serve`, which sets it."
            ) from None
        served = client.request(
            "/tokenize", {"model": self.served_model, "prompt": PROBE, "add_special_tokens": False}
        )
        ours = self.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if served.get("tokens") != ours:
            raise ServerError(
                f"hfacc: the vLLM server tokenizes with another vocabulary than the policy's ({PROBE!r} is "
                f"{served.get('tokens')[:8]}... there, {ours[:8]}... here): serve the policy's own directory."
            )
        base = get_base_model(unwrap_model(model))
        try:
            client.request(
                "/init_weight_transfer_engine", {"init_info": {"signature": get_model_signature(base.config)}}
            )
        except ServerError as err:
            text = str(err)
            if "serves another model" in text:  # the backend's refusal (engine_weights.another_model_message)
                start = text.index("hfacc: this vLLM server")
                raise ServerError(text[start : text.index("directory>).", start) + len("directory>).")]) from None
            if "weight_transfer" in text or "Weight transfer" in text or "HTTP 500" in text:
                raise ServerError(
                    f"hfacc: the vLLM server at {client.base_url} could not start hfacc's weight transfer (started "
                    f"without --weight-transfer-config, or with another model?): start it with `hfacc vllm-serve`. "
                    f"({text})"
                ) from None
            raise

    # ---- weights --------------------------------------------------------------------------------------------------
    def sync_weights(self, model: nn.Module, version: int | str = "initial") -> None:
        """Send ``model``'s weights to the server, which then holds weight version ``version``."""
        self.wait_in_flight()  # samples in flight finish under the weights they started with
        weights = get_engine_weights(model)  # a collective under ZeRO-3 / FSDP2: every rank takes part
        if self.main_process:
            client = self.client
            # vLLM's pause: requests still running (another engine's, an interrupted run's) finish first, and none
            # starts while the weights change.
            client.request("/pause?mode=wait", {})
            try:
                client.request("/start_weight_update", {})
                for chunk in encode_weights(weights):
                    client.request("/update_weights", {"update_info": chunk})
                client.request("/finish_weight_update", {"weight_version": str(version)})
                client.request("/reset_prefix_cache", {})
            finally:
                client.request("/resume", {})
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def update(self, model: nn.Module, version: int) -> bool:
        if self.version == version:
            return False
        self.sync_weights(model, version)
        self.version, self.syncs = version, self.syncs + 1
        return True

    def check_version(self) -> None:
        """:class:`ServerError` unless the server holds the weights of the policy's version (:attr:`version`)."""
        held = self.client.request("/weight_info").get("weight_version")
        if held != str(self.version):
            raise ServerError(
                f"hfacc: the vLLM server holds weight version {held!r}, the policy is at step {self.version}: a "
                "weight update was skipped, or another trainer sends weights to this server (give each its own)."
            )

    def wait_in_flight(self) -> None:
        for future in list(self.pending.values()):
            future.exception(timeout=self.client.timeout)  # bounded; its error, if any, surfaces when taken

    # ---- sampling -------------------------------------------------------------------------------------------------
    def sample(self, prompt_ids, settings: SamplingSettings, *, seed: int | None = None) -> Samples:
        key = self.key(prompt_ids, settings, seed)
        future = self.pending.pop(key, None)
        if future is not None:
            samples = future.result(timeout=self.client.timeout)
            lag = (self.version or 0) - (samples.version or 0)
            if lag <= self.max_staleness:
                self.staleness.append(lag)
                return samples
            self.dropped += len(samples.completion_ids)
            logger.info("hfacc: %d samples %d steps stale dropped (max_staleness=%d).",
                        len(samples.completion_ids), lag, self.max_staleness)  # fmt: skip
        self.check_version()
        samples = self.request_samples(prompt_ids, settings, seed, self.version)
        self.staleness.append(0)
        return samples

    def prefetch(self, prompt_ids, settings: SamplingSettings, *, seed: int | None = None) -> None:
        """Send the requests of a later :meth:`sample` now, in a thread, under the weights the server holds."""
        key = self.key(prompt_ids, settings, seed)
        if key in self.pending:
            return
        self.check_version()
        version = self.version
        self.pending[key] = self.pool.submit(self.request_samples, prompt_ids, settings, seed, version)

    def take_metrics(self) -> dict[str, float]:
        """The logged async metrics since the last call: ``sampling/staleness/mean`` and ``/max`` (optimizer steps
        between the weights a generation was sampled under and the policy's when it was taken) and
        ``sampling/dropped_samples``."""
        logs = {}
        if self.staleness:
            logs["sampling/staleness/mean"] = sum(self.staleness) / len(self.staleness)
            logs["sampling/staleness/max"] = float(max(self.staleness))
        logs["sampling/dropped_samples"] = float(self.dropped)
        self.staleness, self.dropped = [], 0
        return logs

    @staticmethod
    def key(prompt_ids, settings, seed) -> tuple:
        return tuple(tuple(p) for p in prompt_ids), astuple(settings), seed

    def request_samples(self, prompt_ids, settings: SamplingSettings, seed, version) -> Samples:
        """One ``/v1/completions`` request per distinct consecutive prompt (``n`` samples, seed ``seed + i``, as the
        colocated engine), sent together; the answers in order, tagged with ``version``."""
        requests = group_prompts(prompt_ids)
        bodies = [
            {
                "model": self.served_model,
                "prompt": ids,
                "n": n,
                "max_tokens": settings.max_completion_length,
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "top_k": settings.top_k if settings.top_k > 0 else -1,
                "repetition_penalty": settings.repetition_penalty,
                "logprobs": 0,
                "seed": None if seed is None else seed + i,
                "return_token_ids": True,
                "skip_special_tokens": False,
            }
            for i, (ids, n) in enumerate(requests)
        ]
        answers = list(self.pool.map(lambda body: self.client.request("/v1/completions", body), bodies))
        completions, truncated, logps = [], [], []
        for answer in answers:
            for choice in sorted(answer["choices"], key=lambda c: c["index"]):
                ids = list(choice["token_ids"])
                completions.append(ids)
                truncated.append(choice["finish_reason"] == "length")
                logps.append([float(x) for x in choice["logprobs"]["token_logprobs"]])
        return replace(Samples(completions, truncated, logps), version=version)

    def answer(self, prompt_ids, max_new_tokens: int) -> list[list[int]]:
        self.check_version()
        settings = SamplingSettings(max_completion_length=max_new_tokens, temperature=0.0)
        samples = self.request_samples([list(p) for p in prompt_ids], settings, None, self.version)
        eos = self.tokenizer.eos_token_id
        return [[t for t in ids if t != eos] for ids in samples.completion_ids]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ServedTeacher:
    """The distillation teacher on a vLLM server (TRL's ``use_teacher_server`` / ``teacher_model_server_url``): its
    top-K log-probs of each whole sequence (prompt and the student's completion), in the stored layout that
    :class:`hfacc.DistillationObjective` trains from (``target_token_ids`` / ``target_logprobs``, row t the
    teacher's distribution of token t given the tokens before it: :func:`hfacc.precompute_teacher_logprobs`).

    One ``/v1/completions`` request per sequence, its token ids as the prompt, ``prompt_logprobs=top_k``,
    ``max_tokens=1``, temperature 1: vLLM's ``prompt_logprobs[t]`` is exactly row t (row 0, which no token
    predicts, is K zeros). Connecting checks that the server tokenizes as the student (a probe line) and answers
    ``prompt_logprobs`` of ``top_k`` (its ``--max-logprobs``); every request is bounded as :class:`ServerClient`'s.

    Args:
        base_url: the teacher's server, ``http://host:port``.
        tokenizer: the student's tokenizer (the teacher must share it).
        top_k: K, the teacher's top-K support (``loss_top_k``).
        timeout: seconds to wait for the server, and for any one request.
        vocab_size: the student's vocabulary (the tokenizer's length): an id at or beyond it is a named error.
    """

    def __init__(self, base_url: str, tokenizer, *, top_k: int, timeout: float = 240.0, vocab_size: int | None = None):
        self.tokenizer, self.top_k, self.vocab_size = tokenizer, top_k, vocab_size
        self.client = ServerClient(base_url, timeout)
        self.client.wait_until_up(timeout, TEACHER_COMMAND, "teacher_model_server_url")
        self.served_model = self.client.request("/v1/models")["data"][0]["id"]
        served = self.client.request(
            "/tokenize", {"model": self.served_model, "prompt": PROBE, "add_special_tokens": False}
        ).get("tokens")
        ours = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        if served != ours:
            raise ServerError(
                f"hfacc: the teacher's vLLM server at {base_url} tokenizes with another vocabulary than the student's "
                f"({PROBE!r} is {(served or [])[:8]}... there, {ours[:8]}... here): distillation needs a teacher that "
                "shares the student's tokenizer."
            )
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hfacc-teacher-server")
        self.request_rows(ours)  # the server answers prompt_logprobs of top_k (or says why not, here)

    def request_rows(self, ids: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """``(ids, logprobs)``: one ``[K]`` list per token of ``ids`` (the layout above)."""
        body = {
            "model": self.served_model, "prompt": list(ids), "max_tokens": 1, "n": 1, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "seed": 0, "prompt_logprobs": self.top_k,
        }  # fmt: skip
        try:
            answer = self.client.request("/v1/completions", body)
        except ServerError as err:
            if "logprobs" not in str(err) or "HTTP 4" not in str(err):
                raise
            raise ServerError(
                f"hfacc: the teacher's vLLM server does not return {self.top_k} prompt log-probs per token (its "
                f"--max-logprobs is lower): restart it with --max_logprobs {self.top_k} or more, or lower loss_top_k."
            ) from None
        rows = answer["choices"][0].get("prompt_logprobs")
        if rows is None or len(rows) != len(ids):
            raise ServerError(
                f"hfacc: the teacher's vLLM server answered {None if rows is None else len(rows)} prompt log-prob rows "
                f"for {len(ids)} tokens: serve the teacher with vLLM's OpenAI server (hfacc vllm-serve)."
            )
        k = self.top_k
        out_ids, out_logps = [[0] * k], [[0.0] * k]
        for t, row in enumerate(rows[1:], start=1):
            # the K likeliest, by vLLM's rank; the prompt's own token is there too when it ranks below K
            entries = sorted(((v["rank"], -v["logprob"], int(i)) for i, v in row.items()))[:k]
            if len(entries) < k or entries[-1][0] > k:
                raise ServerError(
                    f"hfacc: the teacher's vLLM server gave {len(entries)} of the top {k} log-probs at token {t}: "
                    f"restart it with --max_logprobs {k} or more."
                )
            out_ids.append([i for _, _, i in entries])
            out_logps.append([-lp for _, lp, _ in entries])
        if self.vocab_size is not None and any(i >= self.vocab_size for row in out_ids for i in row):
            raise ServerError(
                f"hfacc: the teacher's vLLM server returned token ids beyond the student's vocabulary "
                f"({self.vocab_size} tokens): serve a teacher that shares the student's tokenizer."
            )
        return out_ids, out_logps

    def add_rows(self, rows: list[dict]) -> None:
        """Give each SFT row (``input_ids``) the teacher's ``target_token_ids`` / ``target_logprobs``, the requests
        sent together."""
        answers = list(self.pool.map(lambda row: self.request_rows(row["input_ids"]), rows))
        for row, (ids, logps) in zip(rows, answers, strict=True):
            row["target_token_ids"], row["target_logprobs"] = ids, logps

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["ServedTeacher", "ServerClient", "ServerEngine", "ServerError", "START_COMMAND", "TEACHER_COMMAND"]
