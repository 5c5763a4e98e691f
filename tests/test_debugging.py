"""Each planted fault of notebook 16 is found by its tool, and each fix makes its check pass, on 3
ranks where the notebook uses 2."""

import time

import pytest
import torch

from d2lpar.comm import faults
from d2lpar.processes.launch import LaunchTimeout, RankFailed, launch


def test_mismatched_dtypes_are_silent_then_named_by_detail():
    plain = launch(faults.mismatch, 3, "dtype", 2, init_process_group=False, timeout=20, quiet=True)
    assert plain[0] != [3.0] * 4                       # a wrong sum, no error
    detail = launch(faults.mismatch, 3, "dtype", 2, init_process_group=False, timeout=20, quiet=True,
                    env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert all(d.startswith("error: Detected mismatch between collectives") for d in detail)


def test_uneven_batches_end_with_join_and_unused_parameters_are_named():
    assert launch(faults.uneven_batches, 3, "join", timeout=20, quiet=True) == [8, 7, 7]
    with pytest.raises(RankFailed, match="Parameters which did not receive grad for rank [0-2]: head.bias, head.weight"):
        launch(faults.unused_parameter, 3, False, timeout=20, quiet=True, env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})
    assert launch(faults.unused_parameter, 3, True, timeout=20, quiet=True) == [2, 2, 2]


def _silent_checks():
    out = {}
    for fix in (False, True):
        masks = [faults.dropout_masks(fix)]
        orders = faults.sampler_orders(fix)
        step = faults.manual_data_parallel_step(fix)
        nan = faults.nan_step(fix)
        out[fix] = (masks[0], orders, step, nan)
    return out


def test_each_silent_error_fails_its_check_until_fixed():
    res = launch(_silent_checks, 3, timeout=30, quiet=True)
    for fix in (False, True):
        masks = [r[fix][0] for r in res]
        assert (not torch.equal(masks[0], masks[1])) == fix
        assert (res[0][fix][1][0] != res[0][fix][1][1]) == fix
        nan = res[0][fix][3]
        assert nan["skipped"] == fix and (nan["bad_ranks"] == [1]) == fix
    summed, averaged = res[0][False][2]["weight"], res[0][True][2]["weight"]
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 1).weight.detach()
    assert torch.allclose(summed - start, 3 * (averaged - start), atol=1e-6)   # 3 ranks: 3x the step
    assert faults.device_for({"RANK": "9", "LOCAL_RANK": "1"}, True) == "cuda:1"
    assert faults.device_for({"RANK": "9", "LOCAL_RANK": "1"}, False) == "cuda:9"


@pytest.mark.parametrize("fault,args,said", [
    (faults.mismatch, ("size", 2), r"kind='size': use 'order', 'shape' or 'dtype'"),
    (faults.mismatch, ("shape", 0), r"timeout_s=0: give the seconds a collective may wait"),
    (faults.mismatch, ("shape", -1), r"timeout_s=-1: give the seconds a collective may wait"),
    (faults.skip_collective, ("bogus",), r"how='bogus': use 'hang', 'monitored' or 'recorded'"),
    (faults.skip_collective, ("recorded", None), r"how='recorded' writes .* folder=None: give"),
    (faults.skip_collective, ("recorded", "/proc/no/such"), r"folder='/proc/no/such' cannot be "),
    (faults.skip_collective, ("hang", None, "", float("nan")), r"timeout_s=nan: give the seconds"),
    (faults.uneven_batches, ("bogus",), r"fix='bogus': use None, 'join' or 'equal'"),
], ids=["kind", "timeout 0", "timeout -1", "how", "no folder", "unwritable folder", "timeout nan",
        "fix"])
def test_a_bad_fault_argument_is_one_sentence_before_any_rank_starts(fault, args, said):
    # without the check these hung until the launcher's timeout (an unknown how or fix) or failed
    # in every rank with torch's 70-line socket error (timeout_s 0)
    own_group = fault is not faults.uneven_batches   # it calls init_process_group itself
    start = time.monotonic()
    with pytest.raises(ValueError, match=said) as e:
        launch(fault, 3, *args, init_process_group=not own_group, timeout=5, quiet=True)
    assert time.monotonic() - start < 1.0 and "\n" not in str(e.value)


def _called_directly():
    return faults.uneven_batches("bogus")   # not through launch's check: the fault checks itself


def test_a_fault_called_inside_a_rank_refuses_a_bad_argument_too():
    with pytest.raises(RankFailed, match=r"fix='bogus': use None, 'join' or 'equal'"):
        launch(_called_directly, 3, timeout=10, quiet=True)


def test_the_skipper_is_a_parameter_and_monitored_barrier_names_it():
    said = launch(faults.skip_collective, 3, "monitored", None, "", 2, 2, init_process_group=False,
                  timeout=30, quiet=True)
    assert "Rank 2 failed to pass monitoredBarrier" in said[0]


def test_detail_mismatch_keeps_what_matters():
    from d2lpar.comm.debug_tools import detail_mismatch
    opts = "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)"
    msg = ("Detected mismatch between collectives on ranks. Rank 0 is running collective: "
           f"CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], "
           f"TensorDtypes=Float, {opts}), but Rank 1 is running collective: CollectiveFingerPrint("
           f"SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[6], TensorDtypes=Float, {opts})."
           "Collectives differ in the following aspects:   Tensor Tensor shapes: 4vs 6")
    assert detail_mismatch(msg) == ["rank 0: collective #1, ALLREDUCE, shape [4], dtype Float",
                                    "rank 1: collective #1, ALLREDUCE, shape [6], dtype Float",
                                    "they differ in: tensor shapes: 4 vs 6"]


def test_ddp_launches_each_bucket_during_backward():
    from d2lpar.comm.debug_tools import profile_ddp_step
    for out in launch(profile_ddp_step, 2, 1, 0.005, quiet=True, timeout=60):
        assert out["order"] == ["all-reduce of bucket 0 launched", "backward compute of layer 3",
                                "all-reduce of bucket 1 launched", "backward compute of layer 2",
                                "all-reduce of bucket 2 launched", "backward compute of layer 1",
                                "all-reduce of bucket 3 launched"]
        assert {s[1] for s in out["spans"]} >= {"backward compute", "gloo:all_reduce", "mm"}
