"""Where a launch spent its time: the phases add up to the launch, and the one that held it up is
named with the rank that finished it last. Marks are made up here, no process starts (< 0.1 s)."""

from d2lpar.processes.phases import NAMES, Phases, phase_table


def _launch(joined_late: float = 0.0, init: bool = True) -> Phases:
    """A 4-rank launch that starts at 100.0 s; rank 3 joins the group ``joined_late`` s late."""
    p = Phases()
    for name, t in (("called", 100.0), ("forking", 100.002), ("forked", 100.050),
                    ("stopped", 100.200 + joined_late), ("done", 100.210 + joined_late)):
        p.mark(name, t)
    for r in range(4):
        marks = {"ready": 100.030 + 0.010 * r,
                 "worked": 100.130 + joined_late, "closed": 100.160 + joined_late}
        if init:
            marks["joined"] = 100.100 + (joined_late if r == 3 else 0.001 * r)
        p.ranks[r] = marks
        p.received[r] = 100.170 + joined_late + 0.001 * r
    return p


def test_phases_add_up_to_the_launch_and_name_what_held_it_up():
    stalled = _launch(joined_late=6.0)
    secs = stalled.seconds()
    assert list(secs) == list(NAMES)
    assert abs(sum(secs.values()) - 6.210) < 1e-9 and abs(stalled.total() - 6.210) < 1e-9
    name, took, last = stalled.slowest()
    assert (name, last) == ("rendezvous", 3) and abs(took - 6.040) < 1e-9
    line = stalled.line()
    assert line.startswith("6.210 s, most in rendezvous: 6.040 s (rank 3 last)"), line
    assert "rendezvous 6040" in line and all(len(ln) <= 100 for ln in line.splitlines())
    # the same launch without the stall is held up by nothing in particular: no rendezvous blamed
    assert _launch().slowest()[0] != "rendezvous"


def test_overlapping_and_missing_phases_take_no_time_of_their_own():
    p = _launch()
    p.mark("forked", 100.095)   # the caller heard of its last fork after every rank had set up
    secs = p.seconds()
    assert secs["start"] == 0.0 and abs(secs["fork"] - 0.093) < 1e-9
    assert next(last for n, _, last in p.milestones() if n == "start") is None
    assert abs(p.total() - 0.210) < 1e-9
    # no init_process_group: no rendezvous, and the time goes to the work instead
    alone = _launch(init=False)
    assert alone.seconds()["rendezvous"] == 0.0 and abs(alone.total() - 0.210) < 1e-9
    assert alone.seconds()["work"] > _launch().seconds()["work"]


def test_phase_table_reads_each_phase_over_launches():
    runs = [_launch()] * 19 + [_launch(joined_late=6.0)]
    table = phase_table(runs)
    assert table[0].split()[:4] == ["phase", "median", "p95", "max"]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in table[1:]}
    assert set(rows) == set(NAMES) and all(len(line) <= 100 for line in table)
    assert rows["rendezvous"][0] < 0.1 and rows["rendezvous"][2] > 6.0   # median / max
