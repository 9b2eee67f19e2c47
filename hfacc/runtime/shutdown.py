"""A process that used torch's gloo collectives must not finalize while gloo's worker threads still free tensors.

Why (seen in CI: 2 two-process launches of ~40 in one run aborted after their work was done, torchrun reported them
failed): a gloo worker thread ("pt_gloo_runloop") frees a finished collective's tensors *after* the rank that waited
on it has moved on, and freeing a tensor made in Python takes the GIL. A thread that asks for the GIL once the
interpreter is finalizing is ended by CPython (``pthread_exit``) inside a C++ destructor: ``std::terminate``,
"terminate called without an active exception", SIGABRT. ``destroy_process_group`` joins those threads only when
nothing else holds the group (a prepared DDP model or a Trainer does), so it narrows the window without closing it.
A script that exits straight after its last ``all_reduce`` aborted on 9 of 20 two-process launches (torch 2.13).

The fix waits, before the interpreter finalizes (an ``atexit`` function runs before CPython starts finalizing), until
every gloo worker is idle. An idle worker waits on its queue's condition variable with no timeout; one waiting for
the GIL waits with a timeout (CPython's ``take_gil``), and one still working is running: Linux's
``/proc/self/task/<tid>/syscall`` tells them apart. Where it cannot say, the wait sleeps briefly instead, which
hands the GIL to a waiting worker.

Standard library only. ``import hfacc`` registers the wait at exit, which imports this module only then.
"""

from __future__ import annotations

import os
import sys
import time

_WORKER = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
# futex's syscall number on each machine /proc reports for (/proc's syscall file starts with the number)
_FUTEX_BY_MACHINE = {"x86_64": "202", "aarch64": "98"}


def _gloo_workers() -> dict[str, str | None] | None:
    """Each gloo worker thread of this process: its id -> what /proc says it is blocked in (None if unreadable);
    None when /proc cannot list the threads (not Linux)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    workers: dict[str, str | None] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != _WORKER:
                    continue
        except OSError:
            continue
        try:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                workers[tid] = f.read().strip()
        except OSError:
            workers[tid] = None
    return workers


def _is_idle(syscall: str, futex: str) -> bool:
    """True for a worker blocked on its work queue: a futex wait with no timeout (``std::condition_variable::wait``).

    /proc's format is ``nr arg1 .. arg6 sp pc``; a futex's 4th argument is its timeout. Waiting for the GIL is a timed
    wait, and a worker that is running reads "running".
    """
    fields = syscall.split()
    return len(fields) >= 5 and fields[0] == futex and fields[4] in ("0x0", "0")


def wait_for_collective_threads(timeout_s: float = 5.0, grace_s: float = 0.2) -> bool:
    """Wait (with the GIL released) until gloo's worker threads are idle; True if they are, or there are none.

    Returns False after ``timeout_s`` (a worker stuck in a collective a peer never joins), and after ``grace_s`` of
    plain sleep where /proc cannot tell an idle worker from a busy one (not Linux, or the files are unreadable).
    """
    if "torch" not in sys.modules:  # no collective ever ran in this process
        return True
    futex = _FUTEX_BY_MACHINE.get(os.uname().machine)
    deadline = time.monotonic() + timeout_s
    while True:
        workers = _gloo_workers()
        if workers is not None and not workers:
            return True
        if workers is None or futex is None or any(state is None for state in workers.values()):
            time.sleep(grace_s)
            return False
        if all(_is_idle(state, futex) for state in workers.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)  # hands the GIL to a worker waiting for it
