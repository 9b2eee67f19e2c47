"""A rank that ran gloo collectives exits 0 when its work is done: no SIGABRT while gloo's threads free tensors.

Without hfacc/runtime/shutdown.py, the script below (it exits straight after its last all_reduce) aborted on 9 of 20
two-process launches here ("terminate called without an active exception"); CI lost two runs to the same race.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hfacc.runtime import shutdown
from tests.helpers import ROOT, free_port

EXITS_AFTER_ITS_LAST_COLLECTIVE = textwrap.dedent(
    """
    import hfacc  # registers the wait at exit
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    for _ in range(50):
        t = torch.ones(3)
        dist.all_reduce(t)  # each one's tensor is freed by a gloo thread, after this rank moved on
    del t
    """
)


def test_ranks_that_exit_straight_after_a_collective_do_not_abort(tmp_path):
    script = tmp_path / "exits.py"
    script.write_text(EXITS_AFTER_ITS_LAST_COLLECTIVE)
    failed = []
    for _ in range(8):  # without the wait, all 8 launches pass with probability 0.55**8 < 1%
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        cmd += ["--master_port", str(free_port()), str(script)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            failed.append(proc.stderr[-1500:])
    assert not failed, failed[0]


def test_the_wait_sees_gloo_workers_and_returns_once_they_are_idle(tmp_path):
    import torch
    import torch.distributed as dist

    if not shutdown._gloo_workers() == {}:
        pytest.skip("another test left a gloo group in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for _ in range(20):
            dist.all_reduce(torch.ones(3))
        workers = shutdown._gloo_workers()
        assert workers, "a gloo group has worker threads named pt_gloo_runloop"
        assert shutdown.wait_for_collective_threads(timeout_s=5.0) is True
        futex = shutdown._FUTEX_BY_MACHINE.get(__import__("os").uname().machine)
        if futex is not None:
            assert all(shutdown._is_idle(state, futex) for state in shutdown._gloo_workers().values())
    finally:
        dist.destroy_process_group()
    # a worker waiting for the GIL (a timed futex wait) or running is not idle; one on its queue with no timeout is
    assert shutdown._is_idle("202 0x55c803c429a0 0x189 0x0 0x0 0x0 0xffffffff 0x7f6dd6f12d10 0x7f6df68a3f16", "202")
    assert not shutdown._is_idle("202 0x7f00aa 0x189 0x0 0x7f6dd6f12c80 0x0 0xffffffff 0x7f6dd 0x7f6df", "202")
    assert not shutdown._is_idle("running", "202")
