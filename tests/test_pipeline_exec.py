"""The pipeline executor on real gloo ranks: gradients and trained parameters equal one process for
every schedule on 2, 3 and 4 ranks; activation peaks equal the formulas; bad input fails early."""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from d2lpar.cost import bubble
from d2lpar.processes.launch import RankFailed, launch
from d2lpar.strategies.pipeline import schedules as P
from d2lpar.strategies.pipeline.executor import check_stages, run_pipeline, run_schedule, split_model

NAMES = ["naive", "GPipe", "1F1B", "interleaved 1F1B", "ZB-H1"]


def model(seed=0):
    """Nine Linear layers (one frozen) with ReLUs between them: cut anywhere, stages differ in size."""
    torch.manual_seed(seed)
    layers = [m for _ in range(8) for m in (nn.Linear(12, 12), nn.ReLU())] + [nn.Linear(12, 5)]
    layers[4].weight.requires_grad_(False)
    return nn.Sequential(*layers)


def schedules(p, m):
    return [P.make_schedule(n, p, m, 2 if n == "interleaved 1F1B" else None) for n in NAMES]


def _all_schedules(p, m, X, y, shapes):
    rank, out = dist.get_rank(), {}
    for s in schedules(p, m):
        stages = split_model(model(), s.stages)
        mine = {k: stages[k] for k in s.stages_of(rank)}
        res = run_schedule(s, mine, X, y, nn.functional.cross_entropy, shapes[s.name])
        out[s.name] = {"grads": {k: [q.grad for q in st.parameters() if q.requires_grad]
                                 for k, st in mine.items()},
                       "peak": res["peak"], "mb_bytes": res["mb_bytes"]}
    return out


@pytest.mark.parametrize("p,B,m", [(2, 22, 4), (3, 20, 6), (4, 16, 4)])
def test_every_schedule_gives_the_single_process_gradient(p, B, m):
    X, y = torch.randn(B, 12, generator=torch.Generator().manual_seed(p)), torch.arange(B) % 5
    ref = model()
    nn.functional.cross_entropy(ref(X), y).backward()   # mean over the whole batch
    expected = [q.grad for q in ref.parameters() if q.requires_grad]
    assert all(g.abs().sum() > 0 for g in expected)      # a zero gradient could not tell schedules apart
    shapes = {s.name: check_stages(split_model(model(), s.stages), X, s.microbatches) for s in schedules(p, m)}
    results = launch(_all_schedules, p, p, m, X, y, shapes, timeout=60)
    for s in schedules(p, m):
        got = {}
        for res in results:
            got.update(res[s.name]["grads"])
        flat = [g for k in range(s.stages) for g in got[k]]
        assert len(flat) == len(expected), s.name
        for a, b in zip(flat, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{s.name} on {p} ranks")
        if p == 4 and s.name != "interleaved 1F1B":   # equal micro-batches: peaks in micro-batches
            peak = {k: v for res in results for k, v in res[s.name]["peak"].items()}
            per_mb = {k: v for res in results for k, v in res[s.name]["mb_bytes"].items()}
            held = [peak[k] / per_mb[k] for k in range(p)]
            assert held == bubble.peak_microbatches(s.name, p, 1 if s.name == "naive" else m), (s.name, held)


def test_training_steps_equal_one_process():
    batches = [(torch.randn(12, 12, generator=torch.Generator().manual_seed(i)), torch.arange(12) % 5)
               for i in range(3)]
    ref = model()
    start = [q.detach().clone() for q in ref.parameters()]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(ref(X), y).backward()
        opt.step()
    res = run_pipeline(P.zb_h1(3, 3), split_model(model(), 3), batches, lr=0.1)
    got = [res.params[k][name] for k, st in enumerate(split_model(model(), 3)) for name, _ in st.named_parameters()]
    moved = [not torch.equal(a, b) for a, b in zip(start, ref.parameters())]
    assert sum(moved) == len(start) - 1                  # all but the frozen weight moved ...
    for a, b in zip(got, ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)   # ... and agree
    assert len(res.losses) == 3 and res.losses[0] > res.losses[-1]


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if run_pipeline starts any rank: bad input must be caught in the caller."""
    import d2lpar.strategies.pipeline.executor as ex

    def refuse(*a, **k):
        raise AssertionError("a rank was launched: the error should come before any rank starts")
    monkeypatch.setattr(ex, "launch", refuse)


def test_mismatched_stages_fail_before_any_rank_starts(no_launch):
    stages = [nn.Sequential(nn.Linear(12, 8), nn.ReLU()), nn.Sequential(nn.Linear(6, 5))]
    with pytest.raises(ValueError, match=r"stage 0 outputs shape \(3, 8\), but stage 1 expects in_features=6"):
        run_pipeline(P.gpipe(2, 4), stages, [(torch.randn(12, 12), torch.arange(12) % 5)])
    with pytest.raises(P.ScheduleError, match="needs 4 stages, got 2"):
        run_pipeline(P.interleaved_1f1b(2, 2, 2), stages, [(torch.randn(12, 12), torch.arange(12) % 5)])


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(12, 12), 0

    def forward(self, x):
        self.calls += x.device.type != "meta"    # the caller's shape check runs it on meta tensors
        if self.calls == 3:
            raise RuntimeError("stage 1 broke on its third micro-batch")
        return self.lin(x)


def test_a_rank_that_raises_ends_the_run_and_is_named():
    stages = [nn.Linear(12, 12), Boom(), nn.Linear(12, 12), nn.Linear(12, 5)]
    t0 = time.perf_counter()
    with pytest.raises(RankFailed, match="rank 1 of 4 failed") as e:
        run_pipeline(P.one_f_one_b(4, 6), stages, [(torch.randn(12, 12), torch.arange(12) % 5)], timeout=30)
    assert "third micro-batch" in str(e.value)
    assert time.perf_counter() - t0 < 15   # the others, waiting in recv, were stopped, not timed out


class Pair(nn.Module):
    def forward(self, x):
        return x, x.sum()


def test_bad_stages_are_named_before_any_rank_starts(no_launch):
    batch = [(torch.randn(8, 12), torch.arange(8) % 5)]
    with pytest.raises(ValueError, match="stage 0 returns a tuple, but a pipeline stage sends one tensor"):
        run_pipeline(P.gpipe(2, 2), [Pair(), nn.Linear(12, 5)], batch)
    with pytest.raises(ValueError, match=r"stage 0 outputs torch.float64, but stage 1's parameters are torch.float32"):
        run_pipeline(P.gpipe(2, 2), [nn.Linear(12, 12).double(), nn.Linear(12, 5)],
                     [(torch.randn(8, 12, dtype=torch.float64), torch.arange(8) % 5)])
    with pytest.raises(ValueError, match=r"the input is torch.float64, but stage 0's parameters are torch.float32"):
        run_pipeline(P.gpipe(2, 2), [nn.Linear(12, 12), nn.Linear(12, 5)],
                     [(torch.randn(8, 12, dtype=torch.float64), torch.arange(8) % 5)])
    with pytest.raises(ValueError, match="lr=nan: give a finite learning rate"):
        run_pipeline(P.gpipe(2, 2), [nn.Linear(12, 12), nn.Linear(12, 5)], batch, lr=float("nan"))
    with pytest.raises(ValueError, match="run_pipeline got no batches"):
        run_pipeline(P.gpipe(2, 2), [nn.Linear(12, 12), nn.Linear(12, 5)], [])
    with pytest.raises(TypeError, match="split_model cuts a sequence of layers .* not a Linear"):
        split_model(nn.Linear(12, 12), 2)
    with pytest.raises(ValueError, match=r"batch 1 \(input shape \(1, 12\)\): a batch of 1 cannot be cut into 2"):
        run_pipeline(P.gpipe(2, 2), [nn.Linear(12, 12), nn.Linear(12, 5)], batch + [(torch.randn(1, 12), torch.arange(1))])


def test_a_shorter_last_batch_and_a_stage_without_parameters_equal_one_process():
    """A DataLoader's last batch is shorter: each batch's messages must be sized from that batch
    (with buffers sized from the first, a broadcasting loss silently read uninitialised memory)."""
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
    start = [q.detach().clone() for q in ref.parameters()]
    X = torch.randn(21, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(21, 1, generator=torch.Generator().manual_seed(2))
    batches = [(X[:8], y[:8]), (X[8:16], y[8:16]), (X[16:], y[16:])]   # the last has 5
    stages = [ref[0], ref[1], ref[2]]                   # the middle stage (Tanh) has no parameters
    res = run_pipeline(P.one_f_one_b(3, 2), [ref[0], ref[1], ref[2]], batches,
                       loss_fn=nn.functional.mse_loss, lr=0.1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for Xb, yb in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(ref(Xb), yb)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    assert not torch.equal(start[0], ref[0].weight)      # the reference moved ...
    torch.testing.assert_close(res.losses, losses, rtol=1e-5, atol=1e-7)   # ... and the pipeline with it
    got = [res.params[0]["weight"], res.params[0]["bias"], res.params[2]["weight"], res.params[2]["bias"]]
    for a, b in zip(got, ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-7)
    assert stages[1] is ref[1]


def test_split_balanced_cuts_by_parameters_after_layers_with_parameters():
    from d2lpar.strategies.pipeline.executor import split_balanced
    torch.manual_seed(0)
    layers = [nn.Flatten(), nn.Linear(784, 512)]
    for _ in range(6):
        layers += [nn.ReLU(), nn.Linear(512, 512)]
    model = nn.Sequential(*layers, nn.ReLU(), nn.Linear(512, 10))
    stages = split_balanced(model, 4)
    assert [len(s) for s in stages] == [2, 4, 4, 6]        # [Flatten L0] [RL RL] [RL RL] [RL RL RL]
    assert sum(len(s) for s in stages) == len(model)
    params = [sum(q.numel() for q in s.parameters()) for s in stages]
    by_count = [sum(q.numel() for q in s.parameters()) for s in split_model(model, 4)]
    assert max(params) < max(by_count) and min(params) > min(by_count)
    x = torch.randn(3, 1, 28, 28)
    out = x
    for s in stages:
        out = s(out)
    assert torch.equal(out, model(x))


def test_each_rank_records_the_peak_of_its_stages_together():
    torch.manual_seed(0)
    X, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)]
    net = nn.Sequential(*blocks, nn.Linear(8, 4))
    s = P.interleaved_1f1b(2, 4, 2)
    res = run_pipeline(s, split_model(net, 4), [(X, y)])
    walked = []
    for acts in s.order:
        held = peak = 0
        for a in acts:
            held += res.mb_bytes[a.stage] if a.kind == "F" else -res.mb_bytes[a.stage]
            peak = max(peak, held)
        walked.append(peak)
    assert res.rank_peak_bytes == walked
    assert all(r >= max(res.peak_bytes[st] for st in s.stages_of(i))
               for i, r in enumerate(res.rank_peak_bytes))


def test_a_first_stage_without_parameters_and_a_pipeline_without_any_equal_one_process():
    """Stage 0's output needs no gradient when it has no parameters (its input is the batch): its
    backward has nothing to do. Two 3-rank runs, 1F1B and ZB-H1, about 1 s."""
    torch.manual_seed(5)
    X, y = torch.randn(9, 6), torch.randn(9, 2)
    ref = nn.Sequential(nn.Tanh(), nn.Linear(6, 4), nn.Linear(4, 2))
    start = [q.detach().clone() for q in ref.parameters()]
    res = run_pipeline(P.one_f_one_b(3, 3), list(ref), [(X, y), (X[:5], y[:5])],
                       loss_fn=nn.functional.mse_loss, lr=0.1)
    opt, losses = torch.optim.SGD(ref.parameters(), lr=0.1), []
    for Xb, yb in [(X, y), (X[:5], y[:5])]:
        opt.zero_grad()
        loss = nn.functional.mse_loss(ref(Xb), yb)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    assert not torch.equal(start[0], ref[1].weight)
    torch.testing.assert_close(res.losses, losses, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res.params[1]["weight"], ref[1].weight.detach(), rtol=1e-5,
                               atol=1e-7)
    free = [nn.ReLU(), nn.Tanh(), nn.Sigmoid()]        # no parameters anywhere: a loss, no step
    res = run_pipeline(P.zb_h1(3, 3), free, [(X, X.flip(0))], loss_fn=nn.functional.mse_loss)
    one = nn.functional.mse_loss(nn.Sequential(*free)(X), X.flip(0))
    assert res.losses == pytest.approx([one.item()])


def test_targets_that_do_not_fit_the_inputs_are_named_before_any_rank_starts(no_launch):
    stages = [nn.Linear(6, 6), nn.Linear(6, 2)]
    with pytest.raises(ValueError, match=r"batch 1 has 8 inputs but 6 targets: give one target "
                                         r"per input"):
        run_pipeline(P.gpipe(2, 2), stages, [(torch.randn(8, 6), torch.arange(8) % 2),
                                            (torch.randn(8, 6), torch.arange(6) % 2)])
