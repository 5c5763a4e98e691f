"""d2lpar.processes.env: who-am-I from torchrun, the legacy launcher, SLURM or nothing; clear errors."""

import pytest

from d2lpar.processes.env import DistEnv, EnvError, detect, expand_nodelist, local_rank_from_argv, slurm_master_port


def torchrun_env(rank, world, local, local_world, node=0, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
           "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node),
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job"}
    env.update(extra)
    return env


def test_plain_process_is_rank_0_of_1():
    who = detect({})
    assert who == DistEnv() and not who.distributed and who.is_main and who.launcher == "single"


def test_torchrun_two_nodes_of_eight():
    # node 1, local rank 3 of a 2 x 8 job: global rank 8 + 3
    who = detect(torchrun_env(11, 16, 3, 8, node=1))
    assert (who.rank, who.world_size, who.local_rank, who.local_world_size, who.node_rank) == (11, 16, 3, 8, 1)
    assert who.launcher == "torchrun" and who.init_method == "env://"
    assert who.master_addr == "10.0.0.1" and who.master_port == 29500


def test_variables_set_by_hand_without_local_rank():
    who = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (who.rank, who.local_rank, who.local_world_size, who.launcher) == (1, 1, 2, "env")


@pytest.mark.parametrize("argv", [["--local-rank=1"], ["--local_rank=1"], ["--local-rank", "1"],
                                  ["x", "--local_rank", "1", "--lr", "3"]])
def test_local_rank_argument_spellings(argv):
    assert local_rank_from_argv(argv) == 1


def test_legacy_launcher_argument_and_variable_agree():
    env = torchrun_env(1, 2, 1, 2)
    who = detect(env, local_rank_arg=1)
    assert who.launcher == "torch.distributed.launch" and who.local_rank == 1
    with pytest.raises(EnvError, match="--local-rank=0 but LOCAL_RANK=1"):
        detect(env, local_rank_arg=0)


def test_local_rank_without_a_world_is_an_error():
    with pytest.raises(EnvError, match="torchrun"):
        detect({}, local_rank_arg=0)
    with pytest.raises(EnvError, match="RANK and WORLD_SIZE"):
        detect({"LOCAL_RANK": "0"})


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("node1", ["node1"]),
    ("a[1-2],b5,c[09-10]", ["a1", "a2", "b5", "c09", "c10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("sh-idc1-10-5-30-[60,61]", ["sh-idc1-10-5-30-60", "sh-idc1-10-5-30-61"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-03", "gpu01]", "gpu[a-b]", "gpu[5-3]", ""])
def test_bad_nodelist(bad):
    with pytest.raises(EnvError):
        expand_nodelist(bad)


def slurm_env(rank, ntasks, local, node=0, nodelist="gpu[01-03,07]", per_node=None, **extra):
    per_node = per_node or (f"8(x{ntasks // 8})" if ntasks >= 8 else str(ntasks))
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(local),
           "SLURM_NODEID": str(node), "SLURM_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": per_node,
           "SLURM_JOB_ID": "123456"}
    env.update(extra)
    return env


def test_slurm_rank_world_local_and_master_from_compressed_list():
    who = detect(slurm_env(13, 32, 5, node=1))
    assert (who.rank, who.world_size, who.local_rank, who.local_world_size, who.node_rank) == (13, 32, 5, 8, 1)
    assert who.launcher == "slurm" and who.master_addr == "gpu01"
    assert who.master_port == slurm_master_port({"SLURM_JOB_ID": "123456"}) == 20000 + 123456 % 20000
    assert who.init_method == f"tcp://gpu01:{who.master_port}"


def test_slurm_master_addr_and_port_variables_win():
    who = detect(slurm_env(0, 2, 0, MASTER_ADDR="login1", MASTER_PORT="4242"))
    assert (who.master_addr, who.master_port) == ("login1", 4242)


def test_torchrun_inside_slurm_uses_torchrun():
    env = {**slurm_env(0, 2, 0), **torchrun_env(5, 16, 5, 8)}
    assert detect(env).launcher == "torchrun" and detect(env).rank == 5


def test_world_size_the_launcher_disagrees_with():
    with pytest.raises(EnvError, match="planned for world size 4, but torchrun started 2"):
        detect(torchrun_env(0, 2, 0, 2), expected_world_size=4)
    with pytest.raises(EnvError, match="WORLD_SIZE=8 but SLURM started 2 tasks"):
        detect(slurm_env(0, 2, 0, WORLD_SIZE="8"))
    with pytest.raises(EnvError, match="planned for world size 2, but single"):
        detect({}, expected_world_size=2)
    assert detect(torchrun_env(0, 2, 0, 2), expected_world_size=2).world_size == 2


def test_inconsistent_ranks():
    with pytest.raises(EnvError, match="rank 2 is outside 0..1"):
        detect(torchrun_env(2, 2, 0, 2))
    with pytest.raises(EnvError, match="local rank 3 is outside 0..1"):
        detect(torchrun_env(1, 4, 3, 2))
    with pytest.raises(EnvError, match="RANK is set but WORLD_SIZE is not"):
        detect({"RANK": "0"})
    with pytest.raises(EnvError, match="not a whole number"):
        detect(torchrun_env(0, 2, 0, 2, WORLD_SIZE="two"))


def test_missing_master_address_names_the_typo():
    env = torchrun_env(0, 2, 0, 2)
    del env["MASTER_ADDR"]
    env["MASTER_ADRESS"] = "10.0.0.1"
    with pytest.raises(EnvError, match=r"MASTER_ADDR is not set \(found MASTER_ADRESS: a typo\?\)"):
        detect(env)
    with pytest.raises(EnvError, match="SLURM_JOB_NODELIST"):
        detect({k: v for k, v in slurm_env(0, 2, 0).items() if k != "SLURM_NODELIST"})
    env = torchrun_env(0, 2, 0, 2)
    del env["MASTER_PORT"]
    with pytest.raises(EnvError, match="MASTER_PORT is not set"):
        detect(env)


def test_one_process_needs_no_master():
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).world_size == 1
    assert detect(slurm_env(0, 1, 0, nodelist="")).master_addr is None


def test_slurm_variable_missing():
    with pytest.raises(EnvError, match="SLURM_NTASKS is not"):
        detect({"SLURM_PROCID": "0", "SLURM_NTASK": "2"})
