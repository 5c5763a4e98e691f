"""Worked solutions to the exercises of notebook 16 (debugging distributed runs)."""

import re
import shutil
import uuid

import torch
from torch.utils.data import DistributedSampler

from d2lpar.comm import faults
from d2lpar.comm import flight_recorder as FR
from d2lpar.infra.paths import build_dir
from d2lpar.processes.launch import RankFailed, launch


def _float64_on_one_rank():
    import torch.distributed as dist
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=2))
    t = torch.ones(4, dtype=torch.float64 if dist.get_rank() else torch.float32)
    try:
        dist.all_reduce(t)
        out = t.tolist()
    except RuntimeError as e:
        out = "error: " + str(e).splitlines()[0]
    dist.destroy_process_group()
    return out


def exercise_1():
    """float32 against float64: 16 bytes against 32. The sizes differ, so this is gloo's second
    behaviour: the float32 rank receives more bytes than it expects, gloo's enforce in its TCP
    transport fails ("Received data size doesn't match expected size") and aborts that process
    (SIGABRT). DETAIL names the dtypes before any byte is sent."""
    try:
        launch(_float64_on_one_rank, 2, init_process_group=False, timeout=20, quiet=True)
        raise AssertionError("plain gloo added float32 to float64 without a word")
    except RankFailed as e:
        text = str(e)
        said = [line.strip() for line in text.splitlines() if "Received data size" in line]
        assert said and "SIGABRT" in text, text  # gloo's enforce, then the abort
        plain = f"{text.splitlines()[0]} {said[0][said[0].find('op.preamble'):]}"
    detail = launch(_float64_on_one_rank, 2, init_process_group=False, timeout=20, quiet=True,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    import textwrap
    print(textwrap.fill(f"plain gloo: {plain}", 100, subsequent_indent="    "))
    from d2lpar.comm.debug_tools import detail_mismatch
    print("DETAIL:", *detail_mismatch(detail[0]), sep="\n  ")
    assert "TensorDtypes=Float" in detail[0] and "TensorDtypes=Double" in detail[1]
    return detail


def _skip_and_read(world: int, skipper: int, name: str):
    folder = build_dir("solutions_16") / name
    shutil.rmtree(folder, ignore_errors=True)
    launch(faults.skip_collective, world, "recorded", str(folder), uuid.uuid4().hex, 2, skipper,
           init_process_group=False, timeout=30, quiet=True)   # the flight recorder: on by default
    return FR.first_disagreement(FR.read_dumps(folder)), FR.torch_analysis(folder)


def exercise_2():
    """Three ranks, rank 2 skips collective #3. Its next all-reduce pairs with the others' #3, so
    the operations first differ at #4 (rank 2 in the barrier, ranks 0 and 1 in an all-reduce): the
    reader names rank 2 there, by majority, and #3 as called from different lines (rank 2's #3 came
    from the line after the branch). torch's analyzer takes one rank's record as the reference, not
    the majority's; when that is rank 2's, it names ranks 0 and 1. On 2 ranks the records disagree
    one against one: no majority, no culprit; the call sites of #3 still point at the branch."""
    found, report = _skip_and_read(3, 2, "three_ranks")
    print(found["text"])
    assert found["seq"] == 4 and found["culprits"] == [2]
    assert "collective #3 was called from different lines" in found["text"]
    assert "Collective sequence number: 4 has errors" in report
    folder = build_dir("solutions_16") / "three_ranks"
    for first, want in ((0, [2]), (2, [0, 1])):   # the analyzer's reference: the dump read first
        named = sorted(int(r) for r in re.findall(r"Culprit rank (\d+)",
                                                   FR.torch_analysis(folder, first=first)))
        print(f"torch's analyzer, rank {first}'s dump read first: culprits {named}")
        assert named == want, named
    two, _ = _skip_and_read(2, 0, "two_ranks")
    print(two["text"])
    assert two["seq"] == 4 and two["culprits"] == [] and "No majority" in two["text"]
    assert "collective #3 was called from different lines" in two["text"]
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
