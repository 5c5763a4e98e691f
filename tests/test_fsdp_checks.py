"""The checks notebook 13 makes about FSDP2 fail on broken mechanisms and pass on the real ones.

* bf16 against fp32: the old check (``atol=0.05``) passes a run that never trained; the movement
  check fails it, fails steps twice too long and an fp32 run passed off as bf16, and passes bf16.
* accumulation: a ``set_requires_gradient_sync`` that does nothing (every micro-batch reduces) fails
  the check; the real one passes it. ZeroRedundancyOptimizer's 1.5x is checked in the notebook.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.infra.check import CheckFailed
from d2lpar.processes.launch import launch
from d2lpar.strategies.sharded import fsdp_checks as C


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 17), nn.ReLU(), nn.Linear(17, 4))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(24, 10, generator=g), torch.randint(0, 4, (24,), generator=g))
            for _ in range(3)]


def train(lr=1e-2, bf16=False, steps=3):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    for X, y in batches()[:steps]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.cross_entropy(net(X), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_mixed_precision_check_fails_where_atol_did_not():
    start, fp32 = model().state_dict(), train()
    never = {k: v.clone() for k, v in start.items()}
    assert all(torch.allclose(never[k], fp32[k], rtol=0, atol=0.05) for k in fp32)  # the old check
    assert C.movement_error(never, fp32, start) == pytest.approx(1.0)
    for broken in (never, train(lr=2e-2), fp32):  # never trained, steps twice too long, not bf16
        with pytest.raises(CheckFailed, match="bf16 differs from fp32"):
            C.check_mixed_precision(broken, fp32, start)
    assert 0 < C.check_mixed_precision(train(bf16=True), fp32, start) < 0.35
    with pytest.raises(ValueError, match="did not move"):
        C.movement_error(fp32, start, start)


def _accumulate(sync_works):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from d2lpar.strategies.tensor.mappings import torch_counts
    net = model()
    for layer in net[::2]:
        fully_shard(layer)
    fully_shard(net)
    if not sync_works:  # broken: the switch does nothing, every micro-batch reduces
        net.set_requires_gradient_sync = lambda flag: None
    X, y = batches()[0]
    X, y = X.chunk(2)[dist.get_rank()], y.chunk(2)[dist.get_rank()]
    counts = []
    for i, part in enumerate((slice(0, 6), slice(6, 12))):
        net.set_requires_gradient_sync(i == 1)
        with CommDebugMode() as comm:
            nn.functional.cross_entropy(net(X[part]), y[part]).backward()
        counts.append(torch_counts(comm))
    return counts


def test_accumulation_check_fails_when_every_micro_batch_reduces():
    real, broken = (launch(_accumulate, 2, works, timeout=90)[0] for works in (True, False))
    C.check_accumulation(real, units=3)
    assert broken[0].get("reduce_scatter") == 3
    with pytest.raises(CheckFailed, match="no reduce-scatter in the first 1"):
        C.check_accumulation(broken, units=3)
    with pytest.raises(CheckFailed, match="once per unit"):
        C.check_accumulation(real, units=4)


def _handed(bf16):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    net = model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for layer in net[::2]:
        fully_shard(layer, mp_policy=policy)
    fully_shard(net, mp_policy=policy)
    X, y = batches()[0]
    with C.CollectiveDtypes() as comm:
        nn.functional.cross_entropy(net(X), y).backward()
    return comm.handed, {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


def test_collective_dtypes_reads_the_wire_not_the_compute():
    (fp32, counts), (bf16, _) = (launch(_handed, 2, b, timeout=90)[0] for b in (False, True))
    assert counts["_allgather_base_"] == len(fp32["_allgather_base_"]) // 2  # (output, input) each
    assert {d for d, _ in fp32["_allgather_base_"]} == {"float32"}
    assert {d for d, _ in bf16["_allgather_base_"]} == {"bfloat16"}
    assert sum(b for _, b in fp32["_allgather_base_"]) == 2 * sum(b for _, b in bf16["_allgather_base_"])
    assert {d for d, _ in bf16["_reduce_scatter_base_"]} == {"float32"}  # reduce_dtype
