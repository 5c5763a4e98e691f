"""``python -m d2lpar bench pipeline`` runs its pieces (figures are printed by the bench, not asserted)."""

from d2lpar.bench import pipeline as bench
from d2lpar.cost import bubble


def test_bubble_rows_pair_each_measurement_with_its_formula_and_simulation():
    rows = bench.bubbles(ps=(2,), ms=(1, 2), tf=0.004, repeats=2)
    assert [(r.p, r.m, r.schedule) for r in rows] == [
        (2, 1, "naive"), (2, 1, "GPipe"), (2, 1, "1F1B"), (2, 1, "ZB-H1"),
        (2, 2, "GPipe"), (2, 2, "1F1B"), (2, 2, "interleaved 1F1B"), (2, 2, "ZB-H1")]
    for r in rows:
        v = 2 if r.schedule == "interleaved 1F1B" else 1
        assert r.formula == bubble.idle_fraction(r.schedule, r.p, r.m, v)
        assert abs(r.simulated - r.formula) < 1e-12
        assert 0.0 <= r.measured < 1.0
        assert r.latency >= 0.0 and r.overhead >= 0.0
        assert r.with_latency >= r.simulated   # latency and overhead only add idle time
    lines = bench.table(rows).splitlines()
    assert lines[-2].startswith("largest |measured - formula|: ")
    assert lines[-1].startswith("largest |measured - simulated with latency|: ")
    assert lines[-1].endswith("target <= 0.02)")
    assert max(len(line) for line in lines) < 100
