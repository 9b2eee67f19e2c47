"""A stand-in for ``hfacc vllm-serve`` in this process (the main suite has no vLLM): vLLM's routes that
:class:`hfacc.generation.server_engine.ServerEngine` calls, answered by a copy of the policy with transformers.

It holds its own copy of the model, loads the weights the trainer sends (the loopback chunks, decoded by hfacc's own
:func:`decode_weights`), keeps the weight version it was given, and samples with ``generate`` under each request's
seed, returning each sampled token's log-prob under ``logits / temperature``. Faults on demand: ``vocabulary_shift``
(another tokenizer), ``signature`` (another model), ``dev_mode=False`` (no RL routes), ``max_model_len``.
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from hfacc.generation.engine import TransformersEngine
from hfacc.generation.engine_weights import (
    another_model_message,
    compare_signatures,
    decode_weights,
    get_model_signature,
)


class FakeVLLMServer:
    """``with FakeVLLMServer(model, tokenizer) as server: ... server.url``; ``server.stop()`` kills it mid-run."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_model_len=512,
        vocabulary_shift=0,
        signature=None,
        dev_mode=True,
        max_logprobs=20,
    ):
        self.model = copy.deepcopy(model).eval()
        self.tokenizer, self.max_model_len, self.shift = tokenizer, max_model_len, vocabulary_shift
        self.signature = {**get_model_signature(model.config), **(signature or {})}
        self.dev_mode, self.version, self.lock = dev_mode, None, threading.Lock()
        self.max_logprobs = max_logprobs  # vLLM's --max-logprobs (its default 20)
        self.completion_requests = 0  # /v1/completions answered
        self.updates = 0  # weight updates finished
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    # ---- the routes -------------------------------------------------------------------------------------------------
    def route(self, method: str, path: str, body: dict | None):
        """``(status, answer)`` of one request."""
        rl = ("/weight_info", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
              "/finish_weight_update", "/reset_prefix_cache", "/update_weight_version", "/pause", "/resume")  # fmt: skip
        if path in rl and not self.dev_mode:
            return 404, {"detail": "Not Found"}
        if path == "/health":
            return 200, None
        if path == "/v1/models":
            return 200, {"data": [{"id": "fake", "max_model_len": self.max_model_len}]}
        if path == "/tokenize":
            ids = self.tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]
            return 200, {"tokens": [i + self.shift for i in ids]}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/init_weight_transfer_engine":
            difference = compare_signatures(self.signature, body["init_info"]["signature"])
            if difference is not None:
                return 500, {"error": {"message": another_model_message(difference)}}
            return 200, {"message": "Weight transfer initialized"}
        if path == "/update_weights":
            with self.lock, torch.no_grad():
                params = dict(self.model.named_parameters(remove_duplicate=False))
                for name, tensor in decode_weights(body["update_info"]):
                    if name in params:
                        params[name].copy_(tensor)
            return 200, {"message": "Weights updated"}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True}
        if path == "/finish_weight_update":
            self.version, self.updates = body.get("weight_version"), self.updates + 1
            return 200, {"message": "Weight update finished"}
        if path in ("/start_weight_update", "/reset_prefix_cache", "/pause", "/resume"):
            return 200, {}
        if path == "/v1/completions":
            wanted = body.get("prompt_logprobs")
            if wanted is not None and wanted > self.max_logprobs:
                message = (
                    f"Requested prompt logprobs of {wanted}, which is greater than max allowed: {self.max_logprobs}"
                )
                return 400, {"error": {"message": message}}
            answer = self.complete(body)
            if wanted is not None:
                answer["choices"][0]["prompt_logprobs"] = self.prompt_logprobs(body["prompt"], wanted)
            return 200, answer
        return 404, {"detail": "Not Found"}

    def prompt_logprobs(self, prompt: list[int], k: int) -> list:
        """vLLM's ``prompt_logprobs``: None, then per token t >= 1 its top-k and the token itself, ``{id: {logprob,
        rank, decoded_token}}`` (raw log-softmax, temperature 1)."""
        with self.lock, torch.no_grad():
            logps = self.model(input_ids=torch.tensor([list(prompt)])).logits[0, :-1].float().log_softmax(-1)
        rows = [None]
        for t, row in enumerate(logps, start=1):
            top = row.topk(k)
            entry = {str(int(i)): {"logprob": float(v), "rank": r + 1, "decoded_token": ""}
                     for r, (v, i) in enumerate(zip(top.values, top.indices, strict=True))}  # fmt: skip
            token = int(prompt[t])
            if str(token) not in entry:
                rank = int((row > row[token]).sum()) + 1
                entry[str(token)] = {"logprob": float(row[token]), "rank": rank, "decoded_token": ""}
            rows.append(entry)
        return rows

    def complete(self, body: dict) -> dict:
        from hfacc.generation.engine import SamplingSettings

        temperature = body["temperature"]
        settings = SamplingSettings(body["max_tokens"], max(temperature, 1e-5), body["top_p"], max(body["top_k"], 0))
        prompt = body["prompt"]
        with self.lock:
            self.completion_requests += 1
            engine = TransformersEngine(self.model, self.tokenizer)
            if temperature == 0:
                samples = engine.answer([prompt], body["max_tokens"])
                completions, truncated = samples, [len(samples[0]) >= body["max_tokens"]]
            else:
                out = engine.sample([prompt] * body["n"], settings, seed=body["seed"])
                completions, truncated = out.completion_ids, out.truncated
            choices = []
            for i, (ids, cut) in enumerate(zip(completions, truncated, strict=True)):
                with torch.no_grad():
                    x = torch.tensor([list(prompt) + list(ids)])
                    logits = self.model(input_ids=x).logits[0, len(prompt) - 1 : -1].float() / max(temperature, 1e-5)
                    logps = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist() if ids else []
                choices.append(
                    {"index": i, "token_ids": ids, "finish_reason": "length" if cut else "stop",
                     "logprobs": {"token_logprobs": logps}}
                )  # fmt: skip
        return {"choices": choices}

    def handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def answer(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                status, answer = server.route(method, self.path.split("?")[0], body)
                data = b"" if answer is None else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self.answer("GET")

            def do_POST(self):
                self.answer("POST")

        return Handler
