"""How long an all-reduce takes: bytes and links turned into time (the alpha-beta model).

A message of b bytes over a link costs ``alpha + b / beta``: a fixed latency alpha plus the bytes
over the bandwidth beta. An all-reduce of K bytes per device over N devices is a sequence of rounds
of messages; a round in which T messages travel at once costs ``(alpha + b / beta) * c(T)``, where the
contention c(T) is 1 on GPUs (each GPU has its own link) and ``max(1, 2T / cores)`` when ranks share
CPU cores (each loopback message costs a copy on the sender's core and one on the receiver's, and a
rank waiting for a core adds to the latency too).
Adding what arrives costs ``bytes / reduce_bandwidth`` on the device that adds. The four ways to
aggregate, with K bytes per device:

=============  ============================================  =======================================
strategy       rounds of messages                            adds
=============  ============================================  =======================================
one_device     2(N-1) rounds of K, one at a time (into and   (N-1)K on device 0
               out of device 0: 2(N-1)K through its link)
through_cpu    up and down: N messages of K at once over     (N-1)K on the CPU
               the host links, capped by the host bandwidth
sharded        2(N-1) rounds of K/N, N at once (every        (N-1)K/N on each device
               device serves 1/N of the keys)
ring           2(N-1) rounds of K/N, N at once (neighbours)  (N-1)K/N on each device
=============  ============================================  =======================================

On GPUs the sharded servers and the ring move the same bytes per link; the ring needs only
neighbour links (an NVLink ring, a chain of PCIe switches), the servers need every pair. Described
machines below use round, published link figures (derated to what collectives reach in practice);
``this_machine()`` fits alpha and beta to ping-pong times measured here, so predictions can be set
beside measurements.

Compute on a described GPU (``Gpu``, ``GPUS``) follows the same pattern: a step of F floating-point
operations made of n operators costs ``n * launch + F / rate``, where rate is a sustained FLOP/s
(a fraction of the data-sheet peak) and launch is what every operator costs in eager PyTorch whatever
its size (dispatch and kernel launch). ``training_work`` counts F and n for a model's forward and
backward with torch's own counters, so a CPU-only machine can predict a GPU's compute without
timing its own CPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

__all__ = ["Link", "Machine", "MACHINES", "STRATEGIES", "allreduce_time", "predict", "with_devices",
           "fit_link", "measure_pingpong", "measure_reduce_bandwidth", "this_machine", "Gpu", "GPUS",
           "training_work"]

GB = 1e9
STRATEGIES = ("one_device", "through_cpu", "sharded", "ring")


@dataclass(frozen=True)
class Link:
    """One direction of a link: ``time(b) = latency + b / bandwidth`` (seconds, bytes/s)."""
    bandwidth: float
    latency: float

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """Devices and links of one machine, as the cost model sees them."""
    name: str
    devices: int
    device_link: Link                    # device to device (NVLink, PCIe peer-to-peer, loopback)
    reduce_bandwidth: float              # bytes/s a device adds into its buffer
    host_link: Link | None = None        # device to CPU, per device (None: devices are the CPU)
    host_bandwidth: float | None = None  # what the CPU side takes from all links at once
    cpu_reduce_bandwidth: float | None = None
    cores: int | None = None             # set when ranks share CPU cores (simulated devices)

    def contention(self, concurrent: int) -> float:
        return 1.0 if self.cores is None else max(1.0, 2 * concurrent / self.cores)


def _pcie(gbs: float) -> Link:
    return Link(gbs * GB, 10e-6)


# Round figures: PCIe 3.0 x16 ~12 GB/s and PCIe 4.0 x16 ~24 GB/s per direction in practice;
# NVLink 2 (V100, 6 links) ~130 GB/s and NVLink 3 through NVSwitch (A100) ~230 GB/s of all-reduce
# bus bandwidth; adding runs at about a third of memory bandwidth (read two, write one).
MACHINES = {
    "4 GPUs, PCIe 3.0": Machine("4 GPUs, PCIe 3.0", 4, _pcie(12), 300 * GB, _pcie(12), 24 * GB,
                                20 * GB),
    "8 GPUs, PCIe 4.0": Machine("8 GPUs, PCIe 4.0", 8, _pcie(24), 500 * GB, _pcie(24), 50 * GB,
                                30 * GB),
    "4 GPUs, NVLink": Machine("4 GPUs, NVLink", 4, Link(130 * GB, 8e-6), 300 * GB, _pcie(12),
                              24 * GB, 20 * GB),
    "8 GPUs, NVSwitch": Machine("8 GPUs, NVSwitch", 8, Link(230 * GB, 8e-6), 500 * GB, _pcie(24),
                                50 * GB, 30 * GB),
}


@dataclass(frozen=True)
class Gpu:
    """A described GPU's compute: ``time(flops, ops) = ops * launch + flops / rate`` (seconds)."""
    name: str
    rate: float    # sustained FLOP/s on large kernels
    launch: float  # seconds per operator in eager PyTorch, however small the operator

    def time(self, flops: float, ops: int = 0) -> float:
        return ops * self.launch + flops / self.rate

    def step_time(self, flops: float, ops: int) -> float:
        """Eager CUDA launches are asynchronous: the CPU launches the next operator while the GPU
        runs this one, so a step takes about the longer of the two (``time`` is their sum, an
        upper bound)."""
        return max(ops * self.launch, flops / self.rate)


# Round figures, stated rather than measured: a V100 (the GPU of a 4-GPU PCIe 3.0 box) peaks at
# 14 TFLOP/s in FP32 and sustains about half on convolutions and matrix products; eager PyTorch spends
# about 10 us per operator on dispatch and launch, which small kernels cannot hide.
GPUS = {"V100, FP32": Gpu("V100, FP32", 7e12, 10e-6)}


def training_work(model, X, y) -> tuple[float, int]:
    """(FLOPs, operators) of one forward and backward of ``model`` on (X, y) with the cross-entropy
    loss, counted by ``torch.utils.flop_counter`` and by the operators dispatched (views, which
    launch no kernel, not counted). The model's gradients are left as the backward made them."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class _Operators(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += not func.is_view
            return func(*args, **(kwargs or {}))

    with _Operators() as ops, FlopCounterMode(display=False) as flops:
        torch.nn.functional.cross_entropy(model(X), y).backward()
    return float(flops.get_total_flops()), ops.count


def allreduce_time(strategy: str, nbytes: float, n: int, machine: Machine) -> float | None:
    """Predicted seconds to all-reduce ``nbytes`` per device over n devices (None: not possible)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if n < 1:
        raise ValueError(f"n={n}: need at least one device")
    if n == 1:
        return 0.0
    link, K = machine.device_link, float(nbytes)
    if strategy == "one_device":
        return 2 * (n - 1) * link.time(K) + (n - 1) * K / machine.reduce_bandwidth
    if strategy == "through_cpu":
        if machine.host_link is None:
            return None  # the devices are the CPU already: this is one_device
        host = machine.host_link
        cap = machine.host_bandwidth or float("inf")
        one_way = host.latency + max(K / host.bandwidth, n * K / cap)
        adding = machine.cpu_reduce_bandwidth or machine.reduce_bandwidth
        return 2 * one_way + (n - 1) * K / adding
    per_round = link.time(K / n) * machine.contention(n)
    return 2 * (n - 1) * per_round + (n - 1) * K / n / machine.reduce_bandwidth


def predict(machine: Machine, sizes, ns, strategies=STRATEGIES) -> list[dict]:
    """Rows ``{'n', 'bytes', strategy: seconds, ...}`` for every n and size."""
    return [{"n": n, "bytes": s, **{st: allreduce_time(st, s, n, machine) for st in strategies}}
            for n in ns for s in sizes]


# -------------------------------------------------------------------------- this machine, measured

def fit_link(sizes, seconds) -> Link:
    """Fit ``seconds = alpha + size / beta``: beta from the large messages, alpha from the small.

    beta is the least-squares slope over messages of at least 1/16 of the largest (bandwidth rules
    there); alpha is what the smallest message takes beyond size / beta (latency rules there).
    """
    if len(sizes) < 2 or len(seconds) != len(sizes):
        raise ValueError("fit_link needs at least two (size, seconds) pairs of equal length")
    pairs = sorted(zip(sizes, seconds))
    big = [(x, y) for x, y in pairs if x >= pairs[-1][0] / 16]
    if len(big) < 2:
        big = pairs[-2:]
    mx = sum(x for x, _ in big) / len(big)
    my = sum(y for _, y in big) / len(big)
    sxx = sum((x - mx) ** 2 for x, _ in big)
    slope = sum((x - mx) * (y - my) for x, y in big) / sxx if sxx else 0.0
    if slope <= 0:
        raise ValueError("times do not grow with size: measure larger messages")
    x0, y0 = pairs[0]
    return Link(bandwidth=1.0 / slope, latency=max(0.0, y0 - x0 * slope))


def _pingpong(sizes, repeats):
    import torch
    import torch.distributed as dist
    rank, out = dist.get_rank(), []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            best = min(best, (time.perf_counter() - t0) / 2)
        out.append(best)
    return out


def measure_pingpong(sizes=(4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20), repeats: int = 5):
    """One-way message times between two ranks here (best of ``repeats`` round trips / 2)."""
    from d2lpar.processes.launch import launch
    return list(sizes), launch(_pingpong, 2, list(sizes), repeats, timeout=120)[0]


def measure_reduce_bandwidth(nbytes: int = 16 << 20, repeats: int = 5) -> float:
    """Bytes per second that one CPU thread adds (``a += b``, b counted)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a.add_(b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best


def this_machine(link: Link | None = None, reduce_bandwidth: float | None = None,
                 devices: int = 4) -> Machine:
    """This CPU, with ranks as devices: measured (or given) link and adding speed, shared cores."""
    if link is None:
        link = fit_link(*measure_pingpong())
    return Machine("this machine (gloo ranks on the CPU)", devices, link,
                   reduce_bandwidth or measure_reduce_bandwidth(), cores=os.cpu_count() or 1)


def with_devices(machine: Machine, devices: int) -> Machine:
    """The same machine with another device count (for plots against N)."""
    return replace(machine, devices=devices)
