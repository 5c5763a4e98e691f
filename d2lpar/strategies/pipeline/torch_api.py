"""The same pipelines with PyTorch's own API, ``torch.distributed.pipelining``, for comparison.

``PipelineStage(module, stage_index, num_stages, device)`` wraps the part of the model a rank holds
(the *manual* split: we cut the ``nn.Sequential`` ourselves, as for d2lpar's executor); a schedule
class (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``, ...) takes the rank's stage (or its list of stages, for the
multi-stage schedules, placed in a loop as d2lpar places them: rank r holds stages r, r+p, ...), the
number of micro-batches and the loss function, and ``step`` runs one training step: the first stage
passes the batch, the last passes the targets.

Loss scale: torch's schedules call ``loss_fn`` on each micro-batch and, with ``scale_grads=True``
(the default), divide the gradients by m at the end, so each micro-batch's mean loss weighs 1/m: the
full-batch mean when micro-batches are equal, as in d2lpar's executor. ``sched.pipeline_order`` is
the schedule as data (rank -> actions, ``None`` for an idle slot), like d2lpar's ``Schedule.order``.
Importing the package costs about a second per process; only the ranks that use it import it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TORCH_SCHEDULES", "torch_pipeline_worker"]

TORCH_SCHEDULES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B",
                   "interleaved 1F1B": "ScheduleInterleaved1F1B",
                   "interleaved ZB": "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS"}


def torch_pipeline_worker(runs: list[tuple[str, list[nn.Module]]], X: torch.Tensor,
                          y: torch.Tensor, microbatches: int,
                          loss_fn=nn.functional.cross_entropy, repeats: int = 1) -> dict:
    """On every rank: for each (schedule name, stages) run ``repeats`` steps; return per run
    this rank's gradients per stage (of the last step), its pipeline_order as strings, and the
    step times."""
    from torch.distributed import pipelining
    rank, p = dist.get_rank(), dist.get_world_size()
    on_gpu = "nccl" in dist.get_backend_config()  # the launcher's GPU group is "cpu:gloo,cuda:nccl"
    device = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    out = {}
    for name, stages in runs:
        cls_name = TORCH_SCHEDULES.get(name, name)
        cls = getattr(pipelining, cls_name)
        mine = list(range(rank, len(stages), p))
        if cls_name not in MULTI_STAGE and len(mine) != 1:
            raise ValueError(f"{cls_name} runs one stage per rank: "
                             f"give {p} stages, not {len(stages)}")
        wrapped = [pipelining.PipelineStage(stages[s].to(device), s, len(stages), device)
                   for s in mine]
        sched = cls(wrapped if cls_name in MULTI_STAGE else wrapped[0], microbatches,
                    loss_fn=loss_fn)
        times = []
        for _ in range(repeats):
            for s in mine:
                stages[s].zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            if 0 in mine:
                sched.step(X.to(device), target=y.to(device) if len(stages) - 1 in mine else None)
            elif len(stages) - 1 in mine:
                sched.step(target=y.to(device))
            else:
                sched.step()
            times.append(time.perf_counter() - t0)
        order = getattr(sched, "pipeline_order", {}).get(rank, [])
        out[name] = {"grads": {s: [q.grad.detach().cpu().clone() for q in stages[s].parameters()]
                               for s in mine},
                     "order": [str(a) if a is not None else "" for a in order], "times": times}
    return out
