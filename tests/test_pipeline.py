"""Pipeline schedules as data: every generated schedule is valid, the simulator meets the formulas,
and broken schedules are rejected with the rule they break (pure Python, no processes)."""

import pytest

from d2lpar.cost import bubble
from d2lpar.strategies.pipeline import schedules as P
from d2lpar.infra.check import CheckFailed, check
from d2lpar.strategies.pipeline.simulator import action_overhead, message_latency, simulate, waits
from d2lpar.strategies.pipeline.schedules import Action, Schedule, ScheduleError


def test_action_string_form_round_trips():
    assert str(Action(1, "F", 0)) == "1F0"
    assert P.parse_action("12W3") == Action(12, "W", 3)
    with pytest.raises(ValueError, match="not an action"):
        P.parse_action("1X0")


@pytest.mark.parametrize("p", range(1, 9))
def test_every_schedule_is_valid_and_meets_its_formula(p):
    for m in range(1, 17):
        for name in ("naive", "GPipe", "1F1B", "ZB-H1"):
            sim = simulate(P.make_schedule(name, p, m), {"F": 1, "B": 2, "I": 1, "W": 1})
            expected = bubble.idle_fraction(name, p, m)
            assert all(abs(i - expected) < 1e-12 for i in sim.idle), (name, p, m, sim.idle, expected)
            if name != "naive":
                assert sim.peak == bubble.peak_microbatches(name, p, m), (name, p, m, sim.peak)
        for v in (1, 2, 3):
            if v > 1 and m % p:
                continue
            sim = simulate(P.interleaved_1f1b(p, m, v), {"F": 1 / v, "B": 2 / v})
            expected = bubble.idle_fraction("interleaved 1F1B", p, m, v)
            assert all(abs(i - expected) < 1e-12 for i in sim.idle), (p, m, v, sim.idle, expected)


def test_unequal_durations_give_the_same_gpipe_bubble_and_a_slow_stage_widens_it():
    sim = simulate(P.gpipe(4, 8), {"F": 1.0, "B": 3.0})
    assert all(abs(i - 3 / 11) < 1e-12 for i in sim.idle)
    slow = simulate(P.one_f_one_b(4, 8), stage_scale=[1, 1, 2, 1])
    assert max(slow.idle) > 3 / 11 and min(slow.idle) == slow.idle[2]
    # GPipe pays the latency once per hop, forward and back; 1F1B's alternation waits on it more often
    assert simulate(P.gpipe(4, 8), latency=0.5).makespan == simulate(P.gpipe(4, 8)).makespan + 6 * 0.5
    assert simulate(P.one_f_one_b(4, 8), latency=0.5).makespan > simulate(P.one_f_one_b(4, 8)).makespan + 6 * 0.5


def _broken(order, p=2, m=2):
    return Schedule("broken", p, m, [[P.parse_action(a) for a in row.split()] for row in order])


@pytest.mark.parametrize("order,rule", [
    (["0F0 0F1 0B0 0B1", "1F0 1F1 1B0"], "1B1 is missing"),
    (["0F0 0F1 0B0 0B1 0B1", "1F0 1F1 1B0 1B1"], "0B1 appears twice"),
    (["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"], "deadlock: every rank waits"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0 1B1 1F1"], "B after F: 1B1 comes before 1F1"),
    (["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 0B1"], "0B1 is on rank 1"),
    (["0F0 0F1 0B0 0B1", "1F0 1F1 1I0 1W0 1B0 1W1 1I1"], "1B0 and 1I0 both appear"),
    (["0F0 0F1 0B0 0B1", "1F0 1F1 1I0 1W0 1W1 1I1"], "I before W: 1W1 comes before 1I1"),
])
def test_a_broken_schedule_is_rejected_naming_the_rule(order, rule):
    with pytest.raises(ScheduleError, match=rule):
        P.validate(_broken(order))


def test_same_rank_order_of_stages_is_checked():
    one_rank = Schedule("broken", 1, 1, [[P.parse_action(a) for a in "0F0 1F0 1B0 0B0".split()]],
                        stages_per_rank=2)
    P.validate(one_rank)
    with pytest.raises(ScheduleError, match="F of micro-batch 0 on stage 0 before stage 1"):
        P.validate(Schedule("broken", 1, 1, [[P.parse_action(a) for a in "1F0 0F0 1B0 0B0".split()]],
                            stages_per_rank=2))
    with pytest.raises(ScheduleError, match="B in the reverse order: 0B0 comes before 1B0"):
        P.validate(Schedule("broken", 1, 1, [[P.parse_action(a) for a in "0F0 1F0 0B0 1B0".split()]],
                            stages_per_rank=2))


def test_the_error_shows_the_grid_with_the_action_marked():
    with pytest.raises(ScheduleError) as e:
        P.validate(_broken(["0F0 0F1 0B0 0B1", "1F0 1B0 1B1 1F1"]))
    assert "rank 1:" in str(e.value) and ">1B1<" in str(e.value)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ScheduleError, match="m must be a multiple of p: m=6 is not. Use m=8"):
        P.interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match="cannot split 3 layers into 4 stages"):
        P.split_layers(3, 4)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        P.make_schedule("2F2B", 2, 2)
    # 1F1B with fewer micro-batches than stages runs, with GPipe's bubble (said in its docstring)
    assert simulate(P.one_f_one_b(4, 2)).idle == simulate(P.gpipe(4, 2)).idle


def test_formulas_disagree_where_they_should():
    assert bubble.idle_fraction("GPipe", 4, 1) == 0.75 and bubble.megatron_ratio(4, 1) == 3.0
    assert bubble.idle_fraction("ZB-H1", 4, 8) < bubble.idle_fraction("1F1B", 4, 8)


# ------------------------------------------- the checks of notebook 11 fail on broken schedules

NAMES4 = ("GPipe", "1F1B", "interleaved 1F1B", "ZB-H1")


def _ws_last(p, m):
    """A broken ZB-H1: the backward split into I and W, but every W left at the end (none in the bubble)."""
    s = P.one_f_one_b(p, m)
    order = [[Action(a.stage, "I", a.mb) if a.kind == "B" else a for a in acts]
             + [Action(r, "W", k) for k in range(m)] for r, acts in enumerate(s.order)]
    return Schedule("ZB-H1", p, m, order)


def _not_interleaved(p, m, v=2):
    """A broken interleaving: v stages per rank, but each micro-batch goes round the ranks v times
    before the next one starts (depth first), so the ranks mostly wait for each other."""
    s = P.interleaved_1f1b(p, m, v)
    order = []
    for acts in s.order:
        fwd = sorted((a for a in acts if a.kind == "F"), key=lambda a: (a.mb, a.stage))
        bwd = sorted((a for a in acts if a.kind == "B"), key=lambda a: (a.mb, -a.stage))
        order.append(fwd + bwd)
    return Schedule("interleaved 1F1B", p, m, order, stages_per_rank=v)


def _claims(make):
    b = {n: simulate(make(n), {"F": 1 / (2 if n.startswith("inter") else 1),
                               "B": 2 / (2 if n.startswith("inter") else 1), "I": 1, "W": 1}).bubble
         for n in NAMES4}
    return dict(bubble.ordering_claims(b))


def test_the_bubble_ordering_holds_and_fails_on_broken_schedules():
    real = lambda n: P.make_schedule(n, 4, 8, 2 if n.startswith("inter") else None)
    assert all(_claims(real).values())
    broken_zb = _claims(lambda n: _ws_last(4, 8) if n == "ZB-H1" else real(n))
    assert not broken_zb["ZB-H1 idles less than interleaved 1F1B"]
    broken_int = _claims(lambda n: _not_interleaved(4, 8) if n.startswith("inter") else real(n))
    assert not broken_int["interleaved 1F1B idles less than GPipe and 1F1B"]
    # the notebook asserts each claim with check(): a broken schedule stops it
    with pytest.raises(CheckFailed, match="interleaved 1F1B idles less"):
        for claim, ok in bubble.ordering_claims({"GPipe": 0.27, "1F1B": 0.27, "interleaved 1F1B": 0.27,
                                                 "ZB-H1": 0.11}, measured=True):
            check(claim, ok)


def test_the_simulator_against_formula_check_names_a_broken_generator():
    rows, mismatches = bubble.against_simulator(ps=(2, 4), ms=(4, 8))
    assert mismatches == [] and len(rows) == 4
    serial = lambda p, m: Schedule("1F1B", p, m, [[Action(r, k, i) for i in range(m) for k in "FB"]
                                                  for r in range(p)])   # valid, but no pipelining
    make = lambda name, p, m, v: serial(p, m) if name == "1F1B" else P.make_schedule(name, p, m, v)
    _, mismatches = bubble.against_simulator(ps=(2, 4), ms=(4, 8), make=make)
    assert len(mismatches) == 4 and all(x.startswith("1F1B p=") for x in mismatches)


def test_latency_and_overhead_read_off_a_timeline_and_replayed():
    s = P.gpipe(2, 2)
    sim = simulate(s, latency=0.25, overhead=0.1)
    assert waits(sim.timeline, s)[0] == [0.25, 0.25]          # 1F0 and 0B1 wait for a message
    assert message_latency(sim.timeline, s) == 0.25
    assert abs(action_overhead(sim.timeline, s) - 0.1) < 1e-12
    assert simulate(s, latency=0.25, overhead=0.1).bubble > simulate(s, latency=0.25).bubble > simulate(s).bubble
