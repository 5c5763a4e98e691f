"""The planner: published figures reproduced by its formulas, it never returns a layout that does not
fit, it answers for GPT-3 on 1,024 GPUs quickly, and impossible input is one sentence."""

import time

import pytest

from d2lpar.cost import planner as PL
from d2lpar.cost import published as PUB
from d2lpar.cost import repricing as RP


def test_megatron_table_1_parameter_counts():
    for published, l, h in PUB.MEGATRON_TABLE_1:
        assert round(PUB.megatron_parameters(l, h) / 1e9, 1) == pytest.approx(published, abs=0.1), (l, h)


def test_megatron_training_time_estimates():
    assert round(PUB.megatron_days(300e9, 175e9, 1024, 140e12)) == 34
    assert round(PUB.megatron_days(450e9, 1e12, 3072, 163e12)) == 83   # the paper rounds to "about 84"


def test_torchtitan_mfu_and_the_scaling_books_threshold():
    n, emb = 8.03e9, 128256 * 4096
    assert round(100 * PUB.torchtitan_mfu(5762, n, emb, 32, 32, 128, 8192), 1) == pytest.approx(33.7, abs=0.3)
    assert round(100 * PUB.torchtitan_mfu(6667, n, emb, 32, 32, 128, 8192)) == 39
    assert round(PUB.compute_bound_batch()) == 2200


def test_the_plans_fit_and_come_fast():
    t0 = time.perf_counter()
    model, cluster = PL.MODELS["gpt3-175b"], PL.CLUSTERS["1024 A100-80GB"]
    plans = PL.plan(model, cluster, top=5)
    assert time.perf_counter() - t0 < 10
    assert plans and all(p.fits and p.peak_memory <= cluster.memory_gb * 1e9 for p in plans)
    assert [p.step for p in plans] == sorted(p.step for p in plans)


def test_impossible_input_is_one_sentence():
    model, cluster = PL.MODELS["gpt3-175b"], PL.CLUSTERS["1024 A100-80GB"]
    with pytest.raises(ValueError, match=r"dp x tp x pp = 4 x 8 x 8 = 256, not the cluster's 1024 GPUs"):
        PL.evaluate(model, cluster, PL.Layout(4, 8, 8))
    with pytest.raises(ValueError, match="tensor degree 5 does not divide heads=96"):
        PL.check_layout(model, PL.Cluster("c", 5, 5, 80, 1e15, 0.6, 1e11, 1e-6, 1e10, 1e-5), PL.Layout(1, 5, 1))
    with pytest.raises(ValueError, match="pipeline degree 128 is more than the 96 layers"):
        PL.evaluate(model, cluster, PL.Layout(1, 8, 128))
    bad = PL.Cluster("bad", 8, 8, -1, 1e15, 0.6, 1e11, 1e-6, 1e10, 1e-5)
    with pytest.raises(ValueError, match="memory_gb=-1 is missing or not positive"):
        PL.plan(model, bad)
    tiny = PL.Cluster("tiny", 8, 8, 1, 1e15, 0.6, 1e11, 1e-6, 1e10, 1e-5)
    with pytest.raises(ValueError, match=r"no layout fits GPT-3 175B in 1 GB per GPU: the smallest needs \d"):
        PL.plan(model, tiny)


def test_the_command_answers(capsys):
    assert PL.main(["--top", "1"]) == 0
    assert "MFU" in capsys.readouterr().out
    assert PL.main(["--model", "gpt3-175b", "--cluster", "custom", "--gpus", "8", "--gpus-per-node", "8",
                    "--memory-gb", "1"]) == 2
    assert "no layout fits" in capsys.readouterr().out


def test_megatron_recompute_reruns_fc2_and_the_two_all_reduces():
    model, cluster = PL.MODELS["gpt3-175b"], PL.CLUSTERS["1024 A100-80GB"]
    p = PL.evaluate(model, cluster, PL.Layout(16, 8, 8, zero=0, micro=96, checkpoint="full"))
    q = RP.megatron_recompute(p, model, cluster)
    assert abs(q.time["tensor"] - 1.5 * p.time["tensor"]) < 1e-12
    b = model.batch // (16 * 96)
    fc2 = 96 * 12 * 2 * b * model.seq * model.d * model.f / 8 / (cluster.peak_flops * cluster.utilisation)
    assert abs(q.time["compute"] - p.time["compute"] - fc2) < 1e-9
    sel = PL.evaluate(model, cluster, PL.Layout(16, 8, 8, zero=0, micro=96, checkpoint="selective"))
    assert RP.megatron_recompute(sel, model, cluster) is sel


def test_megatron_recompute_hides_the_data_term_behind_the_longer_backward():
    model = PL.MODELS["gpt3-175b"]
    import dataclasses
    cluster = dataclasses.replace(PL.CLUSTERS["1024 A100-80GB"], gpus=1536)
    lay = PL.Layout(1536, 1, 1, zero=3, micro=1, checkpoint="full")
    p = PL.evaluate(model, cluster, lay)
    q = RP.megatron_recompute(p, model, cluster)
    assert p.time["data"] > 0                  # exposed before, so the fix can be seen
    exposed = PL.step_time(model, cluster, lay, dp_overlap=False)["data"]
    assert abs(q.time["data"] - max(0.0, exposed - q.time["compute"] * 2 / 3)) < 1e-9
    assert q.time["data"] < p.time["data"]
