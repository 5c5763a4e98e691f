"""Pipeline schedules as data: every generated schedule is valid, the simulator meets the formulas,
and broken schedules are rejected with the rule they break (pure Python, no processes)."""

import pytest

from d2lpar.cost import bubble
from d2lpar.strategies.pipeline import schedules as P
from d2lpar.strategies.pipeline.simulator import simulate
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
