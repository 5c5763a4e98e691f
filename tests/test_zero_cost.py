"""The ZeRO paper's table from the formulas, and the planner's memory and time."""

from d2lpar.cost import zero_cost as C
from d2lpar.cost.costmodel import MACHINES


def test_the_paper_table_to_the_digits_it_prints():
    rows = C.paper_table(7.5e9, 64)
    assert [(name, f"{gb:.1f}") for name, gb in rows] == [
        ("DP", "120.0"), ("ZeRO-1", "31.4"), ("ZeRO-2", "16.6"), ("ZeRO-3", "1.9")]


def test_plan_memory_falls_and_zero3_sends_half_again():
    rows = {r["strategy"]: r for r in C.plan(7.5e9, 4096, MACHINES["8 GPUs, PCIe 4.0"])}
    mem = [rows[s]["memory_gb"] for s in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")]
    assert mem == sorted(mem, reverse=True) and mem[0] == 120.0
    assert not rows["DP"]["fits"] and rows["ZeRO-1"]["fits"]
    assert rows["DP"]["comm_s"] == rows["ZeRO-2"]["comm_s"]
    assert abs(rows["ZeRO-3"]["comm_s"] / rows["DP"]["comm_s"] - 1.5) < 1e-12
    assert "fits in 80 GB" in C.plan_table(1.5e9, 4096)
