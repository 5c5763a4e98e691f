"""Worked solutions to the exercises of notebook 15 (context and expert parallelism)."""

from d2lpar.cost import context_cost as CC
from d2lpar.cost import expert_cost as EC
from d2lpar.cost.costmodel import MACHINES
from d2lpar.cost.tp_cost import A100_BF16
from d2lpar.strategies.context import ring as R


def exercise_1():
    """GQA: Ulysses sends q and the output at width a d_h and k, v at g d_h, each 2 (N-1)/N (S/N)
    of them; the ring passes only k and v, (N-1) 2 (S/N) g d_h. Ratio (a + g) / (N g)."""
    b, S, n, a, g, dh, e = 1, 8192, 8, 32, 8, 128, 2
    ulysses = 2 * (n - 1) / n * (S / n) * (a + g) * dh * e * b
    ring = (n - 1) * 2 * b * (S / n) * g * dh * e
    # context_cost counts four (Ulysses) or two (ring) pieces of one width: half of each at each width
    ulysses_cc = (CC.ulysses_bytes(b, S, a * dh, n, element=e)
                  + CC.ulysses_bytes(b, S, g * dh, n, element=e)) / 2
    ring_cc = CC.ring_bytes(b, S, g * dh, n, element=e)
    print(f"Ulysses {ulysses / 2**20:.2f} MiB, ring {ring / 2**20:.2f} MiB per rank; "
          f"ratio {ulysses / ring:.3f} = (a + g) / (N g)")
    assert ulysses == ulysses_cc and ring == ring_cc
    assert abs(ulysses / ring - (a + g) / (n * g)) < 1e-12
    return ulysses / ring


def exercise_2():
    """Contiguous, N = 3: chunks of S/3, the last rank 2 full blocks and a triangle = 2.5 blocks =
    2.5/9 of one device's S^2 pairs, i.e. 2.5 / 4.5 = 5/9 of the causal work. Zig-zag: 6 chunks of
    S/6, every rank 6 blocks = 6/36 of S^2 = 1/3 of the causal work. The step shortens 5/3 times."""
    n = 3
    contiguous = R.work_per_rank(n, causal=True, zigzag=False)          # blocks of (S/N)^2
    zigzag = R.work_per_rank(n, causal=True, zigzag=True)               # blocks of (S/2N)^2
    causal_total = 0.5                                                  # of S^2 pairs
    slow_contiguous = max(contiguous) / n**2 / causal_total
    slow_zigzag = max(zigzag) / (2 * n) ** 2 / causal_total
    print(f"contiguous {contiguous} (blocks of S/3), zig-zag {zigzag} (blocks of S/6)")
    print(f"slowest rank: {slow_contiguous:.3f} of the work (contiguous), {slow_zigzag:.3f} "
          f"(zig-zag): {slow_contiguous / slow_zigzag:.2f}x shorter")
    assert contiguous == [0.5, 1.5, 2.5] and zigzag == [6.0, 6.0, 6.0]
    assert abs(slow_contiguous - 5 / 9) < 1e-12 and abs(slow_zigzag - 1 / 3) < 1e-12
    return slow_contiguous / slow_zigzag


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
