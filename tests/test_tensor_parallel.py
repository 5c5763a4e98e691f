"""Tensor-parallel layers and blocks equal one device on 2 and 4 ranks; collectives equal the formulas.

Each rank builds the same single-device layer (same seed), keeps its part, runs forward, backward and
one SGD step on the same data; the caller rebuilds the full parameters and compares them with the
same step taken here in one process: the parameters differ from their start, and equal the baseline.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.cost import tp_cost
from d2lpar.infra.activations import saved_activation_bytes
from d2lpar.processes.launch import RankFailed, launch
from d2lpar.strategies.tensor import mappings as tp
from d2lpar.strategies.tensor import blocks as B
from d2lpar.strategies.tensor import layers as L

B_, S, D, HEADS, HID = 2, 8, 12, 4, 20   # d, heads, hidden: divisible by 2 and 4, nothing else
LR = 0.5


def _cases():
    """name -> (make single-device module, make parallel from it, input shape, sequence parallel)."""
    conv = (2, 8, 5, 5)
    return {
        "column": (lambda: nn.Linear(D, HID), lambda m: L.ColumnParallelLinear(D, HID, full=m,
                   gather_output=True), (B_, S, D), False),
        "row": (lambda: nn.Linear(HID, D), lambda m: L.RowParallelLinear(HID, D, full=m,
                split_input=True), (B_, S, HID), False),
        "conv_out": (lambda: nn.Conv2d(8, 4, 3, padding=1),
                     lambda m: L.OutChannelSplitConv2d(8, 4, 3, padding=1, full=m), conv, False),
        "conv_in": (lambda: nn.Conv2d(8, 4, 3, padding=1),
                    lambda m: L.InChannelSplitConv2d(8, 4, 3, padding=1, full=m), conv, False),
        "mlp": (lambda: B.MLP(D, HID), lambda m: B.ParallelMLP(D, HID, full=m), (B_, S, D), False),
        "attn": (lambda: B.SelfAttention(D, HEADS), lambda m: B.ParallelSelfAttention(D, HEADS, full=m),
                 (B_, S, D), False),
        "layer": (lambda: B.TransformerLayer(D, HEADS, HID),
                  lambda m: B.ParallelTransformerLayer(D, HEADS, HID, full=m), (B_, S, D), False),
        "mlp_sp": (lambda: B.MLP(D, HID), lambda m: B.ParallelMLP(D, HID, sequence_parallel=True,
                   full=m), (B_, S, D), True),
        "layer_sp": (lambda: B.TransformerLayer(D, HEADS, HID),
                     lambda m: B.ParallelTransformerLayer(D, HEADS, HID, sequence_parallel=True,
                                                          full=m), (B_, S, D), True),
    }


def _single(name):
    make, _, shape, _ = _cases()[name]
    torch.manual_seed(1)
    model = make()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))
    out_shape = model(x).shape
    gy = torch.randn(out_shape, generator=torch.Generator().manual_seed(7))
    return model, x, gy


def _worker(names):
    rank, t = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        model, x, gy = _single(name)
        _, make_par, shape, sp = _cases()[name]
        par = make_par(model)
        cut = (lambda v: v.chunk(t, 1)[rank].clone()) if sp else (lambda v: v.clone())
        xl = cut(x).requires_grad_()
        acts = saved_activation_bytes(par, xl)
        with tp.count_comms() as log:
            y = par(xl)
            y.backward(cut(gy))
        synced = B.sync_sequence_parallel_grads(par)
        with torch.no_grad():
            for p in par.parameters():
                p -= LR * p.grad
        results[name] = {"y": y.detach(), "dx": xl.grad, "params": B.gather_full(par),
                         "comms": log.summary(), "acts": acts, "synced": synced}
    return results


def _baseline(name):
    model, x, gy = _single(name)
    start = copy.deepcopy(model.state_dict())
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(gy)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return start, y.detach(), x.grad, dict(model.named_parameters())


_runs: dict[int, list] = {}


def _everything(names, with_torch):
    return _worker(names), (_torch_counts() if with_torch else None)


def _run(t):
    """Every case on t ranks (on 2, PyTorch's too), once per session: the tests below read it."""
    if t not in _runs:
        _runs[t] = launch(_everything, t, list(_cases()), t == 2, timeout=120)
    return _runs[t]


@pytest.mark.parametrize("t", [2, 4])
def test_every_layer_and_block_equals_one_device(t):
    names = list(_cases())
    results = [r[0] for r in _run(t)]
    for name in names:
        start, y, dx, after = _baseline(name)
        sp = _cases()[name][3]
        join = (lambda key: torch.cat([r[name][key] for r in results], 1)) if sp else \
            (lambda key: results[0][name][key])
        torch.testing.assert_close(join("y"), y, msg=f"{name}, t={t}: outputs")
        torch.testing.assert_close(join("dx"), dx, msg=f"{name}, t={t}: input gradients")
        for key, p in after.items():
            got = results[0][name]["params"][key]
            assert not torch.allclose(start[key], p), f"{name}.{key} did not move"   # differ before
            torch.testing.assert_close(got, p.detach(), msg=f"{name}.{key}, t={t}")   # equal after
            assert all(torch.equal(r[name]["params"][key], got) for r in results)


@pytest.mark.parametrize("t", [2, 4])
def test_collectives_and_activations_equal_the_formulas(t):
    results = _run(t)[0][0]
    for name in ["mlp", "attn", "layer", "mlp_sp", "layer_sp"]:
        block, sp = name.removesuffix("_sp"), name.endswith("_sp")
        assert results[name]["comms"] == tp_cost.comm_formula(block, B_, S, D, t, sp), name
        assert results[name]["acts"] == tp_cost.activation_bytes(block, B_, S, D, HEADS, HID, t, sp)
    assert results["layer_sp"]["synced"] == 6   # two LayerNorms (2 each) and two row biases
    k = 4 * B_ * S * D
    # column-parallel with gathered output: f's all-reduce backward of the input, gather forward
    assert results["column"]["comms"]["forward"] == {"counts": {"all_gather": 1},
                                                     "sent": (t - 1) / t * 4 * B_ * S * HID}
    assert results["column"]["comms"]["backward"] == {"counts": {"all_reduce": 1},
                                                      "sent": 2 * (t - 1) / t * k}
    assert results["conv_in"]["comms"]["forward"]["counts"] == {"all_reduce": 1}
    assert results["conv_in"]["comms"]["backward"]["counts"] == {"all_gather": 1}


def _torch_counts():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for name, plan in [("mlp", {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}),
                       ("attn", {"qkv": ColwiseParallel(), "out": RowwiseParallel()})]:
        model, x, gy = _single(name)
        ours = _worker([name])[name]["comms"]
        theirs = parallelize_module(copy.deepcopy(model), mesh, plan)
        with CommDebugMode() as fwd:
            y = theirs(x.clone().requires_grad_())
        with CommDebugMode() as bwd:
            y.backward(gy)
        out[name] = (ours, {p: tp.torch_counts(m) for p, m in (("forward", fwd), ("backward", bwd))})
    return out


def test_our_counts_equal_comm_debug_mode():
    for name, (ours, theirs) in _run(2)[0][1].items():
        for phase in ("forward", "backward"):
            assert ours[phase]["counts"] == theirs[phase], (name, phase)


def test_indivisible_sizes_name_both_numbers():
    with pytest.raises(ValueError,
                       match=r"heads = 6 is not divisible by the 4 .*multiple of 4 \(such as 4 or 8\)"):
        tp.require_divisible("heads", 6, 4)
    with pytest.raises(ValueError, match=r"out_features = 10 .* 3 .*divides 10 \(1, 2, 5, 10\)"):
        tp.require_divisible("out_features", 10, 3)


def _indivisible():
    B.ParallelSelfAttention(12, 6)


def test_a_layer_rejects_heads_the_ranks_do_not_divide():
    with pytest.raises(RankFailed, match="heads = 6 is not divisible by the 4"):
        launch(_indivisible, 4, timeout=60)


def test_a_layer_outside_a_process_group_says_how_to_run_it():
    with pytest.raises(RuntimeError, match="need a process group.*launch"):
        L.ColumnParallelLinear(4, 4)


def _disagree():
    L.RowParallelLinear(8, 4 + 2 * dist.get_rank())


def test_ranks_that_disagree_on_the_shape_fail_at_once():
    with pytest.raises(RankFailed, match=r"disagree on the shape of RowParallelLinear \(rank 0: "
                                         r"\(8, 4, 1\), rank 1: \(8, 6, 1\)\)"):
        launch(_disagree, 2, timeout=30)


def test_formulas_agree_where_they_must():
    # one device: Korthikanti's two tensor-parallel forms equal the plain one
    one = tp_cost.korthikanti_bytes(2048, 1, 4096, 32)
    assert tp_cost.korthikanti_bytes(2048, 1, 4096, 32, t=1, sequence_parallel=True) == one
    assert tp_cost.comm_formula("layer", 2, 8, 16, 1) == {p: {"counts": {}, "sent": 0.0}
                                                          for p in ("forward", "backward")}
    # sequence parallelism moves the same bytes as Megatron's all-reduces
    assert (tp_cost.comm_formula("layer", 2, 8, 16, 4, True)["forward"]["sent"]
            == tp_cost.comm_formula("layer", 2, 8, 16, 4)["forward"]["sent"])
    with pytest.raises(ValueError, match="unknown block"):
        tp_cost.comm_formula("conv", 1, 1, 1, 2)


def test_bench_report_ends_with_the_worst_time_ratio():
    from d2lpar.bench import tp as bench
    rows = [{"block": "mlp", "ours": 0.011, "torch": 0.010, "sent": 1024.0, "formula": 1024.0},
            {"block": "attn", "ours": 0.026, "torch": 0.020, "sent": 2048.0, "formula": 2048.0}]
    lines = bench.report(rows, 2, 1, 8, 16, 4, 64)
    assert lines[-1] == ("worst d2lpar / parallelize_module step time ratio: 1.30 (misses the "
                         "target <= 1.2)")
    assert lines[2].split()[-1] == "1.000"


def _handed(broken):
    """One ParallelMLP forward and backward; ``broken``: f and g all-reduce in float64 (2x bytes)."""
    honest = tp._all_reduce
    if broken:
        tp._all_reduce = lambda x, group, phase: honest(x.double(), group, phase).to(x.dtype)
    try:
        model, x, gy = _single("mlp")
        block = B.ParallelMLP(D, HID, full=model)
        with tp.count_comms() as log:
            block(x.clone().requires_grad_()).backward(gy)
        return log.handed()
    finally:
        tp._all_reduce = honest


def test_the_handed_tensor_check_fails_on_a_collective_that_sends_too_much():
    formula = tp_cost.handed_formula("mlp", B_, S, D, 2)
    assert formula == [("all_reduce", "backward", 4 * B_ * S * D), ("all_reduce", "forward", 4 * B_ * S * D)]
    real, broken = (launch(_handed, 2, b, timeout=60)[0] for b in (False, True))
    assert real == formula
    assert broken != formula and [n for _, _, n in broken] == [8 * B_ * S * D] * 2


def _heads_disagree():
    heads = 2 + 2 * dist.get_rank()   # 2 on rank 0, 4 on rank 1: the linear layers are the same
    B.ParallelSelfAttention(D, heads)


def test_ranks_that_disagree_on_the_heads_fail_at_once():
    with pytest.raises(RankFailed, match=r"disagree on the shape of ParallelSelfAttention \(rank 0: "
                                         r"d=12, heads=2, head_dim=6, sequence_parallel=0; rank 1: "
                                         r"d=12, heads=4, head_dim=3, sequence_parallel=0\)"):
        launch(_heads_disagree, 2, timeout=30)


def _inputs_disagree(kind):
    rank = dist.get_rank()
    block = B.ParallelMLP(D, HID)
    x = torch.randn(2 + rank, S, D) if kind == "shape" else torch.randn(2, S, D, dtype=(torch.float32, torch.float64)[rank])
    block(x.to(torch.float64) if kind == "dtype" and rank else x)


def test_ranks_fed_different_inputs_are_named_not_aborted():
    """Different batches (or a float64 batch on one rank) would make gloo abort in the all-reduce."""
    with pytest.raises(RankFailed, match=r"the ranks give ColumnParallelLinear different inputs \(rank 0: "
                                         rf"shape \(2, {S}, {D}\) \(float32\); rank 1: shape \(3, {S}, {D}\)"):
        launch(_inputs_disagree, 2, "shape", timeout=30)
    with pytest.raises(RankFailed, match=r"rank 0: shape .* \(float32\); rank 1: shape .* \(float64\)"):
        launch(_inputs_disagree, 2, "dtype", timeout=30)


def _counted_under_comm_debug_mode():
    from torch.distributed.tensor.debug import CommDebugMode
    block = B.ParallelMLP(D, HID)
    with CommDebugMode() as comm:
        block(torch.randn(2, S, D))
    return tp.torch_counts(comm)


def test_the_input_check_is_not_counted_as_the_layers_communication():
    assert launch(_counted_under_comm_debug_mode, 2, timeout=30)[0] == {"all_reduce": 1}
