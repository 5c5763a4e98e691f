"""The planner checked on this machine: fit its costs here, predict each 8-rank layout, measure it.

The planner prices a layout from a described cluster (``planner.Cluster``). Here the cluster is 8
ranks on this machine, each computing on a simulated device (``Busy``: every layer waits its FLOPs at
``rate``, and the real forward and backward run besides), with real gloo messages. Two fits describe it:

* **compute**: all 8 ranks run a transformer layer's forward and backward at once; the share of
  ``rate`` they sustain (the ideal 3 x forward FLOPs / rate over the measured time) is the cluster's
  ``utilisation`` (below 1: the real CPU work and late wake-ups of 8 processes on 2 cores);
* **communication**: every group of n ranks (n = 2, 4, 8, all groups at once) all-reduces tensors of
  three sizes (8 KB to 2 MB); least squares fits the ring all-reduce ``2 (n-1) (alpha + K / (n beta))`` that the
  planner uses (``costmodel.allreduce_time``), giving the latency alpha and the bandwidth beta.

``check_here`` then predicts each layout with ``planner.step_time`` (the hand-built run averages
the gradients after the backward pass: ``dp_overlap=False``), measures it with
``threed.hand.time_layouts`` and returns both.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from d2lpar.cost.planner import Cluster, Layout, Model, step_time
from d2lpar.infra.device_time import Busy
from d2lpar.processes.launch import launch
from d2lpar.strategies.sharded.mesh import Mesh
from d2lpar.strategies.tensor.blocks import TransformerLayer
from d2lpar.strategies.threed.gpt import gpt_sizes
from d2lpar.strategies.threed.hand import forward_flops, time_layouts

__all__ = ["here_model", "fit_here", "Fit", "check_here", "Check"]


def here_model(gpt, batch: int) -> Model:
    """The planner's description of a ``char_gpt`` trained in fp32 on a global batch of ``batch``."""
    z = gpt_sizes(gpt)
    return Model("character GPT", z["layers"], z["d"], z["heads"], z["seq"], z["vocab"], batch,
                 z["hidden"], precision="fp32")


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _fit_worker(d, heads, hidden, seq, rows, rate, sizes, repeats):
    torch.manual_seed(0)
    layer = TransformerLayer(d, heads, hidden, causal=True)
    busy = Busy(layer, functools.partial(forward_flops, layer, 1), rate)
    shares = []
    for r in [rows[0]] + list(rows) * repeats:          # the first call warms up
        x = torch.randn(r, seq, d, requires_grad=True)
        dist.barrier()
        t0 = time.perf_counter()
        busy(x).sum().backward()
        shares.append(3 * forward_flops(layer, 1, x) / rate / (time.perf_counter() - t0))
    times = {}
    for n in (2, 4, 8):
        mesh = Mesh((8 // n, n), ("rest", "group"))
        for size in sizes:
            buf = torch.zeros(size // 4)
            dist.all_reduce(buf, group=mesh.group("group"))   # warm
            seconds = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf, group=mesh.group("group"))
                seconds.append(time.perf_counter() - t0)
            times[(n, size)] = _median(seconds)
    return {"utilisation": _median(shares[1:]), "allreduce": times}


@dataclass
class Fit:
    utilisation: float
    latency: float                       # alpha, seconds
    bandwidth: float                     # beta, bytes/s
    allreduce: dict                      # (n, bytes) -> measured seconds (median over ranks)

    def cluster(self, rate: float) -> Cluster:
        return Cluster("8 simulated devices on this machine", 8, 8, 2.0, rate, self.utilisation,
                       self.bandwidth, self.latency, self.bandwidth, self.latency)


def fit_here(gpt, rate: float, rows=(1, 4), repeats: int = 5) -> Fit:
    """Fit this machine's compute share and ring all-reduce costs on 8 ranks (one launch)."""
    z = gpt_sizes(gpt)
    act = 4 * z["seq"] * z["d"]
    sizes = (act * rows[0], act * 8 * rows[-1], 2 << 20)   # a micro-batch's activation .. gradients
    results = launch(_fit_worker, 8, z["d"], z["heads"], z["hidden"], z["seq"], tuple(rows), rate,
                     sizes, repeats)
    times = {k: _median([r["allreduce"][k] for r in results]) for k in results[0]["allreduce"]}
    A = torch.tensor([[2.0 * (n - 1), 2.0 * (n - 1) * K / n] for n, K in times],
                     dtype=torch.float64)
    y = torch.tensor(list(times.values()), dtype=torch.float64)
    alpha, inv_beta = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1).tolist()
    alpha, inv_beta = max(alpha, 1e-7), max(inv_beta, 1e-12)
    return Fit(_median([r["utilisation"] for r in results]), alpha, 1.0 / inv_beta, times)


@dataclass
class Check:
    layout: tuple[int, int, int]          # (dp, tp, pp)
    predicted: dict[str, float]           # the planner's seconds per step, by part
    measured: float

    @property
    def ratio(self) -> float:
        return sum(self.predicted.values()) / self.measured


def check_here(gpt, batches, layouts, microbatches: int = 4, rate: float = 1e9,
               fit: Fit | None = None) -> tuple[Fit, list[Check]]:
    """Predict each (dp, tp, pp) layout's step with the fitted costs, then measure it."""
    fit = fit or fit_here(gpt, rate)
    model, cluster = here_model(gpt, len(batches[0][0])), fit.cluster(rate)
    predicted = [step_time(model, cluster, Layout(dp, tp, pp, zero=0, micro=microbatches),
                           dp_overlap=False) for dp, tp, pp in layouts]
    measured = time_layouts(gpt, batches, layouts, microbatches, rate)
    return fit, [Check(tuple(lay), p, m) for lay, p, m in zip(layouts, predicted, measured)]
