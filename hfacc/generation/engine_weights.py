"""Weights from the trainer to a vLLM server, behind vLLM's own weight-transfer interface.

vLLM 0.32's server takes a policy's new weights through its RL routes (``VLLM_SERVER_DEV_MODE=1``):
``/init_weight_transfer_engine`` once, then per update ``/start_weight_update``, ``/update_weights`` (one or more
chunks), ``/finish_weight_update`` with the ``weight_version`` it now holds, read back from ``/weight_info``. The
transport behind ``/update_weights`` is a *weight-transfer engine* chosen by ``--weight-transfer-config
'{"backend": ...}'``. vLLM's own backends move the tensors over NCCL or CUDA IPC: GPUs only (its NCCL communicator
does nothing on a CPU). On GPUs use them (TRL's server mode does, over NCCL). Where none of them runs (a CPU), hfacc
registers the smallest transport that does, under vLLM's factory (``WeightTransferEngineFactory.register_engine``)
and behind the same routes: **loopback**, the tensors' bytes inside the ``/update_weights`` body itself (base64, in
chunks), loaded by vLLM's layer-wise reload exactly as its IPC backend loads its own (``model.load_weights`` between
``initialize_layerwise_reload`` and ``finalize_layerwise_reload``, which re-packs the CPU kernels' weights).

The server loads this module through ``--worker-extension-cls hfacc.generation.engine_weights.LoopbackWorkerExtension``
(what ``hfacc vllm-serve`` passes): importing it in the worker registers the backend before vLLM builds the engine.

The handshake also checks that the server serves the policy's model: ``init_info`` carries the policy's
:func:`get_model_signature` (architecture, vocabulary, sizes), compared with the served model's config.
"""

from __future__ import annotations

import base64
import copy
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..models.reference import iter_full_parameters, sharded_engine, unwrap_model
from ..ops.model_io import get_base_model

BACKEND = "hfacc_loopback"
WORKER_EXTENSION = f"{__name__}.LoopbackWorkerExtension"
CHUNK_BYTES = 32 << 20  # one /update_weights body holds at most this many tensor bytes (before base64)
SIGNATURE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def get_engine_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights as the engine loads them: ``(checkpoint name, whole tensor)`` of every parameter and
    persistent buffer, in the names of the architecture's own checkpoints.

    Wrappers (DDP, DeepSpeed, torch.compile, activation checkpointing) are removed; ZeRO-3 and FSDP2 parameters are
    gathered one at a time (a collective: every rank calls this together); a PEFT model's adapters are merged into the
    base weights for the copy and unmerged right after, and the adapters' own entries are left out.
    """
    policy = unwrap_model(model)
    peft = callable(getattr(policy, "merge_adapter", None))
    base = get_base_model(policy)
    if peft and sharded_engine(base) is not None:
        raise NotImplementedError(
            "hfacc: vLLM with a PEFT policy sharded by ZeRO-3 or FSDP2 is not supported (merging the adapters needs "
            "the whole base weights on every rank); use DDP or ZeRO-2 for a LoRA policy."
        )
    if peft:
        policy.merge_adapter()
    try:
        whole = {}
        for name, tensor in iter_full_parameters(base):
            whole[name] = tensor.detach().clone()  # a gathered shard is released after this step
        # Tied weights under every name (an output layer tied to the embeddings too), as a checkpoint has them.
        first, weights = {}, []
        for name, p in base.named_parameters(remove_duplicate=False):
            weights.append((name, whole[first.setdefault(id(p), name)]))
        names = {name for name, _ in weights}
        for name, tensor in base.state_dict().items():
            if name not in names:  # persistent buffers
                weights.append((name, tensor.detach().clone()))
        weights = [(get_checkpoint_name(n), t) for n, t in weights]
        weights = [(n, t) for n, t in weights if n is not None]
    finally:
        if peft:
            policy.unmerge_adapter()
    return weights


def get_checkpoint_name(name: str) -> str | None:
    """A parameter's name in the architecture's checkpoints (None: an adapter's own entry, not sent).

    >>> get_checkpoint_name("model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> get_checkpoint_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.lora_A.default.weight") is None
    True
    """
    if ".lora_" in name or ".original_module." in name or name.startswith("lora_"):
        return None
    for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def get_architecture(model: nn.Module) -> type:
    """The model's own class (FSDP2's ``fully_shard`` makes it ``FSDP<Class>``, a subclass of it)."""
    cls = type(get_base_model(unwrap_model(model)))
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def get_expected_weights(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The checkpoint names and shapes of ``model``'s architecture, from an empty copy on the meta device: what a
    weight copy must hold, exactly, before it reaches the engine."""
    base = get_base_model(unwrap_model(model))
    with torch.device("meta"):
        empty = get_architecture(base)(copy.deepcopy(base.config))
    expected = {n: tuple(p.shape) for n, p in empty.named_parameters(remove_duplicate=False)}
    for name, tensor in empty.state_dict().items():
        expected.setdefault(name, tuple(tensor.shape))  # persistent buffers
    return expected


def check_engine_weights(weights: Sequence[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming the first weight whose name or shape is not the architecture's (or is missing)."""
    got = {}
    for name, tensor in weights:
        if name not in expected:
            raise ValueError(f"hfacc: the policy's weight {name!r} is not a weight of its architecture.")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"hfacc: the policy's weight {name!r} has shape {tuple(tensor.shape)}, its architecture's "
                f"{expected[name]}."
            )
        got[name] = tensor
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"hfacc: the policy's weights lack {missing[:3]} (of {len(missing)}) of its architecture.")


def get_model_signature(config) -> dict:
    """What a served model must share with the policy for its weights to fit: the config's architecture and sizes.

    >>> from transformers import LlamaConfig
    >>> get_model_signature(LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=1))["vocab_size"]
    100
    """
    signature = {key: getattr(config, key, None) for key in SIGNATURE_KEYS}
    if signature["num_key_value_heads"] is None:
        signature["num_key_value_heads"] = signature["num_attention_heads"]
    return signature


def compare_signatures(served: dict, policy: dict) -> str | None:
    """The first difference between the served model's signature and the policy's, said as one clause (None: same).

    >>> compare_signatures({"vocab_size": 100}, {"vocab_size": 120})
    'vocab_size 100 on the server, 120 in the policy'
    """
    for key, value in policy.items():
        if served.get(key) != value:
            return f"{key} {served.get(key)} on the server, {value} in the policy"
    return None


def another_model_message(difference: str) -> str:
    """The server's refusal of a policy whose signature differs (:func:`compare_signatures`' clause)."""
    return (
        f"hfacc: this vLLM server serves another model than the trainer's policy ({difference}): start it with the "
        "policy's model (hfacc vllm-serve --model <the policy's directory>)."
    )


def encode_weights(weights: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int = CHUNK_BYTES) -> list[dict]:
    """``(name, tensor)`` pairs as the JSON chunks of ``/update_weights`` (each at most ``chunk_bytes`` of tensor
    data, one tensor at least): names, dtypes, shapes and the bytes, base64.

    >>> chunks = encode_weights([("w", torch.ones(2, 3)), ("b", torch.zeros(3))])
    >>> [(n, t.tolist()) for n, t in decode_weights(chunks[0])][1]
    ('b', [0.0, 0.0, 0.0])
    """
    chunks, current, size = [], {"names": [], "dtypes": [], "shapes": [], "data": []}, 0
    for name, tensor in weights:
        data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        if current["names"] and size + len(data) > chunk_bytes:
            chunks.append(current)
            current, size = {"names": [], "dtypes": [], "shapes": [], "data": []}, 0
        current["names"].append(name)
        current["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
        current["shapes"].append(list(tensor.shape))
        current["data"].append(base64.b64encode(data).decode("ascii"))
        size += len(data)
    if current["names"]:
        chunks.append(current)
    return chunks


def decode_weights(chunk: dict) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one :func:`encode_weights` chunk."""
    weights = []
    for name, dtype, shape, data in zip(chunk["names"], chunk["dtypes"], chunk["shapes"], chunk["data"], strict=True):
        raw = bytearray(base64.b64decode(data))
        kind = getattr(torch, dtype)
        tensor = torch.frombuffer(raw, dtype=kind) if raw else torch.empty(0, dtype=kind)
        weights.append((name, tensor.reshape(shape)))
    return weights


@dataclass
class LoopbackInitInfo:
    """``init_info`` of ``/init_weight_transfer_engine``: the policy's :func:`get_model_signature`."""

    signature: dict = field(default_factory=dict)


@dataclass
class LoopbackUpdateInfo:
    """``update_info`` of ``/update_weights``: one :func:`encode_weights` chunk."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    data: list[str] = field(default_factory=list)


def build_engine_class() -> type:
    """The loopback backend as a subclass of vLLM's ``WeightTransferEngine`` (vLLM imported here, in the server)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class LoopbackWeightTransferEngine(WeightTransferEngine[LoopbackInitInfo, LoopbackUpdateInfo]):
        """vLLM weight-transfer backend ``hfacc_loopback``: the tensors arrive inside the update request."""

        init_info_cls = LoopbackInitInfo
        update_info_cls = LoopbackUpdateInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info: LoopbackInitInfo) -> None:
            served = get_model_signature(self.model_config.hf_config)
            difference = compare_signatures(served, init_info.signature)
            if difference is not None:
                raise ValueError(another_model_message(difference))

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: LoopbackUpdateInfo) -> None:
            self.model.load_weights(decode_weights(vars(update_info)))

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    return LoopbackWeightTransferEngine


def register_backend() -> None:
    """Register ``hfacc_loopback`` with vLLM's ``WeightTransferEngineFactory`` (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, build_engine_class())


class LoopbackWorkerExtension:
    """vLLM's ``--worker-extension-cls``: naming it makes vLLM import this module in its worker, which registers the
    backend there (below) before the worker builds its weight-transfer engine. It adds no method to the worker."""


if "vllm" in sys.modules:  # imported by a vLLM worker (--worker-extension-cls): the backend must exist there
    register_backend()

__all__ = [
    "BACKEND",
    "check_engine_weights",
    "get_architecture",
    "get_checkpoint_name",
    "get_engine_weights",
    "get_expected_weights",
    "WORKER_EXTENSION",
    "another_model_message",
    "compare_signatures",
    "decode_weights",
    "encode_weights",
    "get_model_signature",
    "register_backend",
]
