"""The no_sync check can fail: on a ``no_sync`` that still all-reduces it raises, while the final
gradients alone (which equal one batch either way, the average being linear) would have passed.

One launch of 2 ranks runs the accumulation twice, with the real ``no_sync`` and with a broken one.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from d2lpar.infra.check import CheckFailed, check_close
from d2lpar.processes.launch import launch
from d2lpar.strategies.data.accumulation import accumulate_worker, check_no_sync
from d2lpar.strategies.data.ddp import TiedToy

MICRO, N = 3, 12  # per rank: 3 micro-batches of 2 samples out of a global batch of 12


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 32, (N, 5), generator=g), torch.randint(0, 32, (N,), generator=g)


def _both_ways():
    import torch.distributed as dist

    from d2lpar.strategies.data import ddp as ddp_module
    rank, n = dist.get_rank(), N // 2
    ids, y = _data()
    mine = ids[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    out = {"real": accumulate_worker(TiedToy(seed=rank), *mine, micro=MICRO, cap_mb=0.0001)}
    real_no_sync = ddp_module.DDP.no_sync

    @contextlib.contextmanager
    def still_syncs(self):  # the broken mechanism: a no_sync that changes nothing
        yield

    ddp_module.DDP.no_sync = still_syncs
    try:
        out["broken"] = accumulate_worker(TiedToy(seed=rank), *mine, micro=MICRO, cap_mb=0.0001)
    finally:
        ddp_module.DDP.no_sync = real_no_sync
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_both_ways, 2, timeout=120)


@pytest.fixture(scope="module")
def expected():
    model = TiedToy(seed=0)
    nn.functional.cross_entropy(model(_data()[0]), _data()[1]).backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def test_the_check_passes_on_the_real_no_sync(runs, expected):
    check_no_sync([r["real"] for r in runs], expected, MICRO)


def test_the_check_fails_on_a_no_sync_that_still_all_reduces(runs, expected):
    broken = [r["broken"] for r in runs]
    for r in broken:  # the old check, final gradients == one batch, cannot tell
        check_close("broken no_sync, final gradients == one batch", r["grads"], expected)
    assert broken[0]["allreduces inside"] == (MICRO - 1) * broken[0]["buckets"]
    with pytest.raises(CheckFailed, match="inside no_sync"):
        check_no_sync(broken, expected, MICRO)


def test_bad_micro_batches_are_refused():
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        accumulate_worker(TiedToy(), *_data(), micro=1)
