"""The balanced cut: contiguous, none empty, and its largest piece the smallest possible."""

import itertools

from d2lpar.infra.partition import balanced_bounds


def test_the_cut_is_contiguous_and_its_largest_piece_is_the_smallest_possible():
    weights = [5, 1, 1, 1, 4, 4, 2]
    for parts in range(1, len(weights) + 1):
        bounds = balanced_bounds(weights, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(weights) and len(bounds) == parts
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))   # contiguous
        assert all(a < b for a, b in bounds)                              # none empty
        got = max(sum(weights[a:b]) for a, b in bounds)
        brute = min(max(sum(weights[a:b]) for a, b in zip((0,) + cuts, cuts + (len(weights),)))
                    for cuts in itertools.combinations(range(1, len(weights)), parts - 1))
        assert got == brute, parts
