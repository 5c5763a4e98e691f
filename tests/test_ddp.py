"""d2lpar's small DDP against one process and against torch's DDP, on gloo ranks.

The model (``TiedToy``) has a frozen layer and tied weights. Each rank starts from its *own* random
model (seed = rank), so the parameters differ before wrapping; after training they must match one
process trained on the whole batch, and they must have moved from where they started.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.infra.check import check_close
from d2lpar.processes.launch import RankFailed, launch
from d2lpar.strategies.data.ddp import DDP, TiedToy, _cap_bytes, assign_buckets

CAPS = {1: 25.0, 2: 0.002, 4: 0.0001}  # buckets -> bucket_cap_mb, for TiedToy
BATCH, STEPS, LR = 12, 3, 0.5


def batches(steps=STEPS, n=BATCH):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 32, (n, 5), generator=g), torch.randint(0, 32, (n,), generator=g))
            for _ in range(steps)]


@torch.no_grad()
def sgd(model):  # plain SGD: torch.optim would import torch's compiler in every process (seconds)
    for p in model.parameters():
        if p.grad is not None:
            p.add_(p.grad, alpha=-LR)
            p.grad = None


def one_process():
    model = TiedToy(seed=0)
    for ids, y in batches():
        nn.functional.cross_entropy(model(ids), y).backward()
        sgd(model)
    return model.state_dict()


def _train(wrapped, model, rank, world):
    n, first = BATCH // world, None
    for ids, y in batches():
        nn.functional.cross_entropy(wrapped(ids[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        first = first or {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        sgd(model)
    return {k: v.clone() for k, v in model.state_dict().items()}, first


def _names(model, params):
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def both_ddps():
    """For W = 2, 3, 4 (sub-groups of one 4-rank launch) and each cap: d2lpar's DDP and torch's."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank, out = dist.get_rank(), {}
    for world in (2, 3, 4):
        group = dist.new_group(list(range(world))) if world < 4 else None
        if rank >= world:
            continue
        for nb, cap in CAPS.items():
            start = TiedToy(seed=rank)
            mine = TiedToy(seed=rank)
            ours = DDP(mine, cap, process_group=group)
            theirs_model = TiedToy(seed=rank)
            theirs = TorchDDP(theirs_model, bucket_cap_mb=cap, process_group=group)
            out[world, nb] = {"start": start.state_dict(), "mine": _train(ours, mine, rank, world)[0],
                              "torch": _train(theirs, theirs_model, rank, world)[0],
                              "my_buckets": ours.bucket_names(),
                              "torch_buckets": [_names(theirs_model, b.parameters()) for b in
                                                theirs.reducer._get_zeros_like_grad_buckets()]}
        if world == 2:  # fp16 compression: ours against torch's hook
            for how, hook in (("fp16", default_hooks.fp16_compress_hook),
                              ("bf16", default_hooks.bf16_compress_hook)):
                mine, theirs_model = TiedToy(seed=rank), TiedToy(seed=rank)
                theirs = TorchDDP(theirs_model, bucket_cap_mb=0.002, process_group=group)
                theirs.register_comm_hook(group, hook)
                out[how] = {"mine": _train(DDP(mine, 0.002, compress=how, process_group=group),
                                           mine, rank, world),
                            "torch": _train(theirs, theirs_model, rank, world)}
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(both_ddps, 4, timeout=240)


def test_bucket_rule_equals_torch():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([4, 40, 400, 4000]) * rng.randint(1, 4) for _ in range(rng.randint(1, 12))]
        cap = rng.choice([1, 100, 1000, 5000, 10 ** 6])
        tensors = [torch.zeros(s // 4) for s in sizes]
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, [cap])
        assert assign_buckets(sizes, cap) == expected, (sizes, cap)
    with pytest.raises(ValueError, match="bucket_cap_mb > 0"):
        assign_buckets([4, 4], 0)
    for bad in (-1, float("nan"), float("inf"), "25"):
        with pytest.raises(ValueError, match=f"bucket_cap_mb={bad!r}"):
            DDP(nn.Linear(2, 2), bucket_cap_mb=bad)
    assert _cap_bytes(None) == _cap_bytes(25) == 25 * 2 ** 20   # torch's meaning of None


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("nb", sorted(CAPS))
def test_equal_to_one_process_and_to_torch(runs, world, nb):
    expected = one_process()
    frozen = TiedToy(seed=0).frozen.weight.detach()
    for rank in range(world):
        got = runs[rank][world, nb]
        assert len(got["my_buckets"]) == nb
        moved = max((got["start"][k] - got["mine"][k]).abs().max().item() for k in expected)
        assert moved > 1e-3, "training did not move the parameters"
        check_close(f"W={world}, {nb} bucket(s), rank {rank}: d2lpar DDP == one process", got["mine"], expected)
        check_close(f"W={world}, {nb} bucket(s), rank {rank}: d2lpar DDP == torch DDP", got["mine"], got["torch"])
        assert torch.equal(got["mine"]["frozen.weight"], frozen), "the frozen layer moved"
        assert got["my_buckets"] == got["torch_buckets"], "buckets differ from torch's rebuilt ones"


def test_compression_within_its_error(runs):
    model = TiedToy(seed=0)
    ids, y = batches(1)[0]
    nn.functional.cross_entropy(model(ids), y).backward()
    exact = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    # Each rank rounds g_r/W to the format and the sum is rounded once more, each rounding within
    # 2^-11 (fp16) or 2^-8 (bf16) of the value rounded; relative to a tensor's largest entry, the
    # error stays within 2^-9 (fp16) and 2^-6 (bf16).
    for how, bound in (("fp16", 2 ** -9), ("bf16", 2 ** -6)):
        (state, grads), (their_state, _) = runs[0][how]["mine"], runs[0][how]["torch"]
        check_close(f"{how}-compressed d2lpar DDP == torch with {how}_compress_hook", state,
                    their_state, rtol=1e-6, atol=1e-7)
        errors = {k: ((grads[k] - e).abs().max() / e.abs().max()).item() for k, e in exact.items()}
        assert max(errors.values()) <= bound, (how, errors)
        assert max(errors.values()) > 0, f"{how} compression changed nothing: was it applied?"


def accumulate(micro):
    """2 ranks; ``micro`` micro-batches: the first micro-1 inside no_sync, the last synchronized."""
    rank = dist.get_rank()
    model = TiedToy(seed=rank)
    ddp = DDP(model, 0.002)
    ids, y = batches(1, BATCH * 2)[0]
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    parts = list(zip(ids[mine].chunk(micro), y[mine].chunk(micro)))
    for i, (a, b) in enumerate(parts):
        loss = nn.functional.cross_entropy(ddp(a), b) / micro
        if i < micro - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    # The trap: forward outside no_sync, backward inside still synchronizes.
    trap = TiedToy(seed=rank)
    trap_ddp = DDP(trap, 0.002)
    out = trap_ddp(ids[mine])
    with pytest.raises(RuntimeError, match="without a backward"):
        with trap_ddp.no_sync():
            pass
    with trap_ddp.no_sync():
        out.square().mean().backward()
    return ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            trap.hidden.weight.grad.clone())


def test_no_sync_accumulation_equals_one_large_batch():
    results = launch(accumulate, 2, 3)
    model = TiedToy(seed=0)
    ids, y = batches(1, BATCH * 2)[0]
    nn.functional.cross_entropy(model(ids), y).backward()
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank, (grads, _) in enumerate(results):
        check_close(f"rank {rank}: 3 micro-batches with no_sync == one batch of {2 * BATCH}", grads, expected)
    assert not torch.equal(results[0][1], torch.zeros_like(results[0][1]))
    check_close("forward outside no_sync: its backward inside still synchronizes",
                results[0][1], results[1][1], rtol=0, atol=0)


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def unused(find):
    ddp = DDP(_Unused(), find_unused_parameters=find)
    out = ddp(torch.ones(2, 4) * (dist.get_rank() + 1)).sum()
    out.backward(retain_graph=True)
    grads = ddp.module.used.weight.grad.clone(), ddp.module.spare.weight.grad
    with pytest.raises(RuntimeError, match="second gradient after one forward"):
        out.backward()
    return grads


def test_unused_parameter_is_named_unless_expected():
    with pytest.raises(RankFailed, match=r"\['spare.bias', 'spare.weight'\] got no gradient"):
        launch(unused, 2, False, timeout=30)
    (g0, spare0), (g1, _) = launch(unused, 2, True, timeout=30)
    assert spare0 is None, "a parameter unused on every rank keeps grad None, as in torch"
    check_close("find_unused_parameters=True: used gradients averaged", g0, torch.full((4, 4), 3.0))
    check_close("and equal on both ranks", g1, g0, rtol=0, atol=0)


def different_shapes():
    DDP(nn.Linear(4, 4 + dist.get_rank()))


def different_dtypes():
    model = nn.Linear(4, 4)
    DDP(model.double() if dist.get_rank() == 1 else model)


def test_models_of_different_shapes_fail_clearly_without_hanging():
    with pytest.raises(RankFailed, match=r"rank 0 has 'weight' of shape \(4, 4\) \(float32\), rank 1 has "
                                         r"'weight' of shape \(5, 4\)"):
        launch(different_shapes, 2, timeout=30)
    with pytest.raises(RankFailed, match=r"rank 0 has 'weight' of shape \(4, 4\) \(float32\), rank 1 has "
                                         r"'weight' of shape \(4, 4\) \(float64\)"):
        launch(different_dtypes, 2, timeout=30)


def left_with_gloo(compress):
    """After each backward: the buckets this DDP cannot yet call its own (``pending``) and how many
    of the step's works are still alive; then a view of bucket 0 kept, which ``pending`` must name."""
    import weakref
    started, all_reduce = [], dist.all_reduce

    def recording(*args, **kwargs):   # the works DDP starts, seen through weak references
        work = all_reduce(*args, **kwargs)
        if kwargs.get("async_op"):
            started.append(weakref.ref(work))
        return work
    dist.all_reduce = recording
    try:
        model = TiedToy(seed=0)
        wrapped, n, rank, steps = DDP(model, 0.0001, compress=compress), BATCH // 2, dist.get_rank(), []
        for ids, y in batches():
            nn.functional.cross_entropy(wrapped(ids[rank * n:(rank + 1) * n]),
                                        y[rank * n:(rank + 1) * n]).backward()
            steps.append((wrapped.pending(), sum(ref() is not None for ref in started)))
            sgd(model)
    finally:
        dist.all_reduce = all_reduce
    view = (wrapped.sends or wrapped.flats)[0][:1]   # something else holding bucket 0
    held = wrapped.pending()
    del view
    return steps, held, wrapped.pending(), len(started), len(wrapped.buckets)


@pytest.mark.parametrize("compress", [None, "fp16"])
def test_after_each_backward_nothing_is_left_with_gloo(compress):
    # A gloo thread freeing a bucket as the interpreter shuts down aborts the process
    # (d2lpar.comm.drain); so after backward every work is dropped and no thread holds a bucket.
    for steps, held, after, started, buckets in launch(left_with_gloo, 2, compress, timeout=60):
        assert started == STEPS * buckets and buckets == 4
        assert steps == [([], 0)] * STEPS, steps
        assert held == [0] and after == []   # the check sees a bucket held elsewhere


class _SpareFirst(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.spare, self.used = nn.Linear(4, 4), nn.Linear(4, 4)   # spare's buckets come last

    def forward(self, x):
        return self.used(x)


def cut_short():
    ddp = DDP(_SpareFirst(), 0.00001)   # one bucket per tensor: used's two start in backward
    with pytest.raises(RuntimeError, match="got no gradient"):
        ddp(torch.ones(2, 4)).sum().backward()
    started = ddp.pending()
    return started, ddp.close(), ddp.pending()


def test_close_waits_for_the_all_reduces_of_a_step_cut_short():
    assert launch(cut_short, 2, timeout=30) == [([0, 1], True, [])] * 2
