"""A checkpoint saved by 2 FSDP2 ranks loads on 4 ranks and in one process; a wrong one is named."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shutil

from d2lpar.infra.paths import build_dir
from d2lpar.processes import sharded_checkpoint as SC
from d2lpar.processes.launch import launch


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _sharded(seed):
    from torch.distributed.fsdp import fully_shard
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    net = _net(seed)
    fully_shard(net[0])
    fully_shard(net[2])
    fully_shard(net)
    return net


def _save(path):
    net = _sharded(1)
    SC.save({"model": net.state_dict(), "step": 7}, path)
    return net[0].weight.to_local().shape[0]


def _load(path):
    net = _sharded(2)  # other values: loading must replace them
    state = SC.load({"model": net.state_dict(), "step": 0}, path)
    return {k: v.full_tensor() for k, v in net.state_dict().items()}, state["step"]


def test_two_ranks_save_four_ranks_and_one_process_load():
    path = build_dir("test_sharded_checkpoint") / "two_ranks"
    shutil.rmtree(path, ignore_errors=True)
    rows = launch(_save, 2, str(path), timeout=90)
    assert rows == [4, 3]  # 7 rows over 2 ranks: each saved only its own shard
    expected, other = _net(1).state_dict(), _net(2).state_dict()
    assert not torch.allclose(expected["0.weight"], other["0.weight"])  # differ before ...
    for state, step in launch(_load, 4, str(path), timeout=90):
        torch.testing.assert_close(state, expected, rtol=0, atol=0)  # ... equal after
        assert step == 7
    one = SC.load({"model": _net(2).state_dict()}, path, no_dist=True)["model"]
    torch.testing.assert_close(one, expected, rtol=0, atol=0)


def test_a_checkpoint_of_another_model_is_named():
    path = build_dir("test_sharded_checkpoint") / "other"
    shutil.rmtree(path, ignore_errors=True)
    SC.save({"model": _net(0).state_dict()}, path)
    torch.manual_seed(0)
    wider = nn.Sequential(nn.Linear(5, 9), nn.ReLU(), nn.Linear(9, 3), nn.Linear(3, 3))
    with pytest.raises(SC.CheckpointMismatch) as err:
        SC.load({"model": wider.state_dict()}, path, no_dist=True)
    text = str(err.value)
    assert "shape of model.0.weight: checkpoint (7, 5), here (9, 5)" in text
    assert "missing from the checkpoint: model.3.weight" in text
    with pytest.raises(FileNotFoundError, match="not a DCP checkpoint"):
        SC.describe(path / "nowhere")


def test_a_damaged_checkpoint_names_its_folder_and_file():
    path = build_dir("test_sharded_checkpoint") / "damaged"
    state = {"model": _net(0).state_dict()}
    for damage, expected in [("metadata", r"damaged: its file \.metadata cannot be read"),
                             ("missing", r"damaged: its shard file __0_0\.distcp is missing"),
                             ("truncated", r"damaged: its shard file __0_0\.distcp has \d+ bytes where "
                                           r"the metadata needs \d+")]:
        shutil.rmtree(path, ignore_errors=True)
        SC.save(state, path)
        SC.load({"model": _net(1).state_dict()}, path, no_dist=True)   # whole, it loads
        shard = path / "__0_0.distcp"
        if damage == "metadata":
            (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:40])
        elif damage == "missing":
            shard.unlink()
        else:
            shard.write_bytes(shard.read_bytes()[:-100])
        with pytest.raises(SC.CheckpointDamaged, match=f"the checkpoint {path} is {expected}"):
            SC.load({"model": _net(1).state_dict()}, path, no_dist=True)


def test_keys_only_in_the_checkpoint_are_listed_under_the_keys_asked_for():
    path = build_dir("test_sharded_checkpoint") / "with_extra"
    shutil.rmtree(path, ignore_errors=True)
    SC.save({"model": _net(0).state_dict(), "extra": {"a": torch.zeros(2)}}, path)
    torch.manual_seed(0)
    short = nn.Sequential(nn.Linear(5, 8))
    problems = SC.mismatches({"model": short.state_dict()}, path)
    assert "only in the checkpoint: model.2.bias, model.2.weight" in problems
    assert not any("extra.a" in p for p in problems)  # not asked for: not listed
