"""Worked solutions to the exercises of notebook 12 (channel and tensor parallelism)."""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from d2lpar.cost import tp_cost
from d2lpar.infra.activations import saved_activation_bytes
from d2lpar.processes.launch import RankFailed, launch
from d2lpar.strategies.tensor import mappings as tp
from d2lpar.strategies.tensor import blocks as B

b, s, d, heads, hidden = 2, 8, 16, 4, 64


def _data(batch=b):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, s, d, generator=g), torch.randn(batch, s, d, generator=g)


def _one_device(model, x, gy):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(gy)
    return y.detach(), x.grad, {k: p.grad for k, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ exercise 1

class GatherLinear(torch.autograd.Function):
    """Megatron's sequence-parallel linear: all-gather the input, keep only the shard for backward."""

    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        ctx.save_for_backward(shard, weight)
        ctx.group = group
        return F.linear(tp._all_gather(shard, 1, group, "forward"), weight, bias)

    @staticmethod
    def backward(ctx, gy):
        shard, weight = ctx.saved_tensors
        full = tp._all_gather(shard, 1, ctx.group, "backward")  # gathered again
        gx = tp._reduce_scatter(gy @ weight, 1, ctx.group, "backward")
        gy2, full2 = gy.reshape(-1, gy.shape[-1]), full.reshape(-1, full.shape[-1])
        return gx, gy2.T @ full2, gy2.sum(0), None


def _megatron_mlp():
    return {regather: _mlp_step(regather) for regather in (False, True)}


def _mlp_step(regather):
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mlp = B.ParallelMLP(d, hidden, sequence_parallel=True, full=B.MLP(d, hidden))
    if regather:
        fc1 = mlp.fc1
        fc1.forward = lambda x: GatherLinear.apply(x, fc1.weight, fc1.bias, None)
    x, gy = (v.chunk(t, 1)[rank].clone() for v in _data())
    x.requires_grad_()
    acts = saved_activation_bytes(mlp, x)
    with tp.count_comms() as log:
        y = mlp(x)
        y.backward(gy)
    B.sync_sequence_parallel_grads(mlp)  # fc2's bias saw s/t tokens per rank
    return {"y": y.detach(), "dx": x.grad, "grads": B.gather_full(mlp, grads=True), "acts": acts,
            "comms": log.summary()}


def exercise_1():
    t = 2
    torch.manual_seed(0)
    y, dx, grads = _one_device(B.MLP(d, hidden), *_data())
    per_rank = launch(_megatron_mlp, t, timeout=120)
    runs = {regather: [r[regather] for r in per_rank] for regather in (False, True)}
    for regather, ranks in runs.items():
        cat = lambda k: torch.cat([r[k] for r in ranks], 1)
        torch.testing.assert_close(cat("y"), y)
        torch.testing.assert_close(cat("dx"), dx)
        torch.testing.assert_close(ranks[0]["grads"], grads, rtol=1e-4, atol=1e-5)
    ours, megatron = runs[False][0], runs[True][0]
    print(f"saved activations per rank: ours {ours['acts']} B, re-gathering {megatron['acts']} B "
          f"(fc1's input: 4bsd = {4 * b * s * d} B -> 4bsd/t = {4 * b * s * d // t} B)")
    print(f"backward collectives: ours {ours['comms']['backward']['counts']}, "
          f"re-gathering {megatron['comms']['backward']['counts']}")
    assert ours["acts"] - megatron["acts"] == 4 * b * s * d * (t - 1) // t
    assert megatron["comms"]["backward"]["counts"] == {"all_gather": 2, "reduce_scatter": 1}
    assert ours["comms"]["backward"]["counts"] == {"all_gather": 1, "reduce_scatter": 1}


# ------------------------------------------------------------------------------------ exercise 2

def _gpt2_small_layer(t):
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = B.TransformerLayer(768, 12, 3072)
    layer = B.ParallelTransformerLayer(768, 12, 3072, full=full)
    x = torch.randn(1, 6, 768, generator=torch.Generator().manual_seed(2))
    ours = layer(x)
    return (ours - full(x)).abs().max().item() if rank == 0 else None


def exercise_2():
    ok = [t for t in range(1, 9) if 768 % t == 0 and 12 % t == 0 and 3072 % t == 0]
    print("ranks that split d=768, 12 heads, MLP 3072:", ok)
    assert ok == [1, 2, 3, 4, 6]
    try:
        launch(_gpt2_small_layer, 5, 5, timeout=60, quiet=True)
        raise AssertionError("5 ranks should be refused")
    except RankFailed as e:
        message = next(line for line in str(e).splitlines() if line.startswith("ValueError: "))
        print("on 5 ranks:", message.removeprefix("ValueError: "))
        assert "heads = 12 is not divisible by the 5" in message
    err = launch(_gpt2_small_layer, 3, 3, timeout=120)[0]
    print(f"on 3 ranks: largest difference from one device {err:.1e}")
    assert err < 1e-4


# ------------------------------------------------------------------------------------ exercise 3

def _dp_tp(x, gy):
    rank = dist.get_rank()
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, dp_group, replica = tp_groups[rank // 2], dp_groups[rank % 2], rank // 2
    torch.manual_seed(0)
    mlp = B.ParallelMLP(d, hidden, group=tp_group, full=B.MLP(d, hidden))
    xs, gys = x.chunk(2)[replica], gy.chunk(2)[replica]  # this replica's half of the batch
    (mlp(xs) * gys).sum().div(xs.shape[0]).backward()  # the mean loss over this half
    for p in mlp.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad /= 2  # average of the two halves' means = the whole batch's mean
    return B.gather_full(mlp, grads=True, group=tp_group)


def exercise_3():
    x, gy = _data(batch=4)
    torch.manual_seed(0)
    model = B.MLP(d, hidden)
    start = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    (model(x) * gy).sum().div(4).backward()
    expected = {k: p.grad for k, p in model.named_parameters()}
    got = launch(_dp_tp, 4, x, gy, timeout=120)
    assert all(not torch.allclose(start[k], expected[k]) for k in expected)
    for rank, grads in enumerate(got):
        torch.testing.assert_close(grads, expected, rtol=1e-4, atol=1e-6)
    print("2 x 2 grid (dp x tp): every rank's gradients == one device on the whole batch")


# ------------------------------------------------------------------------------------ exercise 4

def exercise_4():
    # Per step and rank: TP 2 regions x 2 passes x 2(t-1)/t x e b s d; DP 2(n-1)/n x e P, P = 12d^2 + 13d.
    # Equal (t = n) where 4 b s d = 12 d^2 + 13 d, i.e. b s = 3d + 13/4: about 3d tokens.
    D, n = 4096, 8
    P = 12 * D * D + 13 * D
    tokens = (12 * D + 13) / 4

    def tp_sent(bs):
        f = tp_cost.comm_formula("layer", 1, bs, D, n, element_size=2)
        return f["forward"]["sent"] + f["backward"]["sent"]

    dp = tp_cost.dp_grad_sent(P, n, element_size=2)
    print(f"d = {D}: equal at b*s = {tokens:,.2f} tokens (3d = {3 * D:,}); TP {tp_sent(tokens):,.0f} B, "
          f"DP {dp:,.0f} B per rank and step")
    assert abs(tp_sent(tokens) - dp) < 1e-6 * dp
    assert tp_sent(2048) < dp < tp_sent(16384)
