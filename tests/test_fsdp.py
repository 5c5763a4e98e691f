"""FSDP by hand (``fsdp.shard``) and ZeroAdamW built on it, each against one process.

After backward every sharded parameter's ``.grad`` is its piece of the MEAN gradient, so any
``torch.optim`` optimizer trains the sharded model as one process trains the whole batch; the
gradients are compared too, since AdamW hides a gradient N times too large (m / sqrt(v)).
Tolerance rtol 1e-5, atol 1e-6: float sums do not associate (a rank sums its rows, the ring then
adds the ranks' sums, where one process sums all rows at once), so the results differ in the last
bits, about 1e-7 here (torch's FSDP2 misses bitwise equality by about 1.5e-8 too); a missing / N
is off by a factor of N. Cost: about 6 s on a 2-core machine (6 launches of the warm launcher).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.comm.collectives import ring_rank_bytes
from d2lpar.processes.launch import launch
from d2lpar.strategies.sharded import fsdp, zero

TOL = {"rtol": 1e-5, "atol": 1e-6}


class Blocks(nn.Module):
    """Layers in a ModuleList, a LayerNorm left whole, a head; odd widths: padding on 2 and 3 ranks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(7, 13), nn.Linear(13, 11)])
        self.norm = nn.LayerNorm(11)
        self.head = nn.Linear(11, 3)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.norm(x))


def batches(steps=3, rows=12):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 7, generator=g), torch.randint(0, 3, (rows,), generator=g))
            for _ in range(steps)]


OPTIMIZERS = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
              "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}


def one_process(make_opt, data, model=Blocks):
    net = model()
    opt = make_opt(net.parameters())
    first = None
    for X, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        first = first or {k: p.grad.clone() for k, p in net.named_parameters()}
        opt.step()
    return net.state_dict(), first


def _mine(X):
    rank, n = dist.get_rank(), dist.get_world_size()
    return slice(rank * len(X) // n, (rank + 1) * len(X) // n)


def _first_grads(net):
    """Step 1's gradients: each piece with where it lies in its parameter, whole ones as they are."""
    return {k: (fsdp.piece_span(p) if fsdp.unit_of(p) else None, p.grad.clone())
            for k, p in net.named_parameters()}


def _sharded_training(data):
    out = {}
    for name, make_opt in OPTIMIZERS.items():
        net = Blocks()
        for block in net.blocks:  # the norm stays whole
            fsdp.shard(block)
        fsdp.shard(net.head)
        opt = make_opt(net.parameters())
        first = None
        for step, (X, y) in enumerate(data):
            opt.zero_grad()
            mine = _mine(X)
            half = (mine.start + mine.stop) // 2  # the last step: two micro-batches accumulated
            parts = [mine] if step < len(data) - 1 else [slice(mine.start, half),
                                                          slice(half, mine.stop)]
            for part in parts:
                loss = nn.functional.cross_entropy(net(X[part]), y[part])
                (loss * (part.stop - part.start) / (mine.stop - mine.start)).backward()
            fsdp.finish_grad_sync(net)
            first = first or _first_grads(net)
            opt.step()
        pieces = {k: (fsdp.piece_span(p) if fsdp.unit_of(p) else None, p.detach().clone())
                  for k, p in net.named_parameters()}
        out[name] = {"state": fsdp.full_state_dict(net), "first": first, "pieces": pieces,
                     "state_dict": {k: v.clone() for k, v in net.state_dict().items()}}
    return out


def _assert_first_grads(got, expected, where):
    for k, (span, g) in got.items():
        want = expected[k] if span is None else expected[k].reshape(-1)[slice(*span)]
        torch.testing.assert_close(g, want, **TOL, msg=lambda m: f"{where}, gradient {k}: {m}")


@pytest.mark.parametrize("n", [2, 3])
def test_sharded_layers_train_with_any_torch_optimizer_as_one_process(n):
    data = batches()
    start = Blocks().state_dict()
    results = launch(_sharded_training, n, data, timeout=90)
    for name, make_opt in OPTIMIZERS.items():
        expected, first = one_process(make_opt, data)
        for k in expected:
            assert not torch.allclose(expected[k], start[k]), f"{name} moved {k}"
        for rank, res in enumerate(results):
            got = res[name]
            torch.testing.assert_close(got["state"], expected, **TOL,
                                       msg=lambda m: f"{name}, rank {rank} of {n}: {m}")
            _assert_first_grads(got["first"], first, f"{name}, rank {rank} of {n}")
            for k, v in got["state_dict"].items():  # between steps: this rank's pieces, as values
                assert torch.equal(v, got["pieces"][k][1])
        for k, v in expected.items():  # the ranks' pieces tile each sharded parameter exactly
            pieces = [r[name]["pieces"][k] for r in results]
            if pieces[0][0] is None:
                continue  # the norm: whole on every rank
            pieces = sorted((p for p in pieces if p[0][0] < p[0][1]), key=lambda p: p[0])
            assert [a for (a, _), _ in pieces] == [0] + [b for (_, b), _ in pieces[:-1]], k
            torch.testing.assert_close(torch.cat([t for _, t in pieces]), v.reshape(-1), **TOL)


# ----------------------------------------- ZeroAdamW stage 3: containers, state_dict, parameters

class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(7, 13), nn.Linear(13, 13)])
        self.heads = nn.ModuleDict({"a": nn.Linear(13, 3)})

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.heads["a"](x)


def _zero_stage_3(data):
    out = {}
    for model in (Containers, Blocks):
        net = model()
        opt = zero.ZeroAdamW(net, 3, lr=1e-2, weight_decay=0.1)
        for X, y in data:
            nn.functional.cross_entropy(net(X[_mine(X)]), y[_mine(X)]).backward()
            opt.step()
        after = {k: v.clone() for k, v in net.state_dict().items()}  # values, not a crash
        out[model.__name__] = {"state": opt.full_state_dict(), "units": [u.name for u in opt.units],
                               "state_dict": after, "pieces": {k: p.detach().clone() for k, p in
                                                               net.named_parameters()}}
    return out


def test_zero_adamw_stage_3_serves_containers_and_state_dict():
    data = batches()
    results = launch(_zero_stage_3, 2, data, timeout=60)
    adamw = OPTIMIZERS["AdamW"]
    for model in (Containers, Blocks):
        expected, _ = one_process(adamw, data, model)
        for rank, res in enumerate(results):
            got = res[model.__name__]
            torch.testing.assert_close(got["state"], expected, **TOL,
                                       msg=lambda m: f"{model.__name__}, rank {rank}: {m}")
            assert all(torch.equal(got["state_dict"][k], v) for k, v in got["pieces"].items())
    assert results[0]["Containers"]["units"] == ["layers.0", "layers.1", "heads.a"]


def _zero_adamw_on_parameters(data):
    out = {}
    for stage in (1, 2, None):
        net = Blocks()
        if stage is None:  # sharded layers, the norm whole: stage 3, built by fsdp.shard
            for layer in (*net.blocks, net.head):
                fsdp.shard(layer)
            opt = zero.ZeroAdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            opt = zero.ZeroAdamW(net.parameters(), stage, lr=1e-2, weight_decay=0.1)
        for X, y in data:
            nn.functional.cross_entropy(net(X[_mine(X)]), y[_mine(X)]).backward()
            fsdp.finish_grad_sync(net)
            opt.step()
        out[stage] = (fsdp.full_state_dict(net), opt.stage)
    return out


def test_zero_adamw_takes_parameters_as_a_torch_optimizer_does():
    data = batches()
    expected, _ = one_process(OPTIMIZERS["AdamW"], data)
    for rank, res in enumerate(launch(_zero_adamw_on_parameters, 3, data, timeout=60)):
        for given, (state, stage) in res.items():
            assert stage == (given or 3)
            torch.testing.assert_close(state, expected, **TOL,
                                       msg=lambda m: f"stage {stage}, rank {rank} of 3: {m}")


# ------------------------------------------------------------- compute dtype: bf16 wire, fp32 sums

def _bf16_step(data):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 3))
    for layer in net[::2]:
        fsdp.shard(layer, compute_dtype=torch.bfloat16)
    fsdp.shard(net)  # no parameters of its own: it joins the layers' counters into one
    counter = fsdp.units_of(net)[0].sharding.counter
    X, y = data[0]
    out = net(X[_mine(X)])
    nn.functional.cross_entropy(out, y[_mine(X)]).backward()
    return {"first": _first_grads(net), "sent": counter.sent, "out": out.dtype,
            "state": fsdp.full_state_dict(net),
            "padded": [u.padded for u in fsdp.units_of(net)],
            "dtypes": {(p.dtype, p.grad.dtype) for p in net.parameters()}}


def test_compute_dtype_gathers_in_bf16_and_reduces_in_fp32():
    data = batches(steps=1)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 3))
    nn.functional.cross_entropy(ref(data[0][0]), data[0][1]).backward()
    for rank, res in enumerate(launch(_bf16_step, 2, data, timeout=60)):
        assert res["out"] == torch.bfloat16 and res["dtypes"] == {(torch.float32, torch.float32)}
        for k, v in ref.state_dict().items():  # the fp32 master weights, not their bf16 copies
            assert torch.equal(res["state"][k], v), k
        # per unit: two all-gathers of 2-byte elements (forward, backward), one 4-byte reduce-scatter
        assert res["sent"] == sum(2 * ring_rank_bytes("all_gather", 2 * p, 2)
                                  + ring_rank_bytes("reduce_scatter", 4 * p, 2) for p in res["padded"])
        for k, p in ref.named_parameters():
            span, g = res["first"][k]
            if span[0] == span[1]:
                continue  # no piece of this parameter on this rank
            want = p.grad.reshape(-1)[slice(*span)]
            error = ((g - want).norm() / want.norm()).item()
            assert 0 < error < 0.03, f"rank {rank}, {k}: bf16 gradient off by {error:.2%} of fp32"


# ---------------------------------------------------------------------------------- bad input

def _refusals():
    said = []

    def refused(fn):
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as e:
            said.append(str(e))
        else:
            said.append("accepted")
    refused(lambda: fsdp.shard(nn.ModuleList([nn.Linear(2, 2)])))
    layer = fsdp.shard(nn.Linear(2, 2))
    refused(lambda: fsdp.shard(layer))
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    fsdp.shard(tied[1])
    refused(lambda: fsdp.shard(tied))
    refused(lambda: zero.ZeroAdamW(layer.parameters(), 1))
    refused(lambda: zero.ZeroAdamW(nn.Linear(2, 2).parameters(), 3))
    torch.manual_seed(dist.get_rank())  # the norm, left whole, differs between the ranks
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    net[1].weight.data.normal_()
    fsdp.shard(net[0])
    net(torch.randn(2, 3)).sum().backward()
    refused(lambda: fsdp.finish_grad_sync(net))
    return said


def test_bad_input_gets_one_sentence():
    with pytest.raises(RuntimeError, match="none is initialised"):
        fsdp.shard(nn.Linear(2, 2))
    for said in launch(_refusals, 2, timeout=60):
        assert [s.split(":")[0] for s in said] == [
            "a ModuleList is never called, so the gather before its forward would never run",
            "this Linear is sharded already",
            "0.weight is also a parameter of 1, sharded on its own",
            "these parameters are sharded already (fsdp.shard), which is stage 3",
            "stage 3 shards the parameters themselves, which needs the modules that use them",
            "the parameters left whole (in no sharded module) differ between ranks"], said
