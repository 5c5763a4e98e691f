"""Memory's levers against their formulas, on sizes notebook 14 does not use; bad input is one sentence.

Notebook 14 runs the block stack of 8 layers (b=2, s=16, d=32); these tests use other sizes. The
fake-tensor dry run is tested in test_dry_run.py.
"""

import math

import pytest
import torch
from torch import nn

from d2lpar.cost import memory_levers as ML
from d2lpar.infra.autograd_meter import count_flops, saved_bytes
from d2lpar.processes.launch import launch
from d2lpar.strategies.memory import fp8
from d2lpar.strategies.memory.checkpointing import MATMULS, CheckpointedStack, save_ops_policy
from d2lpar.strategies.memory.fsdp_precision import fsdp_policy_run, single_process_run, tiny_model
from d2lpar.strategies.memory.precision import MixedPrecisionAdamW, train_with_scaler
from d2lpar.strategies.sharded.fsdp_checks import movement_error
from d2lpar.strategies.tensor.blocks import TransformerLayer


def stack(mode, every, L, d, heads, hidden):
    torch.manual_seed(0)
    return CheckpointedStack([TransformerLayer(d, heads, hidden) for _ in range(L)], mode, every)


@pytest.mark.parametrize("L,b,s,d,heads,hidden", [(5, 3, 10, 24, 3, 40), (4, 1, 20, 16, 2, 64)])
def test_checkpointing_saves_and_recomputes_what_the_formulas_say_with_the_same_gradients(L, b, s, d, heads, hidden):
    x = torch.randn(b, s, d, generator=torch.Generator().manual_seed(1), requires_grad=True)
    other = x.detach() + 0.1
    grads = {}
    for mode, every in (("none", 1), ("full", 1), ("full", 2), ("full", 3), ("selective", 1)):
        m = stack(mode, every, L, d, heads, hidden)
        assert saved_bytes(lambda: m(x), m) == ML.saved_bytes(mode, L, b, s, d, heads, hidden, every)
        flops = count_flops(lambda: m(x).square().sum().backward())
        assert flops == ML.step_flops(L, b, s, d, hidden) + ML.recompute_flops(mode, L, b, s, d, hidden, every)
        grads[mode, every] = [p.grad.clone() for p in m.parameters()]
    m = stack("none", 1, L, d, heads, hidden)
    m(other.requires_grad_()).square().sum().backward()
    assert not all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), grads["none", 1]))  # differ before
    for key, got in grads.items():
        assert all(torch.equal(a, b) for a, b in zip(got, grads["none", 1])), key             # equal after


def test_the_best_spacing_is_near_sqrt_of_the_ratio():
    X, A, L = 1.0, 4.0, 64
    peaks = {k: ML.checkpoint_peak(L, k, X, A) for k in range(1, L + 1)}
    best = min(peaks, key=peaks.get)
    assert abs(best - ML.best_spacing(L, X, A)) <= 1 and ML.best_spacing(L, 1, 1) == math.sqrt(L)


def test_the_scaler_skips_each_step_with_an_inf_and_halves_its_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    run = train_with_scaler(model, [batch] * 10, nn.functional.mse_loss, inf_at={2, 3, 7}, growth_interval=2,
                            init_scale=2.0 ** 10)   # 2^16 overflows this model's fp16 gradients: step 0 skipped too
    assert [step for step, _, skipped, _ in run if skipped] == [2, 3, 7]
    scales = [scale for _, scale, _, _ in run]
    assert scales[3] == scales[2] / 2 and scales[4] == scales[3] / 2 and scales[8] == scales[7] / 2
    assert max(scales) > scales[0]   # it grew after clean steps


def test_bytes_per_parameter_match_the_playbook():
    assert [(n, round(a), round(b)) for n, a, b in ML.playbook_table()] == \
        [(1e9, 16, 20), (7e9, 112, 140), (70e9, 1120, 1400)]
    P = 24 * 8 + 8
    for fp32_grads, at_end, at_step in ((False, 16, 20), (True, 20, 18)):
        opt = MixedPrecisionAdamW(nn.Linear(24, 8), fp32_grads=fp32_grads)
        for _ in range(2):
            opt.model(torch.randn(3, 24).bfloat16()).float().sum().backward()
            held = sum(opt.bytes_held().values())
            if fp32_grads:
                opt.accumulate()
            opt.step()
            assert all(p.grad is None for p in opt.params)   # the next backward starts from zero
        assert (held, sum(opt.bytes_at_step.values())) == (at_end * P, at_step * P)


def _policies():
    return {str(rd): fsdp_policy_run(torch.bfloat16, rd, steps=2, micro=2)
            for rd in (torch.float32, torch.bfloat16)}


def test_fsdp2_collectives_move_the_policys_dtypes():
    res = launch(_policies, 2, timeout=60)[0]
    grads = {}
    start, ref = tiny_model().state_dict(), single_process_run(2, steps=2, micro=2, grads=grads)
    for rd, want in (("torch.float32", "float32"), ("torch.bfloat16", "bfloat16")):
        first, last = res[rd]["collectives"]
        assert {dt for kind, dt, _ in first + last if kind == "all_gather"} == {"bfloat16"}
        assert not [c for c in first if c[0] == "reduce_scatter"]          # accumulating: no reduction
        assert {dt for kind, dt, _ in last if kind == "reduce_scatter"} == {want}
        assert 0 < movement_error(res[rd]["weights"], ref, start) < 0.2
        got = res[rd]["grads"]   # first-step gradients: AdamW would hide a factor in them
        err = sum((got[k] - g).norm() ** 2 for k, g in grads.items()) ** 0.5
        assert 0 < err / sum(g.norm() ** 2 for g in grads.values()) ** 0.5 < 0.05


def test_fp8_error_and_what_the_scale_does():
    torch.manual_seed(0)
    a, b = torch.randn(32, 48), torch.randn(48, 16)
    a[0, 0] = 2000.0   # an outlier above fp8's 448
    exact = a @ b
    scaled, raw = fp8.fp8_matmul(a, b), fp8.fp8_matmul(a, b, scaled=False)
    assert fp8.relative_error(scaled, exact) < 0.1 < fp8.relative_error(raw, exact)


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="saves no op recomputes everything"):
        save_ops_policy([])
    with pytest.raises(ValueError, match="mode='fast'"):
        CheckpointedStack([nn.Linear(2, 2)], "fast")
    with pytest.raises(ValueError, match="bf16 needs no GradScaler: it has fp32's exponent range"):
        train_with_scaler(nn.Linear(2, 2), [], nn.functional.mse_loss, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k \(columns of a, rows of b\) = 24 must be a multiple of 16"):
        fp8.fp8_matmul(torch.randn(16, 24), torch.randn(24, 16))
    assert save_ops_policy(MATMULS)


def test_the_torch_only_script_trains_the_same_with_either_checkpointing(tmp_path, monkeypatch):
    from tests.torch_only import LAUNCH_VARS, load_copy, run_in_ranks
    from d2lpar.processes.commands import REPO
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    script = REPO / "d2lpar" / "examples" / "memory_torch.py"
    names = load_copy(script, tmp_path, monkeypatch)
    full, selective = names["main"](["--steps", "4"]), names["main"](["--steps", "4", "--selective"])
    assert full == selective and full[-1] < full[0]   # recomputing changes no number; it trains
    two = run_in_ranks(tmp_path / script.name, 2, ["--steps", "4"])
    assert two[0] != two[1] and all(r[-1] < r[0] for r in two)   # own data per rank; both train
    with pytest.raises(names["Usage"], match="--steps 0: give at least 1"):
        names["main"](["--steps", "0"])


def test_the_measured_backward_peak_is_the_sqrt_rules_formula_plus_a_constant():
    from d2lpar.infra.autograd_meter import peak_live_bytes
    b, s, d, heads, hidden, L = 2, 16, 32, 4, 128, 16
    x = torch.randn(b, s, d, requires_grad=True)
    torch.manual_seed(0)
    layer = TransformerLayer(d, heads, hidden)
    A = saved_bytes(lambda: layer(x), layer)
    X = saved_bytes(lambda: CheckpointedStack([layer], "full")(x), layer)
    rest = set()
    for k in (1, 2, 4):
        stack = CheckpointedStack([layer] * L, "full", k)
        peak = peak_live_bytes(lambda: torch.autograd.grad(stack(x).square().sum(), x))
        rest.add(peak - ML.checkpoint_peak(L, k, X, A))
    assert len(rest) == 1 and 0 < rest.pop() < A


def test_korthikanti_count_gives_the_papers_figures():
    assert round(ML.korthikanti_selective_overhead(2048, 12288, 96, 51200), 3) == 0.027
    assert round(ML.korthikanti_selective_overhead(2048, 20480, 105, 51200), 3) == 0.016


def test_fp8_rowwise_scales_confine_an_outlier_and_the_fallback_gives_the_same_values(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(64, 64, generator=g), torch.randn(64, 32, generator=g)
    a[::16, ::16] = 1e5
    clean = torch.ones(64, dtype=torch.bool)
    clean[::16] = False
    exact = a.double() @ w.double()
    tensor, row = fp8.fp8_matmul(a, w), fp8.fp8_matmul(a, w, rowwise=True)
    assert fp8.last_kernel == "torch._scaled_mm"
    assert fp8.relative_error(tensor[clean], exact[clean]) > 2 * fp8.relative_error(row[clean], exact[clean])

    def refuse(*args, **kwargs):
        raise RuntimeError("no fp8 kernel on this CPU")
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    again = fp8.fp8_matmul(a, w, rowwise=True)
    assert fp8.last_kernel.startswith("dequantised")
    assert torch.equal(again, row)


def _bn_stack(mode):
    torch.manual_seed(3)
    return CheckpointedStack([nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.Tanh())
                              for _ in range(3)], mode)


def test_checkpointing_updates_batchnorms_running_statistics_once_as_the_plain_model_does():
    """Recomputation runs BatchNorm's forward again; the stack restores its running statistics
    after it, so they (and num_batches_tracked) equal the plain model's. Under 0.1 s."""
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(4))
    runs = {}
    for mode in ("none", "full", "selective"):
        m = _bn_stack(mode)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        for _ in range(2):
            m(x).square().sum().backward()
        runs[mode] = m.state_dict(), [p.grad for p in m.parameters()]
    mean = "layers.0.1.running_mean"
    assert not torch.equal(before[mean], runs["none"][0][mean])   # the statistics moved
    for mode in ("full", "selective"):
        for k, v in runs["none"][0].items():
            assert torch.equal(runs[mode][0][k], v), (mode, k)
        assert all(torch.equal(a, b) for a, b in zip(runs[mode][1], runs["none"][1])), mode


def test_selective_checkpointing_refuses_an_in_place_layer_in_one_sentence():
    with pytest.raises(ValueError, match=r"selective checkpointing keeps the outputs of the ops it "
                                         r"saves, and layers.0.1 \(ReLU\(inplace=True\)\) changes "
                                         r"its input in place .*: use inplace=False, or "
                                         r"mode='full'"):
        CheckpointedStack([nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))], "selective")
    CheckpointedStack([nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))], "full")


def test_fp8_refuses_an_operand_that_is_not_finite_in_one_sentence():
    """One inf or nan gives a per-tensor scale of inf or nan, and every output nan (fp32 keeps it
    to a row); an inf below 448 x scale saturates to a finite number. So it is refused."""
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    a[3, 2] = float("inf")
    assert (a @ b)[~torch.isfinite((a @ b).sum(1))].shape[0] == 1   # fp32: row 3 only
    for kw, harm in (({}, "a per-tensor scale of inf"), ({"rowwise": True}, "its row's scale"),
                     ({"scaled": False}, "unscaled, an inf saturates to 448")):
        with pytest.raises(ValueError, match=r"a has 1 entry that is inf or nan \(the first at "
                                             r"\(3, 2\)\): fp8 cannot carry it \(e4m3 has no inf; "
                                             + harm):
            fp8.fp8_matmul(a, b, **kw)
    b[0, 5] = float("nan")
    with pytest.raises(ValueError, match=r"b has 1 entry that is inf or nan \(the first at "
                                         r"\(0, 5\)\)"):
        fp8.fp8_matmul(torch.randn(16, 32), b)


def test_a_mixed_precision_step_without_gradients_is_one_sentence():
    for fp32_grads in (False, True):
        opt = MixedPrecisionAdamW(nn.Linear(4, 4), fp32_grads=fp32_grads)
        with pytest.raises(ValueError, match=r"step\(\) found no gradient: call loss.backward\(\)"):
            opt.step()
        opt.model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
        if fp32_grads:
            opt.accumulate()
        opt.step()   # with a backward, it steps
