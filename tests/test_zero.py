"""ZeRO stages 1-3 by hand equal single-process AdamW; bytes held and sent equal the formulas."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.processes.launch import launch
from d2lpar.strategies.sharded import zero as Z

STEPS, BATCH = 3, 24


def tricky_model(seed=0):
    """Odd widths (no N divides them), a frozen parameter and a weight tied across two layers."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 13), nn.Tanh(),
                        nn.Linear(13, 13), nn.ReLU(), nn.Linear(13, 3))
    net[4].weight = net[2].weight
    net[0].bias.requires_grad_(False)
    return net


def batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 7, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def single_process(net, data):
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    for X, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return net.state_dict()


def _train(stages, make_model, data, kwargs):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in stages:
        net = make_model()
        opt = Z.ZeroAdamW(net, stage, lr=1e-2, **kwargs)
        sent = []
        for X, y in data:
            before = opt.counter.sent
            part = slice(rank * len(X) // n, (rank + 1) * len(X) // n)
            nn.functional.cross_entropy(net(X[part]), y[part]).backward()
            opt.step()
            sent.append(opt.counter.sent - before)
        out[stage] = {"state": opt.full_state_dict(), "held": opt.held(), "sent": sent,
                      "numel": opt.numel(), "formula": opt.formula(), "peak": opt.peak_gathered,
                      "units": [u.padded * 4 for u in opt.units]}
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_stage_equals_single_process_adamw(n):
    data = batches()
    start = tricky_model().state_dict()
    expected = single_process(tricky_model(), data)
    results = launch(_train, n, Z.STAGES, tricky_model, data, {}, timeout=90)
    moved = [k for k in expected if not torch.allclose(start[k], expected[k])]
    assert sorted(moved) == sorted(set(expected) - {"0.bias"}), "training moved every trainable tensor"
    for rank, res in enumerate(results):
        for stage in Z.STAGES:
            got = res[stage]["state"]
            for k in moved:
                assert not torch.allclose(got[k], start[k])  # differ before ...
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage}, rank {rank} of {n}: {m}")
            f = res[stage]["formula"]
            assert res[stage]["held"] == {k: f[k] for k in ("params", "grads", "optimizer")}
            assert res[stage]["sent"] == [f["sent"]] * STEPS
            if stage < 3:  # one Psi for the whole model: 2 (N-1)/N 4 Psi
                assert f["sent"] == Z.sent_bytes(stage, res[stage]["numel"], n)
            if stage == 3:
                assert res[stage]["peak"] == max(res[stage]["units"][1:] or [0]) + res[stage]["units"][0]


def test_prefetch_holds_two_units_and_changes_nothing():
    data = batches()
    make = lambda: nn.Sequential(nn.Linear(7, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                                 nn.Linear(12, 3))
    torch.manual_seed(0)
    expected = single_process(make(), data)
    seeded = lambda: (torch.manual_seed(0), make())[1]
    plain, pre = [launch(_train, 2, (3,), seeded, data, kw, timeout=60)[0][3]
                  for kw in ({}, {"prefetch": True})]
    for res in (plain, pre):
        torch.testing.assert_close(res["state"], expected, rtol=1e-5, atol=1e-6)
        assert res["sent"] == [Z.sent_bytes(3, res["numel"], 2)] * STEPS  # no root unit: 1.5x DP
    sizes = plain["units"]
    assert plain["peak"] == max(sizes)
    assert pre["peak"] == max(a + b for a, b in zip(sizes, sizes[1:]))


def _bad_stage():
    Z.ZeroAdamW(nn.Linear(2, 2), 4)


def _disagree():
    net = nn.Linear(2, 3 if dist.get_rank() else 2)
    Z.ZeroAdamW(net, 1)


def test_bad_input_is_named():
    from d2lpar.processes.launch import RankFailed
    with pytest.raises(RankFailed, match="stage must be 1, 2 or 3, got 4"):
        launch(_bad_stage, 1, timeout=30)
    with pytest.raises(RankFailed, match="disagree on the trainable parameters"):
        launch(_disagree, 2, timeout=30)
    with pytest.raises(RuntimeError, match="none is initialised"):
        Z.ZeroAdamW(nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="AdamW needs finite lr >= 0.*lr=nan"):   # before any rank talks
        Z.ZeroAdamW(nn.Linear(2, 2), 1, lr=float("nan"))
    with pytest.raises(ValueError, match="stage"):
        Z.sent_bytes(5, 10, 2)


# --------------------------------------- every rank starts from rank 0's values; unused layers are skipped

class _WithState(nn.Module):
    """A frozen layer and a buffer that shape the output, so their start values matter."""

    def __init__(self):
        super().__init__()
        self.frozen, self.a, self.b = nn.Linear(7, 9), nn.Linear(9, 13), nn.Linear(13, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer("shift", torch.randn(9))

    def forward(self, x):
        return self.b(torch.tanh(self.a(self.frozen(x) + self.shift)))


def _seeded_by_rank(stage, data):
    torch.manual_seed(dist.get_rank())  # every rank builds a different model: rank 0's must win
    net = _WithState()
    return _train_state(net, stage, data)


def _train_state(net, stage, data, used=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    opt = Z.ZeroAdamW(net, stage, lr=1e-2, weight_decay=0.1)
    for step, (X, y) in enumerate(data):
        part = slice(rank * len(X) // n, (rank + 1) * len(X) // n)
        out = net(X[part]) if used is None else net(X[part], used[step])
        nn.functional.cross_entropy(out, y[part]).backward()
        opt.step()
    return opt.full_state_dict()


def _single_adamw(net, data, used=None):
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1)
    for step, (X, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        out = net(X) if used is None else net(X, used[step])
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    return net.state_dict()


@pytest.mark.parametrize("stage", Z.STAGES)
def test_frozen_parameters_and_buffers_start_from_rank_0(stage):
    data = batches()
    torch.manual_seed(0)
    expected = _single_adamw(_WithState(), data)
    for rank, got in enumerate(launch(_seeded_by_rank, 3, stage, data, timeout=60)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"stage {stage}, rank {rank} of 3: {m}")


class _Sometimes(nn.Module):
    """``extra`` (a unit of its own) and ``pair[1]`` (half of a unit) are used only on some steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.b = nn.Linear(7, 13), nn.Linear(13, 13), nn.Linear(13, 3)
        self.pair = _Pair()

    def forward(self, x, use_extra):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.extra(h)) if use_extra else h
        return self.b(self.pair(h, use_extra))


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(13, 13), nn.Linear(13, 13)

    def forward(self, h, use_second):
        h = torch.tanh(self.first(h))
        return torch.tanh(self.second(h)) if use_second else h


USED = [True, False, False, True, False]


@pytest.mark.parametrize("stage", Z.STAGES)
def test_a_layer_left_out_of_a_step_is_not_stepped_as_torch_does(stage):
    data = [(torch.randn(BATCH, 7, generator=torch.Generator().manual_seed(s)),
             torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(s + 9)))
            for s in range(len(USED))]
    start = _Sometimes().state_dict()
    expected = _single_adamw(_Sometimes(), data, USED)
    for k in ("extra.weight", "pair.second.bias"):
        assert not torch.allclose(expected[k], start[k])
    for rank, got in enumerate(launch(_train_state_sometimes, 2, stage, data, timeout=60)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"stage {stage}, rank {rank} of 2: {m}")


def _train_state_sometimes(stage, data):
    return _train_state(_Sometimes(), stage, data, USED)


# ------------------------------------- the bytes-held check fails on a stage 2 that keeps full gradients

class _ForgetfulStage2(Z.ZeroAdamW):
    """A planted bug: the reduce-scatter runs, but every full ``.grad`` is put back afterwards."""

    def _reduce_unit(self, u):
        kept = [p.grad for p in u.params]
        super()._reduce_unit(u)
        for p, g in zip(u.params, kept):
            p.grad = g  # the line stage 2 exists to remove: full gradients stay alive


def _held_after_training(forgetful):
    rank, n = dist.get_rank(), dist.get_world_size()
    net = tricky_model()
    opt = (_ForgetfulStage2 if forgetful else Z.ZeroAdamW)(net, 2, lr=1e-2)
    for X, y in batches():
        part = slice(rank * len(X) // n, (rank + 1) * len(X) // n)
        nn.functional.cross_entropy(net(X[part]), y[part]).backward()
        opt.step()
    return opt.held(), opt.formula()


def test_held_counts_full_gradients_a_stage_2_forgot_to_drop():
    for good, f in launch(_held_after_training, 2, False, timeout=60):
        assert good == {k: f[k] for k in ("params", "grads", "optimizer")}
    for held, f in launch(_held_after_training, 2, True, timeout=60):
        trainable = sum(p.numel() for p in tricky_model().parameters() if p.requires_grad)
        assert held["grads"] == f["grads"] + 4 * trainable  # the shard + every full gradient
        assert held != {k: f[k] for k in ("params", "grads", "optimizer")}
