"""The launcher: results come back; failures and hangs become errors that show what happened, name
the rank that began it and point at full logs; nothing is left behind, not even by a killed caller."""

import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from d2lpar.processes import launch as launch_module
from d2lpar.processes.commands import HAVE_PROC, REPO, descendants, open_fds
from d2lpar.processes.launch import LaunchError, LaunchTimeout, RankFailed, choose_backend, launch
from d2lpar.processes.ranklog import _short

needs_proc = pytest.mark.skipif(not HAVE_PROC, reason="counts processes through /proc (Linux)")


@pytest.fixture
def no_strays(warm_launcher):
    before = descendants()
    yield
    assert descendants() == before, "a rank outlived its launch"


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


def test_notebook_defined_function(no_strays):
    # A function whose module is __main__ is what a notebook cell defines: it must go by value.
    ns = {"__name__": "__main__"}
    exec(textwrap.dedent("""
        import torch, torch.distributed as dist
        SCALE = 3
        def worker(x):
            t = torch.full((2,), float(x * SCALE))
            dist.all_reduce(t)
            return t.tolist()
    """), ns)
    assert launch(ns["worker"], 4, 1) == [[12.0, 12.0]] * 4


def test_output_in_rank_order_down_to_the_file_descriptors(no_strays, capsys):
    def talk():
        import ctypes
        import torch.distributed as dist
        r = dist.get_rank()
        print(f"python {r}")
        os.write(1, f"fd1 {r}\n".encode())
        os.write(2, f"fd2 {r}\n".encode())
        subprocess.run(["sh", "-c", f"echo subprocess {r}"], check=True)
        ctypes.CDLL(None).printf(b"printf %d\n", r)  # C stdio, buffered: flushed at the end
    launch(talk, 2)
    out = capsys.readouterr().out
    assert "".join(f"[rank {r}] {w} {r}\n" for r in (0, 1)
                   for w in ("python", "fd1", "fd2", "subprocess", "printf")) in out
    launch(talk, 2, quiet=True)
    assert capsys.readouterr().out == ""


def test_environment_as_it_is_at_each_launch(no_strays, monkeypatch):
    def seen():
        import torch.distributed as dist
        return [os.environ.get(k) for k in ("NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "D2LPAR_X")] + [
            dist.get_debug_level().name]
    for k in ("NCCL_DEBUG", "CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("D2LPAR_X", "first")
    assert launch(seen, 2) == [[None, None, "first", "OFF"]] * 2  # differ before ...
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")  # torch reads it at import: read again
    monkeypatch.delenv("D2LPAR_X")
    assert launch(seen, 2) == [["INFO", "", None, "INFO"]] * 2  # ... equal after
    assert launch(seen, 1, env={"D2LPAR_X": "given"})[0][2] == "given"


def test_init_left_to_the_worker(no_strays):
    def worker():
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        return int(os.environ["RANK"]), dist.get_world_size(), torch.get_num_threads()
    assert launch(worker, 2, init_process_group=False) == [(0, 2, 1), (1, 2, 1)]


# ------------------------------------------------------------------------ refused before starting

@pytest.fixture
def nothing_starts(monkeypatch):
    def refuse():
        raise AssertionError("a process was about to start")
    monkeypatch.setattr(launch_module, "_forkserver", refuse)


@pytest.mark.parametrize("n", [0, -2, 2.0, True])
def test_bad_world_size(n, nothing_starts):
    with pytest.raises(LaunchError, match="world_size must be a whole number"):
        launch(_rank_and_size, n)


def test_bad_arguments_fail_in_the_caller(nothing_starts):
    with pytest.raises(LaunchError, match=r"fn must be the function each rank runs, got float 3.0"):
        launch(3.0, 2)
    with pytest.raises(LaunchError, match=r"_all_reduce\(value\) cannot take .* missing .*'value'"):
        launch(_all_reduce, 2)
    with pytest.raises(LaunchError, match="too many positional arguments"):
        launch(_all_reduce, 2, 1, 2)
    with pytest.raises(LaunchError, match="timeout must be a positive, finite number"):
        launch(_all_reduce, 2, 1, timeout=0)

    def wait(timeout):
        return timeout
    # launch's own timeout= takes the keyword; the worker then lacks it: say so, and the way out
    with pytest.raises(LaunchError, match=r"`timeout` is also an option of launch\(\).*"
                                          r"fn_kwargs=\{'timeout': \.\.\.\}.*Nothing was started"):
        launch(wait, 2, timeout=5)
    with pytest.raises(LaunchError, match="given both as keywords and in fn_kwargs"):
        launch(_all_reduce, 2, value=1, fn_kwargs={"value": 2})


def test_fn_kwargs_reach_the_worker(no_strays):
    def wait(timeout, backend="mine"):
        return timeout, backend
    assert launch(wait, 1, fn_kwargs={"timeout": 7, "backend": "b"}, timeout=30) == [(7, "b")]


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


def test_unknown_backend(nothing_starts):
    with pytest.raises(LaunchError, match="unknown backend 'mpi2'"):
        launch(_rank_and_size, 2, backend="mpi2")


def test_unserializable_function(nothing_starts):
    import threading
    lock = threading.Lock()
    with pytest.raises(LaunchError, match="cannot send .* create locks, files and sockets inside"):
        launch(lambda: lock.locked(), 2)


def test_a_port_in_use_is_replaced_not_an_error(no_strays, capsys):
    # Another program (on a shared machine: another user's launch) listens on the port asked for.
    def worker():
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")   # rank 0 listens on MASTER_PORT
        return int(os.environ["MASTER_PORT"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        got = launch(worker, 2, master_port=port, init_process_group=False)
    assert got[0] == got[1] != port
    assert (f"launch: port {port} on 127.0.0.1 is in use (another launch or program): "
            f"MASTER_PORT={got[0]} instead") in capsys.readouterr().out


# ---------------------------------------------------------------------------------- failures

def test_a_rank_that_raises(no_strays):
    def worker():
        import torch.distributed as dist
        if dist.get_rank() == 2:
            for i in range(29):
                print(f"line{i:02d}")
            os.write(2, b"line29 written to fd 2, as C++ does\n")
            raise ValueError("bad shard")
        dist.barrier()  # the others wait for rank 2, which never comes
    with pytest.raises(RankFailed) as info:
        launch(worker, 4, timeout=30)
    err, text = info.value, str(info.value)
    assert err.rank == 2 and "ValueError: bad shard" in err.remote_traceback
    assert "rank 2 of 4 failed" in text and "\n    line29 written to fd 2" in text and "line10" in text
    assert "line09" not in text  # the last 20 lines, not more
    assert sorted(err.consequences) == [0, 1, 3], "the others are listed as consequences"
    log = err.logs / "rank2.log"
    assert str(err.logs) in text and log.exists(), "the error points at the full log"
    full = log.read_text()
    assert "line00" in full and "ValueError: bad shard" in full


def test_a_rank_killed_in_an_all_reduce_is_named_every_time(no_strays):
    # Rank 1 dies while rank 0 waits for it in an all-reduce. Rank 0 then fails too ("Connection
    # closed by peer"), often before the caller sees rank 1's death: rank 1 must still be named.
    def worker():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
    named = []
    for _ in range(20):
        with pytest.raises(RankFailed) as info:
            launch(worker, 2, timeout=30)
        named.append(info.value.rank)
        assert "was killed by signal SIGKILL" in info.value.remote_traceback
    assert named == [1] * 20
    assert re.search(r"as a consequence:\n  rank 0: .*Connection closed by peer", str(info.value))


@pytest.mark.parametrize("n", [3, 5])
def test_a_rank_that_closes_the_group_alone_is_named_not_the_ranks_it_left(no_strays, n):
    # rank 0's fn destroys the launcher's group and returns; the others fail in the launcher's
    # closing barrier with "connection closed by peer", which used to make rank 1 the cause
    def worker(everyone: bool):
        import torch.distributed as dist
        dist.all_reduce(torch.ones(1))
        if everyone or dist.get_rank() == 0:
            dist.destroy_process_group()
        return dist.is_initialized()
    assert launch(worker, n, True, timeout=30) == [False] * n   # every rank alike: fine
    with pytest.raises(RankFailed) as info:
        launch(worker, n, False, timeout=30)
    assert info.value.rank == 0 and sorted(info.value.consequences) == list(range(1, n))
    assert info.value.remote_traceback.startswith(
        "rank 0 left the process group early (its fn called dist.destroy_process_group() and "
        f"returned) while rank(s) {', '.join(map(str, range(1, n)))} still needed it")
    assert "\n" not in info.value.remote_traceback


def test_a_collective_mismatch_that_gloo_aborts_on_is_explained(no_strays):
    # gloo kills the process (SIGABRT) when ranks give one all-reduce different sizes; the error
    # says why, and gloo's own message is shown whole, not cut.
    def worker():
        import torch.distributed as dist
        dist.all_reduce(torch.ones(4 + dist.get_rank()))
    with pytest.raises(RankFailed) as info:
        launch(worker, 2, timeout=30)
    text = str(info.value)
    assert "killed by signal SIGABRT" in text
    assert "different sizes or dtypes" in text
    assert "Received data size doesn't match expected size. Is there a distributed collective mismatch" in text


def test_a_rank_that_never_joins_shows_where_each_rank_waits(no_strays):
    def worker():
        import torch.distributed as dist
        print("started")
        if dist.get_rank() == 0:
            time.sleep(60)
        dist.all_reduce(torch.ones(1))
    line = inspect.getsourcelines(worker)[1]
    # Ranks 1 and 2 must reach the all-reduce before the deadline: a start takes ~0.3 s when quiet,
    # but 1 s was too little on a busy CI machine (no rank had printed yet). 6 s leaves room.
    with pytest.raises(LaunchTimeout, match=r"ranks \[0, 1, 2\] of 3 had not finished after 6 s") as info:
        launch(worker, 3, timeout=6)
    text = str(info.value)
    here = _short(__file__)  # tests/test_launch.py: paths inside the checkout are shown relative
    assert f"rank 0 was in worker ({here} line {line + 4})" in text, text
    for r in (1, 2):
        assert re.search(rf"rank {r} was in all_reduce \(torch/distributed/\S+ line \d+\), called "
                         rf"from worker \({re.escape(here)} line {line + 5}\)", text)
        assert f"rank {r} (rank{r}.log):\n    started" in text
    assert sorted(info.value.stacks) == [0, 1, 2] and (info.value.logs / "rank0.log").exists()


def test_a_result_that_cannot_be_returned(no_strays):
    def worker():
        import threading
        return threading.Lock()
    with pytest.raises(RankFailed, match="(?s)rank 0 of 1 failed.*lock"):
        launch(worker, 1)


# ------------------------------------------------------------------------ nothing left behind

@needs_proc
def test_many_launches_leak_no_descriptors_nor_processes(warm_launcher):
    launch(_all_reduce, 4, 0)  # lazy one-time state (the store, pipes) before counting
    fds, kids = open_fds(), descendants()
    t0 = time.perf_counter()
    for _ in range(20):
        assert launch(_all_reduce, 4, 0) == [6.0] * 4
    seconds = (time.perf_counter() - t0) / 20
    # no growth (a process another test left may end meanwhile, so "not more", not "the same")
    assert open_fds() <= fds and descendants() <= kids
    # ~0.2 s on a quiet 2-core machine; a fresh process per rank (mp.spawn) costs ~8 s there.
    # The bound leaves room for a machine shared with other jobs.
    assert seconds < 4.0, f"a warm launch of 4 ranks took {seconds:.1f} s"


def _nap(seconds):
    time.sleep(seconds)
    return os.getpid()


def test_each_launch_notes_its_phases_from_the_caller_and_every_rank(no_strays):
    t0 = time.time()
    pids = launch(_nap, 3, 0.4)
    wall = time.time() - t0
    phases = launch_module.last_phases()
    assert sorted(phases.ranks) == [0, 1, 2] and sorted(phases.received) == [0, 1, 2]
    assert all(set(m) == {"ready", "joined", "worked", "closed"} for m in phases.ranks.values())
    secs = phases.seconds()
    assert secs["work"] >= 0.4 and all(s >= 0 for s in secs.values()), secs
    assert 0 <= wall - phases.total() < 0.1, (phases.total(), wall)   # the whole launch, no more
    assert len(set(pids)) == 3


def _with_marker(marker: str) -> list[int]:
    """Processes whose (initial) environment carries ``marker``."""
    needle = f"D2LPAR_TEST_MARK={marker}".encode()
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


@needs_proc
def test_a_script_without_a_main_guard_then_killed_hard(tmp_path):
    # 1. Ranks get the worker by value, so they never re-run the calling script: no
    #    `if __name__ == "__main__":` is needed, and the script does not launch itself again.
    # 2. The caller then starts 4 ranks that sleep and is SIGKILLed (a kernel crash, the OOM
    #    killer): within 5 s no forkserver nor rank may be left.
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, time
        import torch, torch.distributed as dist
        from d2lpar.processes.launch import launch
        def worker():
            t = torch.ones(1)
            dist.all_reduce(t)
            return t.item()
        print("results", launch(worker, 2), flush=True)
        def sleeper():
            pathlib.Path({str(tmp_path)!r}, f"up{{dist.get_rank()}}").touch()
            time.sleep(60)
        launch(sleeper, 4, timeout=100)
    """))
    marker = uuid.uuid4().hex
    with open(tmp_path / "out.txt", "w") as out:
        caller = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, "D2LPAR_TEST_MARK": marker})
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("up*"))) < 4 and time.monotonic() < deadline:
            assert caller.poll() is None, (tmp_path / "out.txt").read_text()
            time.sleep(0.05)
        assert len(list(tmp_path.glob("up*"))) == 4, "the ranks did not start"
        assert len(_with_marker(marker)) >= 6  # caller, forkserver, 4 ranks (+ resource tracker)
    finally:
        caller.kill()
        caller.wait()
    killed = time.monotonic()
    while _with_marker(marker) and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert _with_marker(marker) == [], "a forkserver or rank outlived its caller by 5 s"
    assert (tmp_path / "out.txt").read_text().count("results [2.0, 2.0]") == 1


def test_a_long_run_shows_its_progress_while_it_runs(no_strays, capsys):
    def slow():
        import time
        print("step 1 of 2")
        time.sleep(1.5)
        return "done"

    assert launch(slow, 2, progress=0.5) == ["done", "done"]
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("launch: still running"))
    assert re.fullmatch(r"launch: still running after \d+ s: rank\(s\) 0, 1 of 2", lines[at]), out
    assert lines[at + 1] == "  rank 0 last printed: step 1 of 2", out
    assert launch(slow, 2, progress=None) == ["done", "done"]
    assert "still running" not in capsys.readouterr().out


def test_a_progress_line_is_cut_at_a_word_within_100_characters():
    from d2lpar.processes.launch import progress_line
    text = progress_line(13.2, set(range(8)), 8, "epoch 2: train loss 0.4512, test loss 0.3929, "
                         "test accuracy 0.9091 on 121 images, the last of the run's evaluation")
    first, second = text.splitlines()
    assert first == "launch: still running after 13 s: rank(s) 0, 1, 2, 3, 4, 5, 6, 7 of 8"
    assert len(second) <= 100 and second.endswith(" ...") and "accuracy" in second


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_child(then: str):
    def worker():
        import subprocess
        child = subprocess.Popen(["sleep", "60"])
        if then == "raise":
            raise RuntimeError(f"child {child.pid} started")
        if then == "hang":
            print(f"child {child.pid}", flush=True)
            time.sleep(60)
        return child.pid
    return worker


@needs_proc
@pytest.mark.parametrize("then", ["return", "raise", "hang"])
def test_what_a_rank_started_ends_with_the_launch(no_strays, then):
    if then == "return":
        pids = launch(_start_child(then), 2)
    else:
        with pytest.raises((RankFailed, LaunchTimeout)) as info:
            launch(_start_child(then), 2, timeout=4)
        pids = [int(p) for p in re.findall(r"child (\d+)", str(info.value))]
    assert pids and all(p > 0 for p in pids)
    deadline = time.monotonic() + 3
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], f"children of ranks outlived launch(): {pids}"


@needs_proc
def test_ranks_holding_the_gil_and_their_children_end_with_a_killed_caller(tmp_path):
    # Each rank starts a `sleep`, then sums in C with the GIL held: its watch thread cannot run.
    script = tmp_path / "gil.py"
    script.write_text(textwrap.dedent(f"""
        import pathlib, subprocess
        import torch.distributed as dist
        from d2lpar.processes.launch import launch
        def busy():
            child = subprocess.Popen(["sleep", "120"])
            pathlib.Path({str(tmp_path)!r}, f"up{{dist.get_rank()}}").write_text(str(child.pid))
            return sum(range(10 ** 11))
        launch(busy, 2, timeout=200)
    """))
    marker = uuid.uuid4().hex
    caller = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "D2LPAR_TEST_MARK": marker})
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("up*"))) < 2 and time.monotonic() < deadline:
            assert caller.poll() is None, "the caller ended early"
            time.sleep(0.05)
        time.sleep(0.3)   # the ranks are inside sum() now
        children = [int(p.read_text()) for p in tmp_path.glob("up*")]
    finally:
        caller.kill()
        caller.wait()
    killed = time.monotonic()
    while (_with_marker(marker) or any(_alive(p) for p in children)) and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert _with_marker(marker) == [], "a forkserver, a rank or its child outlived its caller by 5 s"


@pytest.mark.parametrize("option, value, said", [
    ("timeout", float("nan"), "timeout must be a positive, finite number"),
    ("timeout", float("inf"), "timeout must be a positive, finite number"),
    ("threads_per_rank", 0, "threads_per_rank must be a whole number >= 1"),
    ("threads_per_rank", -1, "threads_per_rank must be a whole number >= 1"),
    ("threads_per_rank", "2", "threads_per_rank must be a whole number >= 1"),
    ("threads_per_rank", 1.5, "threads_per_rank must be a whole number >= 1"),
    ("master_port", 70000, "master_port must be a port number from 0 to 65535"),
    ("master_port", -1, "master_port must be a port number from 0 to 65535"),
    ("master_addr", "no-such-host.invalid", "master_addr 'no-such-host.invalid' does not resolve"),
    ("master_addr", "192.0.2.1", "master_addr '192.0.2.1' is not an address of this machine"),
])
def test_bad_launcher_options_are_named_before_anything_starts(nothing_starts, option, value, said):
    start = time.monotonic()
    with pytest.raises(LaunchError, match=re.escape(said)) as info:
        launch(_rank_and_size, 2, **{option: value}, timeout=5) if option != "timeout" else \
            launch(_rank_and_size, 2, timeout=value)
    assert "\n" not in str(info.value) and time.monotonic() - start < 5


def test_a_huge_message_from_a_rank_is_cut_in_the_error(no_strays):
    def worker():
        print("x" * 2_000_000)
        raise ValueError("y" * 1_000_000)
    with pytest.raises(RankFailed) as info:
        launch(worker, 1)
    text = str(info.value)
    assert len(text) < 20_000 and "characters cut" in text and "ValueError: yyy" in text
