"""sha256 of checkpoint files as they are written, not read back afterwards.

Inside :func:`hashing_writes`, ``torch.save`` (the Trainer's optimizer, scheduler, scaler and RNG states, DeepSpeed's
shards) writes through a file object that hashes the bytes it passes on, and each safetensors file (the model, a
PEFT adapter) is hashed right after it is written: its header (a few KB) read back, then its tensors from memory in
the order of their offsets, which is the file's layout (the format leaves no gaps). No large file is read twice;
the cost is one sha256 pass over the bytes written (about 1 GB/s on one CPU core) and, for tensors on an
accelerator, one more copy of each to the host while it is hashed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class _HashingFile:
    """A binary file that hashes the bytes written through it (``torch.save`` writes a file object by ``write``)."""

    def __init__(self, raw):
        self.raw, self.sha = raw, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.raw.write(data)

    def flush(self) -> None:
        self.raw.flush()


def _hash_safetensors(tensors: Mapping[str, Any], filename: str) -> str | None:
    """sha256 of the safetensors file just written from ``tensors``: its header (read back, a few KB), then each
    tensor's bytes from memory in the order of their offsets. The format stores exactly that, without gaps; a file
    of another size than that sum is hashed from disk instead (None here)."""
    import torch

    with open(filename, "rb") as f:
        head = f.read(8)
        header_bytes = f.read(int.from_bytes(head, "little"))
    header = json.loads(header_bytes)
    order = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    if 8 + len(header_bytes) + (order[-1][0][1] if order else 0) != os.path.getsize(filename):
        return None
    sha = hashlib.sha256(head + header_bytes)
    for _, name in order:
        tensor = tensors[name].detach().cpu().contiguous().reshape(-1)
        sha.update(tensor.view(torch.uint8).numpy())
    return sha.hexdigest()


# Where the Trainer, transformers and PEFT reach safetensors' writer (each imported the function by its own name).
_SAFETENSORS_WRITERS = (
    ("safetensors.torch", "save_file"),
    ("transformers.modeling_utils", "safe_save_file"),
    ("peft.peft_model", "safe_save_file"),
)


@contextlib.contextmanager
def hashing_writes() -> Iterator[dict[str, str]]:
    """Inside the block, every file ``torch.save`` or safetensors writes gets a sha256 computed as it is written.

    Yields ``{absolute path: sha256}``, filled as files are written. The functions are swapped back on exit.
    """
    import torch

    digests: dict[str, str] = {}
    torch_save = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return torch_save(obj, f, *args, **kwargs)
        with open(f, "wb") as raw:
            out = _HashingFile(raw)
            torch_save(obj, out, *args, **kwargs)
        digests[os.path.abspath(f)] = out.sha.hexdigest()

    swapped = [(torch, "save", torch_save)]
    for module_name, attribute in _SAFETENSORS_WRITERS:
        module = sys.modules.get(module_name)
        original = getattr(module, attribute, None)
        if original is None:
            continue

        def save_file(tensors, filename, metadata=None, _original=original):
            _original(tensors, filename, metadata=metadata)
            digest = _hash_safetensors(tensors, str(filename))
            if digest is not None:
                digests[os.path.abspath(filename)] = digest

        swapped.append((module, attribute, original))
        setattr(module, attribute, save_file)
    torch.save = save
    try:
        yield digests
    finally:
        for module, attribute, original in swapped:
            setattr(module, attribute, original)


def hash_file(path: str | Path) -> str:
    """sha256 of the file at ``path``, read in 4 MiB blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**22), b""):
            sha.update(block)
    return sha.hexdigest()


def relative_digests(digests: Mapping[str, str], checkpoint: str | Path) -> dict[str, str]:
    """``digests`` of the files inside ``checkpoint``, keyed by their path in it (as every rank can name them)."""
    root = os.path.abspath(checkpoint)
    return {os.path.relpath(p, root): d for p, d in digests.items() if p.startswith(root + os.sep)}
