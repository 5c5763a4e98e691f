"""Worked solutions to the exercises of notebook 15 (context and expert parallelism)."""

from d2lpar.cost import context_cost as CC
from d2lpar.cost import expert_cost as EC
from d2lpar.cost.costmodel import MACHINES
from d2lpar.cost.tp_cost import A100_BF16
from d2lpar.strategies.context import ring as R


def exercise_1():
    """Ulysses / ring bytes = [4 (N-1)/N] / [2 (N-1)] = 2/N: fewer from N = 3 on, 4x fewer at N = 8."""
    b, S, d = 1, 8192, 4096
    ratios = {n: CC.ulysses_bytes(b, S, d, n) / CC.ring_bytes(b, S, d, n) for n in range(2, 9)}
    print({n: round(r, 3) for n, r in ratios.items()})
    assert all(abs(r - 2 / n) < 1e-12 for n, r in ratios.items())
    assert [n for n, r in ratios.items() if r < 1] == list(range(3, 9)) and ratios[8] == 0.25
    return ratios[8]


def exercise_2():
    """Rank r does r full blocks and a triangle: r + 1/2; the last over the first is 2N - 1."""
    n = 8
    work = R.work_per_rank(n, causal=True, zigzag=False)
    print(f"work per rank: {work}; last / first = {work[-1] / work[0]:.0f}")
    assert work[-1] / work[0] == 2 * n - 1
    return work[-1] / work[0]


def exercise_3():
    """T k (N-1)/N assignments of d bf16 elements each leave a rank."""
    T, k, d, n = 16384, 2, 4096, 8
    sent = EC.even_bytes(T, k, d, n, element=2)
    link = MACHINES["8 GPUs, NVSwitch"].device_link
    t = EC.moe_layer_time(T, k, d, 14336, n, A100_BF16, link, matrices=3)   # SwiGLU experts
    print(f"{sent / 2**20:.0f} MiB to dispatch (as much to combine); all-to-all "
          f"{t['dispatch'] * 1e3:.1f} ms against {t['compute'] * 1e3:.1f} ms of expert compute (forward)")
    assert sent == T * k * (n - 1) / n * d * 2 and t["dispatch"] < t["compute"]
    return sent
