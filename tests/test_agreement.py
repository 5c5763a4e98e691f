"""The layout checker (d2lpar.strategies.agreement): bad input refused in one sentence before any
rank starts; the band measured on one device, wider in bf16; correct layouts within it and planted
divergences outside it, on 3 and 5 ranks, with rules notebook 18 does not plant (dropout keyed by
the pipeline rank, a per-sequence loss, every rank drawing its own weights from seed + rank).

Notebook 18 runs 2 and 8 ranks (every kind, fp32 and bf16, and its five planted bugs); these tests
run what it does not: 3 ranks (uneven shares of an 8-row batch, ZeRO's padding, a 3-stage pipeline,
a 3-way ring, ZeRO-3's gradient norm catching a halved loss) and 5 ranks (tensor parallelism
over 5 heads, sequence parallel). Cost here (2 cores,
a load of 7-9): 9-11 s, the two launches most of it (a session's first launch adds about 2 s).
"""

import math
import re

import pytest
import torch

from d2lpar.infra.text import CharCorpus, make_text
from d2lpar.processes.commands import leftovers
from d2lpar.strategies.agreement import checker as C
from d2lpar.strategies.agreement import rules as R
from d2lpar.strategies.agreement.layouts import Layout
from d2lpar.strategies.agreement.model import Config, Draw, key_of, variable_batches

CORPUS = CharCorpus(make_text(4000))


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    assert leftovers() == [], "a launcher or worker outlived its test"


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a rank was started before the input was checked")
    monkeypatch.setattr(C, "launch", refuse)
    monkeypatch.setattr(C, "measure_band", refuse)


def small(**kw):
    base = dict(vocab=CORPUS.vocab, seq=24, layers=1, d=24, heads=3, hidden=48, p=0.1)
    base.update(kw)
    return Config(**base)


@pytest.mark.parametrize("layout, kw, says", [
    (Layout(dp=2, tp=2), {"world": 8}, "dp x tp x pp x cp = 4, not the world size 8"),
    (Layout(tp=2), {}, "tensor degree 2 does not divide heads=3"),
    (Layout(pp=4), {}, "pipeline degree 4 is more than the model's 3 layers"),
    (Layout(cp=5), {}, "context parallelism cuts seq=24 over cp=5"),
    (Layout(cp=2, dp=2), {}, "context parallelism runs alone"),
    (Layout(tp=3, sp=True), {"cfg": small(seq=20)}, "sequence parallelism cuts seq=20 over tp=3"),
    (Layout(sp=True), {}, "sp=True cuts the sequence over the tensor ranks: it needs tp > 1"),
    (Layout(dp=0), {}, "dp=0: give a whole number of at least 1"),
    (Layout("zero", dp=2, zero=4), {}, "ZeRO's stage is 1, 2 or 3"),
    (Layout("ddp", dp=2, tp=3), {}, "kind 'ddp' splits over dp only, not tp"),
    (Layout("mesh"), {}, "kind='mesh': use one of hand"),
    (Layout(dp=3, microbatches=3), {}, "a global batch of 8 rows gives its 3 data-parallel rank"),
    (Layout(dropout=0.1), {}, "dropout=0.1 is not a function"),
    (Layout(dp=2), {"steps": 0}, "steps=0: give a whole number of steps, at least 1"),
    (Layout(dp=2), {"steps": 5}, "the data holds 4 batches, fewer than steps=5"),
    (Layout(dp=2), {"factor": -1.0}, "factor (the band in measured spreads)=-1.0"),
    (Layout(dp=2), {"factor": math.nan}, "factor (the band in measured spreads)=nan"),
    (Layout(dp=2), {"checks": (0, 2)}, "checks=(0, 2): give steps between 1 and 4"),
    (Layout(dp=2), {"cfg": small(heads=5)}, "d=24 does not split into heads=5"),
])
def test_bad_input_is_one_sentence_before_any_rank_starts(layout, kw, says, no_launch):
    cfg = kw.pop("cfg", small())
    batches = variable_batches(CORPUS, 4, 8, cfg.seq)
    with pytest.raises(ValueError, match=re.escape(says)):
        C.check_layouts(cfg, batches, [layout], **kw)


def test_no_layouts_and_padding_only_batches_are_refused(no_launch):
    cfg = small()
    batches = variable_batches(CORPUS, 2, 8, cfg.seq)
    with pytest.raises(ValueError, match="no layouts given"):
        C.check_layouts(cfg, batches, [])
    X, Y = batches[0]
    with pytest.raises(ValueError, match="batch 0 has no real token to score"):
        C.check_layouts(cfg, [(X, torch.full_like(Y, -100))], [Layout(dp=2)])
    with pytest.raises(ValueError, match=r"batch 0 has inputs \(8, 12\)"):
        C.check_layouts(cfg, [(X[:, :12], Y[:, :12])], [Layout(dp=2)])


def test_the_band_is_measured_and_wider_in_bf16():
    cfg = small()
    batches = variable_batches(CORPUS, 6, 8, cfg.seq)
    fp32 = C.measure_band(cfg, batches, 6, (1, 6), "fp32")
    bf16 = C.measure_band(cfg, batches, 6, (1, 6), "bf16")
    for order in ("reversed", "rows"):
        reordered = fp32.others[order].losses
        assert any(a != b for a, b in zip(reordered, fp32.reference.losses)), f"{order} is no order"
    assert set(bf16.others) == {"reversed", "rows", "fp32"}
    assert all(b > 10 * f for b, f in zip(bf16.loss, fp32.loss)), (bf16.loss, fp32.loss)
    assert all(x <= y for x, y in zip(fp32.loss, fp32.loss[1:]))   # the largest spread so far
    assert fp32.loss == [C.FACTOR * max(m, f) for m, f in zip(fp32.measured["loss"],
                                                              fp32.floor["loss"])]
    # fp32's loss moves by about one rounding unit (its band is about the floor); bf16's far more
    assert 0.25 < max(m / f for m, f in zip(fp32.measured["loss"], fp32.floor["loss"])) < 8
    assert all(m > 10 * f for m, f in zip(bf16.measured["loss"], bf16.floor["loss"]))
    # after updates the weights' band is measured, far above one rounding unit of their size
    size = math.sqrt(sum(float(v.pow(2).sum()) for v in fp32.reference.weights[6].values()))
    assert fp32.floor["weights"][6] >= C.EPS32 * size * (1 - 1e-9)
    assert fp32.measured["weights"][6] > 100 * fp32.floor["weights"][6]


def test_judge_names_the_first_step_and_what_left_the_band():
    cfg = small()
    batches = variable_batches(CORPUS, 4, 8, cfg.seq)
    band = C.measure_band(cfg, batches, 4, (1, 4))
    ref = band.reference
    same = C.Run(list(ref.losses), dict(ref.grad_norms))
    assert C.judge(Layout(), same, band).line() == "1 rank: within the band"
    moved = C.Run([v + (5 * band.loss[i] if i == 2 else 0) for i, v in enumerate(ref.losses)],
                  dict(ref.grad_norms))
    assert C.judge(Layout(), moved, band).line() == "1 rank: outside the band from step 3 (loss)"
    scaled = C.Run(list(ref.losses), {k: v / 2 for k, v in ref.grad_norms.items()})
    assert C.judge(Layout(), scaled, band).first == 1 and C.judge(Layout(), scaled, band).what \
        == "gradient norm"
    nan = C.Run([math.nan] * 4)
    assert C.judge(Layout(), nan, band).first == 1
    # every rank's part of the weights is compared: one rank's copy 5 bands away is caught
    full = lambda w: {n: (tuple(slice(0, m) for m in v.shape), v) for n, v in w.items()}  # noqa
    near = {k: [full(w)] * 2 for k, w in ref.weights.items()}
    assert C.judge(Layout(), C.Run(list(ref.losses), dict(ref.grad_norms), copies=near),
                   band).first is None
    moved = dict(ref.weights[4])
    moved["1.fc2.bias"] = moved["1.fc2.bias"] + 5 * band.weights[4]
    far = {**near, 4: [full(ref.weights[4]), full(moved)]}
    verdict = C.judge(Layout(), C.Run(list(ref.losses), dict(ref.grad_norms), copies=far), band)
    assert verdict.line() == "1 rank: outside the band from step 4 (weights)"


def pp_keyed(d: Draw) -> torch.Tensor:
    """A seed rule notebook 18 does not plant: masks keyed by the pipeline rank (Megatron's +100
    per stage), each stage drawing the global tensor."""
    g = torch.Generator().manual_seed(key_of(d.seed, d.what, d.step) + 100 * d.coords["pp"])
    return torch.rand(d.shape, generator=g)[d.index]


def per_sequence(total, tokens, norm):
    """A normalisation notebook 18 does not plant: the mean over sequences of each one's token mean
    (here: the micro-batch's mean, each row its own micro-batch)."""
    return total / max(tokens, 1) / norm.microbatches


def halved(total, tokens, norm):
    """A normalisation notebook 18 does not plant: the right loss / 2 (every gradient halved)."""
    return R.global_tokens(total, tokens, norm) / 2


def seed_plus_rank(d: Draw) -> torch.Tensor:
    """Every rank draws its own part from seed + its tensor rank (valid statistics, not one
    device's numbers)."""
    g = torch.Generator().manual_seed(key_of(d.seed, d.what, d.step) + d.coords["tp"])
    return torch.rand(d.local_shape, generator=g)


def test_three_ranks_within_and_planted_rules_outside():
    cfg = small()
    batches = variable_batches(CORPUS, 3, 8, cfg.seq, seed=3)
    good = [Layout("zero", dp=3, zero=2), Layout(pp=3, microbatches=3), Layout(cp=3),
            Layout(dp=3, microbatches=2)]
    bad = [Layout(pp=3, microbatches=3, dropout=pp_keyed, label="dropout keyed by pp rank"),
           Layout(pp=3, microbatches=8, loss=per_sequence, label="per-sequence mean"),
           Layout("zero", dp=3, zero=3, loss=halved, label="ZeRO-3, loss halved")]
    report = C.check_layouts(cfg, batches, good + bad, checks=(1, 3))
    assert report.lines()[:len(good)] == [f"{lay.name}: within the band" for lay in good]
    assert report["dropout keyed by pp rank"].line().endswith("from step 1 (loss)")
    assert report["per-sequence mean"].line().endswith("from step 1 (gradient norm)")
    # ZeRO's gradient norm, measured on its shards inside its step, catches a scale AdamW hides
    zero = report["ZeRO-3, loss halved"]
    assert zero.line().endswith("from step 1 (gradient norm)")
    ratio = zero.run.grad_norms[1] / report["ZeRO-2 dp 3"].run.grad_norms[1]
    assert ratio == pytest.approx(0.5, rel=1e-5)


def test_five_ranks_tensor_parallel_and_copied_shards():
    cfg = small(d=20, heads=5, hidden=40, seq=20)
    batches = variable_batches(CORPUS, 2, 8, cfg.seq, seed=5)
    lays = [Layout(tp=5, sp=True), Layout(tp=5, init=seed_plus_rank, label="seed + tp rank"),
            Layout(tp=5, init=R.same_seed_local, label="one seed")]
    report = C.check_layouts(cfg, batches, lays, steps=2, checks=(1, 2))
    assert report.lines() == ["tp 5 + sp: within the band",
                              "seed + tp rank: outside the band from step 1 (loss)",
                              "one seed: outside the band from step 1 (loss)"]
    parts = report["one seed"].run.copies[1]       # the weights before step 1, every rank's part
    rows = [p["1.fc1.weight"][1] for p in parts]
    assert all(torch.equal(rows[0], r) for r in rows[1:])   # five copies of one shard
    rows = [p["1.fc1.weight"][1] for p in report["tp 5 + sp"].run.copies[1]]
    assert not torch.equal(rows[0], rows[1])
