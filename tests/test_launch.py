"""The launcher: results come back, failures and hangs become errors, nothing is left behind."""

import os
import socket
import textwrap

import pytest
import torch

from d2lpar.processes.launch import LaunchError, LaunchTimeout, RankFailed, choose_backend, launch


def _children() -> set[int]:
    """Live (non-zombie) descendants of this process, read from /proc."""
    me, kids = os.getpid(), set()
    parents = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(pid)] = int(fields[1])
    frontier = {me}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - kids
        kids |= frontier
    return kids


@pytest.fixture
def no_strays():
    launch(_rank_and_size, 1)  # start the forkserver before counting
    before = _children()
    yield
    assert _children() == before, "a rank outlived its launch"


def _rank_and_size():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"]


def _all_reduce(value):
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + value)])
    dist.all_reduce(t)
    return t.item()


def test_results_in_rank_order(no_strays):
    assert launch(_rank_and_size, 3) == [(r, 3, str(r)) for r in range(3)]


def test_all_reduce_on_four_ranks(no_strays):
    assert launch(_all_reduce, 4, 10) == [46.0] * 4


def test_notebook_defined_function(no_strays):
    # A function whose module is __main__ is what a notebook cell defines: it must go by value.
    ns = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        import torch, torch.distributed as dist
        SCALE = 3
        def worker(x):
            t = torch.full((2,), float(x * SCALE))
            dist.all_reduce(t)
            print("sum is", t.tolist())
            return t.tolist()
    """), ns)
    assert launch(ns["worker"], 4, 1) == [[12.0, 12.0]] * 4


def test_output_printed_in_rank_order(no_strays, capsys):
    def talk():
        import torch.distributed as dist
        print(f"hello from {dist.get_rank()}")
    launch(talk, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0\n[rank 1] hello from 1\n" in out
    launch(talk, 2, quiet=True)
    assert capsys.readouterr().out == ""


def test_init_left_to_the_worker(no_strays):
    def worker():
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        return int(os.environ["RANK"]), dist.get_world_size()
    assert launch(worker, 2, init_process_group=False) == [(0, 2), (1, 2)]


def test_one_thread_per_rank(no_strays):
    assert launch(torch.get_num_threads, 2) == [1, 1]


@pytest.mark.parametrize("n", [0, -2, 2.0])
def test_bad_world_size(n):
    with pytest.raises(LaunchError, match="world_size must be a whole number"):
        launch(_rank_and_size, n)


def test_nccl_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert choose_backend(2)[0] == "nccl"
    backend, reason = choose_backend(4)
    assert backend == "gloo" and "NCCL needs a GPU per rank" in reason
    with pytest.raises(LaunchError, match="one GPU per rank: 4 ranks but 2 GPU"):
        launch(_rank_and_size, 4, backend="nccl")


def test_nccl_without_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert choose_backend(2) == ("gloo", "no GPU here, so gloo on the CPU")
    with pytest.raises(LaunchError, match="use backend='gloo'"):
        launch(_rank_and_size, 2, backend="nccl")


def test_unknown_backend():
    with pytest.raises(LaunchError, match="unknown backend 'mpi2'"):
        launch(_rank_and_size, 2, backend="mpi2")


def test_unserializable_function():
    import threading
    lock = threading.Lock()
    with pytest.raises(LaunchError, match="cannot send .* create locks, files and sockets inside"):
        launch(lambda: lock.locked(), 2)


def test_a_rank_that_raises(no_strays):
    def worker():
        import torch.distributed as dist
        if dist.get_rank() == 2:
            print("about to fail")
            raise ValueError("bad shard")
        dist.barrier()  # the others wait for rank 2, which never comes
    with pytest.raises(RankFailed) as info:
        launch(worker, 4, timeout=30)
    err = info.value
    assert err.rank == 2 and "ValueError: bad shard" in err.remote_traceback
    assert "rank 2 of 4 failed" in str(err) and "about to fail" in str(err)


def test_a_rank_that_dies(no_strays):
    def worker():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            os.kill(os.getpid(), 9)
        dist.barrier()
    with pytest.raises(RankFailed, match="(?s)rank 1 of 2 failed.*was killed by signal SIGKILL"):
        launch(worker, 2, timeout=30)


def test_a_rank_that_never_joins(no_strays):
    def worker():
        import time
        import torch.distributed as dist
        if dist.get_rank() == 0:
            time.sleep(60)
        return dist.get_rank()
    with pytest.raises(LaunchTimeout, match=r"ranks \[0(, 1)?\] of 2 had not finished after 2 s"):
        launch(worker, 2, timeout=2)


def test_a_result_that_cannot_be_returned(no_strays):
    def worker():
        import threading
        return threading.Lock()
    with pytest.raises(RankFailed, match="(?s)rank 0 of 1 failed.*lock"):
        launch(worker, 1)


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is in use"):
            launch(_rank_and_size, 2, master_port=port)


def test_launches_are_cheap_after_the_first(no_strays):
    import time
    t0 = time.perf_counter()
    for _ in range(3):
        launch(_all_reduce, 4, 0)
    assert (time.perf_counter() - t0) / 3 < 2.0, "a warm launch of 4 ranks should take well under 2 s"


def test_a_script_without_a_main_guard(tmp_path):
    # Ranks get the worker by value, so they never re-run the calling script: no
    # `if __name__ == "__main__":` is needed, and the script does not launch itself again.
    import subprocess
    import sys
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from d2lpar.processes.launch import launch
        def worker():
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()
        print("results", launch(worker, 2))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("results [2.0, 2.0]") == 1
