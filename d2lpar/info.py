"""What this machine has, and what the course will simulate on it (``python -m d2lpar info``)."""

from __future__ import annotations

import os
import platform

import torch

from d2lpar.infra.devices import DeviceError, gpu_count
from d2lpar.infra.workers import cores

__all__ = ["machine_report"]


def machine_report() -> str:
    import torch.distributed as dist
    lines = []
    total, usable = os.cpu_count() or 1, cores()
    lines.append(f"Python {platform.python_version()} on {platform.system()} {platform.machine()}")
    threads = torch.get_num_threads()
    lines.append(f"CPU cores: {usable} usable of {total}; torch uses {threads} compute "
                 + ("thread" if threads == 1 else "threads"))
    lines.append(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    lines.append(f"CUDA_VISIBLE_DEVICES: {visible!r}" if visible is not None
                 else "CUDA_VISIBLE_DEVICES: not set (every GPU is visible)")
    try:
        gpus = gpu_count()
    except DeviceError as e:
        lines.append(f"GPUs: error: {e}")
        gpus = 0
    if gpus:
        for i in range(gpus):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i}  {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                         f"compute capability {p.major}.{p.minor}")
        for i in range(gpus):
            peers = [j for j in range(gpus) if j != i and torch.cuda.can_device_access_peer(i, j)]
            lines.append(f"  cuda:{i} reaches by peer-to-peer copy: {peers or 'none'}")
    else:
        lines.append("GPUs: none")
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    lines.append(f"Apple MPS: {'available' if mps else 'not available'}")
    backends = [name for name, ok in [("gloo", dist.is_gloo_available()),
                                      ("nccl", dist.is_nccl_available()),
                                      ("mpi", dist.is_mpi_available())] if ok]
    lines.append(f"torch.distributed backends: {', '.join(backends) or 'none'}")
    if gpus >= 2:
        lines.append(f"The course runs on {gpus} real GPUs; notebooks that want more simulate "
                     "them on the CPU.")
    elif gpus == 1:
        lines.append("The course runs on the one GPU where one device is enough,\n"
                     "and simulates several devices (or gloo ranks) on the CPU where it needs more.")
    else:
        lines.append("The course simulates devices on the CPU (cpu:0, cpu:1, ...) and runs ranks\n"
                     "as processes talking gloo over loopback: results, bytes and schedules are real;\n"
                     "speed-ups are predicted by the cost model, not measured.")
    return "\n".join(lines)
