"""Published figures: Megatron-LM's eq. 3 turns its 140 TFLOP/s for GPT-3 175B on 1,024 A100s into a
step time and an MFU on the course's definition; its Table 2 as the notebook prints it."""

import pytest

from d2lpar.cost import planner as PL
from d2lpar.cost import published as PUB


def test_eq_3_counts_the_recomputed_forward():
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    F = PUB.megatron_step_flops(B, s, l, h, V)
    assert F == pytest.approx(4.51e18, rel=2e-3)
    # without the recompute (72 instead of 96) and the attention/logit terms: 6 x the layers' weights
    assert F * 72 / 96 == pytest.approx(6 * B * s * 12 * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))


def test_megatrons_140_tflops_is_a_31_5_s_step_and_34_percent_mfu():
    gpt3 = PL.MODELS["gpt3-175b"]
    step = PUB.megatron_step_flops(gpt3.batch, gpt3.seq, gpt3.layers, gpt3.d) / (1024 * 140e12)
    assert step == pytest.approx(31.5, abs=0.05)
    mfu = PL.model_flops_per_step(gpt3) / (step * 1024 * PUB.A100_PEAK)
    assert mfu == pytest.approx(0.337, abs=0.002)
    assert PL.model_flops_per_step(gpt3) < PUB.megatron_step_flops(1536, 2048, 96, 12288) * 0.76


def test_model_flops_leave_out_the_input_embedding_only():
    m = PL.Model("t", 2, 64, 4, 32, 100, 8)
    weights = m.parameters() - m.vocab * m.d
    assert PL.model_flops_per_step(m) == (6 * weights + 12 * 2 * 32 * 64) * 8 * 32


def test_table_2_zero3_falls_behind_ptdp_as_gpus_grow():
    rows = sorted(PUB.MEGATRON_TABLE_2.items())
    assert [g for g, _ in rows] == [384, 768, 1536]
    assert all(z < p for _, (z, p) in rows)
    assert [z for _, (z, _) in rows] == sorted((z for _, (z, _) in rows), reverse=True)


def test_table_2_priced_by_the_planner_keeps_the_batch_and_ranks_like_the_paper_from_768_gpus():
    from d2lpar.cost import planner as P
    model, cluster = P.MODELS["gpt3-175b"], P.CLUSTERS["1024 A100-80GB"]
    priced = PUB.price_table_2(model, cluster)
    for gpus, row in priced.items():
        for scheme, (plan, tflops) in row.items():
            lay = plan.layout
            assert lay.dp * lay.tp * lay.pp == gpus and plan.fits
            assert model.batch % (lay.dp * lay.micro) == 0
        assert row["PTD-P"][0].layout.tp * row["PTD-P"][0].layout.pp == 96
    zero3 = [priced[g]["ZeRO-3"][1] for g in sorted(priced)]
    assert zero3 == sorted(zero3, reverse=True)                  # falls as GPUs are added
    for g in (768, 1536):
        assert priced[g]["ZeRO-3"][1] < priced[g]["PTD-P"][1]     # the paper's order
