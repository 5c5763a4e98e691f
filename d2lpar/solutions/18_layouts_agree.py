"""Worked solutions to the exercises of notebook 18 (one model, every layout, the same training).

The runs here are notebook 18's model and data for fewer steps (8), on 2 ranks."""

import functools

import torch

from d2lpar.infra.text import CharCorpus, make_text
from d2lpar.strategies.agreement import checker as C
from d2lpar.strategies.agreement import model as M
from d2lpar.strategies.agreement import rules as R
from d2lpar.strategies.agreement.layouts import Layout

SEQ, ROWS, STEPS = 32, 8, 8


@functools.cache
def _setup():
    corpus = CharCorpus(make_text())
    cfg = M.Config(corpus.vocab, seq=SEQ, layers=2, d=32, heads=4, hidden=64, p=0.1, seed=0)
    return corpus, cfg, M.variable_batches(corpus, STEPS, ROWS, SEQ)


def megatron(d: M.Draw) -> torch.Tensor:
    """Megatron-LM's streams as a rule: each rank draws its own slice's shape; tensors split over the
    tensor ranks (features, or under sequence parallelism positions: ``d.sharded``) from seed + 2718
    + tensor rank, the tensor-parallel stream; replicated ones from the seed; + 100 per pipeline
    rank (``_set_random_seed``, ``model_parallel_cuda_manual_seed``; with sequence parallelism
    ``transformer_block.py`` runs the whole block in the tensor-parallel stream)."""
    key = M.key_of(d.seed, d.what, d.step) + 100 * d.coords["pp"]
    if d.sharded:
        key += 2718 + d.coords["tp"]
    return torch.rand(d.local_shape, generator=torch.Generator().manual_seed(key))


def exercise_1():
    """Both outside the band from step 1 (loss), and neither is a bug. Megatron's masks are
    independent where a tensor is split over the tensor ranks (the MLP's features; under sequence
    parallelism the residual stream's positions too) and equal where the ranks hold copies (the
    residual stream without sequence parallelism), which is what dropout needs, unlike section
    4.2's planted rule, whose copies get different masks; but the split tensors' masks are not the
    numbers one device draws, so no comparison with one device can accept them. A trainer with this
    rule is checked with the dropout off for the comparison (p = 0), or against a reference that
    draws the same way, or by statistics (the fraction dropped, the masks' independence)."""
    _, cfg, batches = _setup()
    report = C.check_layouts(cfg, batches, [
        Layout(tp=2, dropout=megatron, label="tp 2, Megatron's streams"),
        Layout(tp=2, sp=True, dropout=megatron, label="tp 2 + sp, Megatron's streams")])
    for v in report.verdicts:
        print(v.line())
        assert v.first == 1 and v.what == "loss"
    # the statistics are right: split masks differ across ranks, replicated ones agree
    for sharded, width in ((True, cfg.hidden // 2), (False, cfg.d)):
        masks = [megatron(M.Draw("dropout 1.x", 1, (ROWS, SEQ, width * (2 if sharded else 1)),
                                 (slice(0, ROWS), slice(0, SEQ),
                                  slice(k * width if sharded else 0, (k + 1) * width if sharded
                                        else width)), sharded,
                                 {"dp": 0, "tp": k, "pp": 0, "cp": 0}, 0)) >= cfg.p
                 for k in (0, 1)]
        print(f"{'split' if sharded else 'replicated'} features: the two ranks' masks equal "
              f"{torch.equal(*masks)}, dropped {1 - masks[0].float().mean():.3f} (p = {cfg.p})")
        assert torch.equal(*masks) == (not sharded)
    return report


def exercise_2():
    """Within the band. With every row as long as the sequence, every micro-batch holds the same
    number of real tokens n, so 1/(m n) = 1/N: the per-micro-batch mean is the global mean. A test
    on unpadded data of equal lengths cannot see this bug; padding, packing and variable lengths
    are what expose it."""
    corpus, cfg, _ = _setup()
    even = M.variable_batches(corpus, STEPS, ROWS, SEQ, shortest=SEQ)
    assert all(int((Y != M.IGNORE).sum()) == ROWS * SEQ for _, Y in even)
    report = C.check_layouts(cfg, even, [Layout(pp=2, microbatches=4, loss=R.per_microbatch_mean,
                                                label="pp 2, m 4, per micro-batch, equal rows")])
    print(report.lines()[0])
    assert report.verdicts[0].first is None
    return report


def exercise_3():
    """Each micro-batch's tokens weigh 1/(m n_k) against 1/N: a factor N/(m n_k). Micro-batches
    with fewer tokens than the average N/m weigh more, those with more weigh less; the factors,
    weighted by the tokens, average to 1 (both weightings give the micro-batches' tokens a total
    weight of 1), so the loss is the same number and the gradient is not."""
    _, _, batches = _setup()
    Y = batches[0][1]
    m = 4
    counts = [int((Y[a:a + ROWS // m] != M.IGNORE).sum()) for a in range(0, ROWS, ROWS // m)]
    N = sum(counts)
    factors = [N / (m * n) for n in counts]
    print(f"tokens per micro-batch {counts}, N = {N}; each token's weight against 1/N: "
          + ", ".join(f"{f:.3f}" for f in factors))
    assert abs(sum(n * f for n, f in zip(counts, factors)) / N - 1) < 1e-12
    assert min(factors) < 1 < max(factors)
    return factors


def exercise_4():
    """A verdict's ``by`` is its largest difference in bands, so a layout stays within any factor
    above FACTOR x by, and a bug is caught by any factor below FACTOR x by (the difference at its
    first step outside, in bands of FACTOR). Here a correct layout needs a factor of about 1 (its
    rounding differs as much as a reordered run's), and the weakest bug is still caught with a
    factor of about a thousand: the band's factor of 4 is far from both."""
    _, cfg, batches = _setup()
    good = [Layout(tp=2, sp=True), Layout(pp=2, microbatches=4)]
    bad = [Layout(tp=2, sp=True, dropout=R.same_seed_local, label="equal masks"),
           Layout(pp=2, microbatches=4, loss=R.per_microbatch_mean, label="per micro-batch")]
    report = C.check_layouts(cfg, batches, good + bad, checks=(1, STEPS))
    need = max(v.by for v in report.verdicts[:2]) * C.FACTOR
    catch = min(v.by for v in report.verdicts[2:]) * C.FACTOR
    print(f"smallest factor keeping the correct layouts within: {need:.2f}; largest still "
          f"catching both bugs: {catch:.0f}")
    assert need < C.FACTOR < catch
    return need, catch
