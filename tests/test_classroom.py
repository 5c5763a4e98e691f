"""A shared classroom server: launches at the same time, of one user or of two, share nothing.

Launch A runs in this process; its rank 0 publishes A's MASTER_PORT, and, once the others have
started, listens there (``init_method='env://'``) until they are done. Launches B and C, each in a
process of its own, ask for A's port while A's ranks do not listen on it yet: B as this user under
another build folder, C as user ``nobody`` with a home of its own and no D2LPAR_BUILD_DIR (a student
on a JupyterHub), when the test runs as root and ``nobody`` can run this Python. A's caller holds
its port, so each is told the port is in use and takes another; then all three listen at once.
Each must succeed on a port of its own, with its ranks' logs in its own build folder, its own
forkserver in a folder only its user can open, and nothing left in the others' folders; ``nobody``
pointed at A's build folder gets the sentence that names it and D2LPAR_BUILD_DIR.

Cost: B and C each start Python, torch and a forkserver: 3.6 s of CPU each, measured, so about
4 s on 2 idle cores (estimated from that CPU time), and 7 to 14 s measured at a load average of 10
on 2 cores; A reuses the session's warm forkserver. The launcher itself (results, failures, a port
that another program listens on) is tested in test_launch.py; the build folder's rules in
test_paths.py.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver
from pathlib import Path

import pytest

from d2lpar.processes.commands import start
from d2lpar.processes.launch import launch

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
IN_USE = ("launch: port {} on 127.0.0.1 is in use (another launch or program): "
          "MASTER_PORT={} instead")

# B's and C's program: a launch that asks for A's port; its last line says what it saw, as JSON.
CALLER = r'''
import json, os, sys
from multiprocessing import forkserver
from d2lpar.infra import paths
from d2lpar.processes.launch import launch

def worker(started):
    import torch, torch.distributed as dist
    open(started, "a").close()   # tells A that this launch has its port
    dist.init_process_group("gloo", init_method="env://")   # rank 0 listens on MASTER_PORT
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item()), int(os.environ["MASTER_PORT"]), os.readlink("/proc/self/fd/1")

port, others, started = sys.argv[1:4]
refused = None
if others:   # another user's build folder: this user cannot write there
    os.environ["D2LPAR_BUILD_DIR"] = others
    try:
        paths.build_dir("launch")
    except paths.BuildDirError as e:
        refused = str(e)
    del os.environ["D2LPAR_BUILD_DIR"]
results = launch(worker, 2, started, master_port=int(port), init_process_group=False, timeout=40)
server = forkserver._forkserver._forkserver_address
st = os.stat(os.path.dirname(server))
print(json.dumps({"results": results, "build": str(paths.build_dir()), "forkserver": server,
                  "forkserver_folder": [st.st_uid, st.st_mode & 0o777], "refused": refused}))
'''


def _first_worker(port_file: str, started: list, release: str):
    """A's rank: publish MASTER_PORT, wait until the others have theirs, then listen there (rank 0)
    and all-reduce, and keep the store up until the test releases it."""
    import time

    import torch
    import torch.distributed as dist

    def wait_for(done):
        deadline = time.monotonic() + 30
        while not done() and not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)
    if int(os.environ["RANK"]) == 0:
        Path(port_file + ".part").write_text(os.environ["MASTER_PORT"])
        os.replace(port_file + ".part", port_file)
    wait_for(lambda: all(os.path.exists(s) for s in started))
    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(1)
    dist.all_reduce(t)
    wait_for(lambda: False)
    return int(t.item()), int(os.environ["MASTER_PORT"]), os.readlink("/proc/self/fd/1")


def _nobody_cannot(python: str) -> str | None:
    """Why this test cannot start a launch as a second user here, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "only root can start a second user's launch (setpriv); this test runs as a user"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    # through env, as below: setpriv itself execs with root's capabilities still on
    probe = subprocess.run([*AS_NOBODY, "env", python, "-c", "import importlib.util as u; "
                            "assert u.find_spec('torch') and u.find_spec('d2lpar')"],
                           cwd="/", capture_output=True, text=True, timeout=30)
    if probe.returncode:
        return (f"user nobody cannot run {python} with torch and d2lpar (a folder on its way is "
                f"closed to other users, e.g. /root): {probe.stderr.strip()[-120:]}")
    return None


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _seen(job, code) -> dict:
    assert code == 0, f"a launch beside another failed (exit {code}):\n{job.text()[-3000:]}"
    return json.loads(job.lines[-1])   # as printed: text() would shorten its paths


def test_launches_at_once_share_no_file_port_or_forkserver(warm_launcher, tmp_path, monkeypatch):
    python = sys.executable
    why_not = _nobody_cannot(python)
    shared = Path(tempfile.mkdtemp(prefix="d2lpar-classroom-"))
    shared.chmod(0o711)   # nobody may pass, not look: A's build folder is where a classmate's is
    signals = shared / "signals"
    signals.mkdir(mode=0o777)
    signals.chmod(0o777)
    builds = {"a": shared / "a_build", "b": tmp_path / "b_build"}
    users = ["b"] if why_not else ["b", "c"]
    started = {k: str(signals / f"{k}_started") for k in users}
    port_file, release = str(tmp_path / "a_port"), str(tmp_path / "release")
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(builds["a"]))
    got_a: list = []
    a = threading.Thread(target=lambda: got_a.append(launch(
        _first_worker, 2, port_file, list(started.values()), release, init_process_group=False,
        timeout=40, quiet=True)))
    jobs: dict = {}
    a.start()
    try:
        for _ in range(600):
            if os.path.exists(port_file) or not a.is_alive():
                break
            a.join(0.05)
        port_a = int(Path(port_file).read_text())
        jobs["b"] = start([python, "-c", CALLER, str(port_a), "", started["b"]], cwd=tmp_path,
                          env={"D2LPAR_BUILD_DIR": str(builds["b"])})
        if "c" in users:
            home = shared / "home"
            home.mkdir()
            os.chown(home, NOBODY, NOBODY)
            jobs["c"] = start([*AS_NOBODY, "env", "-u", "D2LPAR_BUILD_DIR", "-u", "XDG_CACHE_HOME",
                               f"HOME={home}", python, "-c", CALLER, str(port_a), str(builds["a"]),
                               started["c"]], cwd=home)
        codes = {k: job.wait(60) for k, job in jobs.items()}
    finally:
        Path(release).touch()
        a.join(60)
        for job in jobs.values():
            job.stop()
    try:
        seen = {k: _seen(jobs[k], codes[k]) for k in jobs}
        assert got_a, "launch A did not return"
        seen["a"] = {"results": [list(r) for r in got_a[0]], "build": str(builds["a"]),
                     "forkserver": forkserver._forkserver._forkserver_address}
        ports = {k: {r[1] for r in s["results"]} for k, s in seen.items()}
        for k, s in seen.items():
            assert [r[0] for r in s["results"]] == [2, 2], f"{k}'s all-reduce"
            assert len(ports[k]) == 1, f"{k}'s ranks disagree on MASTER_PORT: {ports[k]}"
            logs = Path(s["build"], "launch").resolve()
            assert all(Path(r[2]).parents[1] == logs for r in s["results"]), \
                f"{k}'s rank logs are not in its own build folder {logs}: {s['results']}"
        assert ports["a"] == {port_a}
        assert len(set.union(*ports.values())) == len(seen), f"two launches shared a port: {ports}"
        for k in jobs:   # each asked for A's port, was told it was in use, and took another
            assert IN_USE.format(port_a, min(ports[k])) in "\n".join(jobs[k].lines)
            assert seen[k]["forkserver_folder"][1] == 0o700
        assert len({s["forkserver"] for s in seen.values()}) == len(seen), "one forkserver shared"
        for build in builds.values():   # a good run's logs are gone; no one else's appeared
            assert _files(build) == ["launch"], f"{build} holds {_files(build)}"
        if "c" in users:
            c = seen["c"]
            assert Path(c["build"]) == home / ".cache" / "d2lpar"
            assert c["forkserver_folder"][0] == NOBODY
            assert all(p.stat().st_uid == NOBODY for p in home.rglob("*"))
            assert c["refused"] == (f"cannot write to the course's build folder "
                                    f"{builds['a']}/launch: set D2LPAR_BUILD_DIR to a folder "
                                    "you can write")
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    if why_not is not None:
        pytest.skip(f"one user's launches checked, not a second user's: {why_not}")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="a folder of another user's can only be made here by root")
def test_a_failed_run_cleans_up_its_users_old_logs_not_another_users(tmp_path, monkeypatch):
    from d2lpar.processes import ranklog
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(ranklog, "KEEP_RUNS", 1)
    theirs, mine_old, mine = (ranklog.RunLogs(2) for _ in range(3))
    os.chown(theirs.dir, NOBODY, NOBODY)
    for age, run in ((100, theirs), (50, mine_old)):   # both older than this run
        os.utime(run.dir, (os.stat(run.dir).st_atime - age,) * 2)
    mine.keep()
    assert theirs.dir.exists() and mine.dir.exists() and not mine_old.dir.exists()
