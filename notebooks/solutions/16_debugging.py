"""Worked solutions to the exercises of notebook 16 (debugging distributed runs)."""

import shutil
import uuid

import torch
from torch.utils.data import DistributedSampler

from d2lpar.comm import faults
from d2lpar.comm import flight_recorder as FR
from d2lpar.infra.paths import build_dir
from d2lpar.processes.launch import launch


def _float64_on_one_rank():
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    t = torch.ones(4, dtype=torch.float64 if dist.get_rank() else torch.float32)
    try:
        dist.all_reduce(t)
        out = t.tolist()
    except RuntimeError as e:
        out = "error: " + str(e).splitlines()[0][:600]
    dist.destroy_process_group()
    return out


def exercise_1():
    """float32 against float64: 16 bytes against 32. Sizes differ, so gloo aborts or errors; DETAIL
    names the dtypes before any byte is sent."""
    try:
        plain = launch(_float64_on_one_rank, 2, init_process_group=False, timeout=20, quiet=True)
    except Exception as e:   # gloo aborted a rank
        plain = f"{type(e).__name__}: {str(e).splitlines()[2][:120]}"
    detail = launch(_float64_on_one_rank, 2, init_process_group=False, timeout=20, quiet=True,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    print("plain gloo:", plain)
    print("DETAIL:", detail[0][:120])
    assert "TensorDtypes=Float" in detail[0] and "TensorDtypes=Double" in detail[1]
    return detail


def exercise_2():
    """Three ranks, rank 1 skips collective #3 (the planted fault): the reader names rank 1, at the
    collective where the pairing breaks, and the lines of collective #3 differ."""
    folder = build_dir("solutions_16") / "three_ranks"
    shutil.rmtree(folder, ignore_errors=True)
    launch(faults.skip_collective, 3, "recorded", str(folder), uuid.uuid4().hex, 2,
           init_process_group=False, timeout=30, quiet=True, env={"TORCH_FR_BUFFER_SIZE": "100"})
    found = FR.first_disagreement(FR.read_dumps(folder))
    print(found["text"])
    assert found["culprits"] == [1] and "collective #3 was called from different lines" in found["text"]
    return found["seq"]


def exercise_3():
    """10 examples on 4 ranks: drop_last=False pads to 12 (3 each, 2 seen twice); True keeps 8 (2 each,
    2 never seen)."""
    out = {}
    for drop_last in (False, True):
        per_rank = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False, drop_last=drop_last))
                    for r in range(4)]
        seen = [i for part in per_rank for i in part]
        out[drop_last] = ([len(p) for p in per_rank], len(seen) - len(set(seen)), 10 - len(set(seen)))
        print(f"drop_last={drop_last}: per rank {out[drop_last][0]}, seen twice {out[drop_last][1]}, "
              f"never {out[drop_last][2]}")
    assert out[False] == ([3, 3, 3, 3], 2, 0) and out[True] == ([2, 2, 2, 2], 0, 2)
    return out
