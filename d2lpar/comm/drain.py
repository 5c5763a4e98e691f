"""Ending asynchronous collectives for good: wait for each work, drop it, and let gloo let go.

``dist.all_reduce(t, async_op=True)`` hands ``t`` to one of gloo's worker threads, which holds the
work (and so ``t``) until a moment *after* ``work.wait()`` returns in the caller. If Python drops
its last reference to ``t`` first, torch keeps ``t``'s Python object alive for the thread, and the
thread must take the GIL to free it. Should the interpreter be shutting down by then, taking the
GIL ends the thread inside a C++ destructor and the process aborts: "terminate called without
an active exception" (pytorch/pytorch#117762). A core dump of one such abort, taken on this
course's machine, shows just that: the thread in ``ProcessGroupGloo::runLoop`` freeing an
``AsyncAllreduceWork`` (``TensorImpl::decref_pyobject``, ``take_gil``, ``PyThread_exit_thread``)
while the main thread is in ``Py_FinalizeEx``; ``python -m d2lpar bench ddp --exit-aborts 100
--pinned --no-drain`` counts such aborts. So, for tensors a collective may still hold: wait, drop
the works, then ``let_go`` before dropping the tensors.

A process usually does not get there, because ``destroy_process_group`` ends gloo's threads. But
torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default, read when
that module is first imported (torch._dynamo imports it, and torch.optim's first step imports
torch._dynamo): imported after ``init_process_group``, those defaults keep the group, and its
threads, alive until the interpreter's shutdown. Importing this module imports it, so a script that
imports the course's DDP before creating its group never pins it.

Ranks started by ``d2lpar.processes.launch`` never shut an interpreter down: the launcher closes
their group, and the forkserver ends each of them with ``os._exit`` (multiprocessing/forkserver.py),
so there the abort cannot happen. Scripts can: under torchrun or ``mp.spawn`` each rank ends
through the interpreter's shutdown.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.distributed.nn.functional  # noqa: F401  (see the docstring: before any group exists)

__all__ = ["held_elsewhere", "let_go", "drain"]


def held_elsewhere(tensor: torch.Tensor) -> bool:
    """True when something besides its Python object holds ``tensor``: a collective's work that a
    gloo thread has not yet let go of, or a view of it (False where torch cannot say)."""
    count = getattr(tensor, "_use_count", None)   # the C++ tensor's reference count
    return count is not None and count() > 1


def let_go(tensors: Iterable[torch.Tensor], timeout: float = 2.0) -> bool:
    """Wait until no CPU tensor of ``tensors`` is held elsewhere; False if one still is at the
    timeout. Call it after waiting for the works and dropping them (a work holds its tensors)."""
    cpu = [t for t in tensors if t.device.type == "cpu"]   # gloo's; NCCL's works end otherwise
    deadline = time.monotonic() + timeout
    while any(held_elsewhere(t) for t in cpu):
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)
    return True


def drain(works: list, tensors: Iterable[torch.Tensor], timeout: float = 2.0) -> bool:
    """Wait for every work in ``works``, emptying the list as it goes (the caller's references
    go; no loop variable keeps the last one), then ``let_go(tensors)``."""
    while works:
        works.pop(0).wait()
    return let_go(tensors, timeout)
