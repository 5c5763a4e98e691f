"""Worked solutions for notebooks/11_pipeline_parallel.ipynb (the simulator, and one 2-rank launch)."""

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.cost import bubble
from d2lpar.processes.launch import launch
from d2lpar.strategies.pipeline import schedules as P
from d2lpar.strategies.pipeline.simulator import simulate


def exercise_1():
    """A latency of 0.2 forward-times per message: 1F1B loses more than GPipe."""
    rows = {}
    for name in ("GPipe", "1F1B"):
        s = P.make_schedule(name, 4, 8)
        rows[name] = (simulate(s).bubble, simulate(s, latency=0.2).bubble)
        print(f"{name}: idle {rows[name][0]:.3f} without latency, {rows[name][1]:.3f} with 0.2 per message")
    assert rows["1F1B"][1] > rows["GPipe"][1] > rows["GPipe"][0] == rows["1F1B"][0]
    # GPipe's forwards stream one after the other, so a rank receives the next micro-batch while it
    # computes this one: latency is paid once per hop on the way in and once on the way out. In
    # 1F1B's steady state each backward waits for a gradient whose forward just left the rank, a
    # round trip that lies on the critical path again and again.


def exercise_2():
    """Interleaving v = 1, 2, 4 on p = 4, m = 8: idle fraction and messages per step."""
    for v in (1, 2, 4):
        s = P.interleaved_1f1b(4, 8, v)
        sim = simulate(s, {"F": 1 / v, "B": 2 / v})
        sends = sum(1 for acts in s.order for a in acts
                    if (a.kind == "F" and a.stage < s.stages - 1) or (a.kind in "BI" and a.stage > 0))
        formula = bubble.idle_fraction("interleaved 1F1B", 4, 8, v)
        print(f"v={v}: idle {sim.bubble:.3f} (formula {formula:.3f}), {sends} messages per step")
        assert abs(sim.bubble - formula) < 1e-12
        assert sends == 2 * (v * 4 - 1) * 8   # every stage boundary, forward and back, per micro-batch


def exercise_3():
    """ZB-H1's bubble (p-1)(tF + tI - tW) holds while tW <= tF, tI; a longer W cannot hide more."""
    p, m = 4, 8
    for tw in (0.5, 1.0, 1.5):
        sim = simulate(P.zb_h1(p, m), {"F": 1.0, "I": 1.0, "W": tw})
        idle_time = sim.makespan - m * (2.0 + tw)
        formula = (p - 1) * (1.0 + 1.0 - tw)
        print(f"tW={tw}: bubble {idle_time:.2f} forward-times, (p-1)(tF+tI-tW) = {formula:.2f}")
        if tw <= 1.0:
            assert abs(idle_time - formula) < 1e-9
        else:
            assert idle_time > formula   # a W longer than F no longer fits in the gaps it was to fill


def exercise_4():
    """Peak activation bytes per stage for p = 4, m = 16, 1 MiB per micro-batch per stage."""
    for name in ("GPipe", "1F1B"):
        peak = simulate(P.make_schedule(name, 4, 16)).peak
        print(f"{name}: {[f'{k} MiB' for k in peak]}")
        assert peak == bubble.peak_microbatches(name, 4, 16)
    assert bubble.peak_microbatches("GPipe", 4, 16) == [16] * 4
    assert bubble.peak_microbatches("1F1B", 4, 16) == [4, 3, 2, 1]


def _gpipe_unscaled(stages, X, y, m):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    rank = dist.get_rank()
    stage = PipelineStage(stages[rank], rank, len(stages), torch.device("cpu"))
    sched = ScheduleGPipe(stage, m, loss_fn=nn.functional.cross_entropy, scale_grads=False)
    if rank == 0:
        sched.step(X)
    else:
        sched.step(target=y)
    return [q.grad for q in stages[rank].parameters()]


def exercise_5():
    """ScheduleGPipe with scale_grads=False: gradients m times those of one device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    X, y, m = torch.randn(16, 8), torch.arange(16) % 3, 4
    stages = [model[:2], model[2:]]
    grads = [g for rank in launch(_gpipe_unscaled, 2, stages, X, y, m, timeout=120) for g in rank]
    nn.functional.cross_entropy(model(X), y).backward()
    for g, q in zip(grads, model.parameters()):
        torch.testing.assert_close(g, m * q.grad, rtol=1e-5, atol=1e-6)
    print(f"scale_grads=False: every gradient is {m} (= m) times the single-device gradient")
