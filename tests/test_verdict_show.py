"""The printed timing verdicts follow the numbers, and ``show`` prints real source or says why not."""

import pytest

from d2lpar.infra.show import show, source_of
from d2lpar.infra.verdict import agreement_verdict, compare_verdict, hidden_fraction, overlap_verdict


def test_overlap_verdict_reads_the_ratio():
    assert overlap_verdict(0.105, 0.10, 0.08).startswith("overlapped (1.05x")
    assert overlap_verdict(0.18, 0.10, 0.08).startswith("no overlap in this run (1.80x")
    assert "50% of the shorter one hid" in overlap_verdict(0.14, 0.10, 0.08)
    assert overlap_verdict(0.105, 0.10, 0.08).endswith("the transfer hid behind the compute")
    assert overlap_verdict(0.105, 0.08, 0.10).endswith("the compute hid behind the transfer")
    assert hidden_fraction(0.10, 0.10, 0.08) == pytest.approx(1.0)
    assert overlap_verdict(0.07, 0.10, 0.08).startswith("below the limit (0.70x")
    assert "longer than one after the other" in overlap_verdict(0.30, 0.10, 0.08)
    assert max(len(line) for t in (0.1, 0.14, 0.18)
               for line in overlap_verdict(t, 0.1, 0.08, "all-reduce", "backward").splitlines()) < 100


def test_a_busy_machine_is_named_only_when_something_did_not_hide(monkeypatch):
    import os
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 4.0, 4.0))
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    busy = overlap_verdict(0.18, 0.10, 0.08)
    assert "a busy machine, load 99.0 on 2" in busy and max(map(len, busy.splitlines())) < 100
    assert "busy" not in overlap_verdict(0.105, 0.10, 0.08)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert "busy" not in overlap_verdict(0.18, 0.10, 0.08)


def test_compare_and_agreement_verdicts():
    assert compare_verdict("two", 1.02, "one", 1.0).startswith("two and one took the same time")
    assert compare_verdict("two", 0.5, "one", 1.0).startswith("two took 0.50x the time of one (less")
    wide = compare_verdict("k=4", 0.85, "k=1", 1.0, spread=0.9)
    assert wide == "k=4 took 0.85x the time of k=1: no difference shown beyond the run-to-run spread of 90%"
    assert "agrees" in agreement_verdict("bubble", 0.31, 0.30, 0.02)
    assert "is above the prediction" in agreement_verdict("bubble", 0.35, 0.30, 0.02)
    with pytest.raises(ValueError, match="positive times"):
        compare_verdict("a", 0.0, "b", 1.0)


def test_show_prints_the_source_and_where_it_lives(capsys):
    src = source_of(hidden_fraction)
    assert repr(src).startswith("# d2lpar/infra/verdict.py, lines ")
    assert "return (a + b - overlapped) / min(a, b)" in src.text
    assert "<span" in src._repr_html_()
    show(hidden_fraction)
    assert "def hidden_fraction" in capsys.readouterr().out


@pytest.mark.parametrize("obj, why", [(len, "no Python source"), (eval("lambda x: x"), "not in any file")])
def test_show_says_in_one_sentence_why_there_is_no_source(obj, why):
    with pytest.raises(ValueError, match=why) as e:
        source_of(obj)
    assert "\n" not in str(e.value)


def test_quiet_refuses_a_busy_machine_and_says_how_to_override(monkeypatch, capsys):
    import os
    from d2lpar.infra import timing
    monkeypatch.delenv(timing.ALLOW_LOAD, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    assert timing.quiet_or_exit() == 1
    out = capsys.readouterr().out
    assert "load average 7.50" in out and "D2LPAR_ALLOW_LOAD=1" in out
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert timing.quiet_or_exit() == 0
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 7.0, 6.0))
    monkeypatch.setenv(timing.ALLOW_LOAD, "1")
    assert timing.quiet_or_exit() == 0
    assert "D2LPAR_ALLOW_LOAD=1: not waited for quiet" in timing.load_line()
    assert len(timing.load_line("a reason")) < 100


def test_show_a_module_from_line_1_and_a_decorated_function_as_itself():
    import torch
    from d2lpar.infra import verdict
    assert repr(source_of(verdict)).startswith("# d2lpar/infra/verdict.py, lines 1-")

    @torch.no_grad()
    def doubled(x):
        return 2 * x
    src = source_of(doubled)
    assert "test_verdict_show.py" in src.where and "return 2 * x" in src.text
