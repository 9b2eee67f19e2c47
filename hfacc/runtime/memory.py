"""Peak memory of a piece of work, on CPU (PyTorch profiler allocation events) or CUDA (allocator statistics)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch


def peak_memory(fn: Callable[[], object], device: str = "cpu") -> int:
    """Highest number of bytes allocated at once while ``fn()`` runs, above what was allocated before it.

    On CUDA this is ``torch.cuda.max_memory_allocated``. On CPU, where PyTorch keeps no such statistic, the
    profiler records every allocation and free; their running sum, in time order, peaks at the answer.

    >>> peak_memory(lambda: torch.empty(1024, 1024)) >= 4 * 2**20
    True
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr():
    # The profiler's native layer prints start/stop lines straight to file descriptor 2.
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
