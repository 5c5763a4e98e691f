import time

import matplotlib
import pytest

from d2lpar.infra.timing import Benchmark, Span, Timeline, Timer

matplotlib.use("Agg")


def test_timer_and_benchmark(capsys):
    t = Timer()
    time.sleep(0.01)
    assert t.stop() >= 0.01
    with Benchmark("sleep") as b:
        time.sleep(0.01)
    assert b.elapsed >= 0.01
    assert capsys.readouterr().out.startswith("sleep: 0.0")


def test_timeline_accounting():
    tl = Timeline([("a", "x", 0.0, 2.0), ("b", "y", 1.0, 3.0), ("a", "x", 4.0, 5.0)])
    assert tl.lanes == ["a", "b"]
    assert tl.makespan() == 5.0
    assert tl.busy("a") == 3.0
    assert tl.overlap("a", "b") == 1.0
    with tl.span("c", "z"):
        pass
    assert len(tl) == 4 and isinstance(tl.spans[-1], Span)


def test_plot_timeline():
    from d2lpar.infra.plot import plot_timeline
    ax = plot_timeline(Timeline([("rank 0", "compute", 0, 1), ("rank 1", "send", 0.5, 2)]))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    with pytest.raises(ValueError, match="no spans"):
        plot_timeline(Timeline())
