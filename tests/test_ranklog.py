"""d2lpar.processes.ranklog, without processes: the root cause, where a stack was, logs and tails."""

from d2lpar.processes import ranklog
from d2lpar.processes.ranklog import Failure, RunLogs, root_cause, where

PEER = ("Traceback (most recent call last):\n  ...\nRuntimeError: [/__w/pytorch/pytorch/third_party/"
        "gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:4331. GLHF!\n")
OWN = "Traceback (most recent call last):\n  ...\nValueError: bad shard\n"


def test_the_cause_is_the_earliest_rank_that_was_not_a_consequence():
    peer_first = Failure(0, "raised", PEER, time=1.0)  # reached the caller first
    killed = Failure(1, "died", "the process was killed by signal SIGKILL", time=1.2)
    assert peer_first.consequence == 1 and killed.consequence == 0
    cause, others = root_cause([peer_first, killed])
    assert cause is killed and others == [peer_first]
    # differ before, equal after: among causes, the earliest wins, whatever the arrival order
    early, late = Failure(3, "raised", OWN, time=2.0), Failure(2, "raised", OWN, time=2.5)
    assert root_cause([late, early, peer_first])[0] is early
    assert root_cause([peer_first])[0] is peer_first  # only consequences: the earliest of them


def test_a_rank_that_left_the_group_is_the_cause_only_when_the_others_lost_a_peer():
    stranded = [Failure(2, "raised", PEER, time=1.1), Failure(1, "raised", PEER, time=1.0)]
    cause, others = root_cause(stranded, left=[0])
    assert (cause.rank, cause.kind) == (0, "left") and [f.rank for f in others] == [1, 2]
    assert "rank(s) 1, 2 still needed it" in cause.text
    assert root_cause(stranded)[0].rank == 1   # without knowing who left: the earliest peer
    own = Failure(2, "raised", OWN, time=1.2)
    assert root_cause([stranded[1], own], left=[0])[0] is own   # an error of its own comes first


def test_last_line_without_the_library_noise():
    assert Failure(0, "raised", PEER, 0).last_line == ("RuntimeError: Connection closed by peer "
                                                       "[127.0.0.1]:4331.")


MAIN = "0x00007f521066fb80"
DUMP = f"""# main thread {MAIN}
Thread 0x00007f51541ff6c0 (most recent call first):
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 947 in wait
  File "/work/d2lpar/processes/rank.py", line 65 in watch

Current thread {MAIN} (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/ipykernel_77/2948.py", line 4 in worker
  File "/work/d2lpar/processes/rank.py", line 96 in main
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
"""


def test_where_reads_the_main_thread_of_a_faulthandler_dump():
    assert where(DUMP) == ("was in all_reduce (torch/distributed/distributed_c10d.py line 3913), "
                           "called from worker (notebook cell, line 4)")
    assert [line.strip() for line in ranklog.stack_lines(DUMP).splitlines()] == [
        "notebook cell, line 4 in worker", "torch/distributed/c10d_logger.py line 83 in wrapper",
        "torch/distributed/distributed_c10d.py line 3913 in all_reduce"]
    returned = DUMP.replace(f"# main thread {MAIN}\n", f"# main thread {MAIN}\n# fn returned\n")
    assert where(returned).endswith("it waited for the others in the launcher's closing barrier")
    barrier = returned.replace("all_reduce", "barrier").replace(
        '  File "/tmp/ipykernel_77/2948.py", line 4 in worker\n', "").replace(
        'process.py", line 108 in run\n', 'process.py", line 108 in run\n  File "<string>", line 1 in <module>\n')
    assert where(barrier) == ("was in barrier (torch/distributed/distributed_c10d.py line 3913): its fn "
                              "had returned, it waited for the others in the launcher's closing barrier")
    assert where("") == "gave no stack (it did not answer the signal)"


def test_logs_tail_and_keep(tmp_path, monkeypatch):
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(ranklog, "KEEP_RUNS", 2)
    runs = [RunLogs(2) for _ in range(4)]
    lines = [f"line{i:02d}" for i in range(25)]
    runs[-1].log(0).write_text("\n".join(lines) + f"\n{ranklog.RAISED_MARK}\nTraceback ...\n")
    assert runs[-1].tail(0).splitlines() == lines[-20:]  # the traceback is not repeated
    assert "rank 1 (rank1.log):\n    (nothing)" in runs[-1].tails()
    runs[-1].keep()
    assert sorted(p.name for p in (tmp_path / "launch").iterdir()) == [r.dir.name for r in runs[-2:]]
    runs[-1].remove()
    assert not runs[-1].dir.exists()


def test_no_stack_signal_no_error(monkeypatch):
    from d2lpar.processes import rank
    monkeypatch.setattr(rank, "STACK_SIGNAL", None)  # Windows has no SIGUSR1
    rank.arm_stack_dump("/nonexistent/never-written")  # no signal to arm: nothing opened, no error
    assert rank._stack_file is None


def test_stack_paths_drop_this_machine_prefix():
    from pathlib import Path
    from d2lpar.processes import ranklog
    package = Path(ranklog.__file__).resolve().parents[1] / "strategies" / "data" / "ddp.py"
    assert ranklog._short(str(package)) == "d2lpar/strategies/data/ddp.py"
    assert ranklog._short("/v/lib/python3.11/site-packages/torch/distributed/c10d.py") == \
        "torch/distributed/c10d.py"
