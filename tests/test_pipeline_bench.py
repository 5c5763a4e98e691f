"""``python -m d2lpar bench pipeline`` runs its pieces (figures are printed by the bench, not asserted)."""

from d2lpar.bench import pipeline as bench
from d2lpar.cost import bubble


def test_bubble_rows_pair_each_measurement_with_its_formula_and_simulation():
    rows = bench.bubbles(ps=(2,), ms=(1, 2), tf=0.004)
    assert [(p, m, name) for p, m, name, *_ in rows] == [
        (2, 1, "naive"), (2, 1, "GPipe"), (2, 1, "1F1B"), (2, 1, "ZB-H1"),
        (2, 2, "GPipe"), (2, 2, "1F1B"), (2, 2, "interleaved 1F1B"), (2, 2, "ZB-H1")]
    for p, m, name, measured, formula, simulated in rows:
        v = 2 if name == "interleaved 1F1B" else 1
        assert formula == bubble.idle_fraction(name, p, m, v)
        assert abs(simulated - formula) < 1e-12
        assert 0.0 <= measured < 1.0
