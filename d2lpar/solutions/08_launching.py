"""Worked solutions to the exercises of notebook 08 (launching).

Each ``exercise_k`` computes its answer, prints it and asserts what it claims. Exercises 2 and 3 run
real ``torchrun`` commands (a few seconds each: every process imports PyTorch); exercise 1 uses the
course's launcher, which gives each rank the variables torchrun gives it, and exercise 5 forks its
savers from this process, so neither pays for a fresh interpreter.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import torch

from d2lpar.examples import ddp_torch
from d2lpar.infra.check import check, check_equal
from d2lpar.infra.paths import build_dir
from d2lpar.processes import checkpoint, env
from d2lpar.processes.commands import free_port, start, working_folder
from d2lpar.processes.launch import RankFailed, launch

SCRIPT = ["-m", "d2lpar.examples.train_ddp"]  # runs wherever d2lpar is installed
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def exercise_1():
    """Three processes and a global batch of 32: the script refuses, because 32 does not split
    evenly over 3 ranks (each rank takes B/W examples per step)."""
    out = str(build_dir("solutions_08") / "three_ranks")
    shutil.rmtree(out, ignore_errors=True)  # no last.pt to resume from
    try:
        launch(ddp_torch.main, 3, ["--out", out, "--examples", "96", "--epochs", "1"],
               init_process_group=False, timeout=60)
        raise AssertionError("three ranks with a global batch of 32 should have been refused")
    except RankFailed as e:
        said = re.search(r"Usage: (.*)", str(e))
    print("the script says:", said[1] if said else str(e)[:300])
    check("it names the global batch and the fix", said is not None and "multiple of 3" in said[1])
    launch(ddp_torch.main, 3, ["--out", out, "--examples", "96", "--epochs", "1", "--batch-size", "48"],
           init_process_group=False, timeout=60)
    state = checkpoint.load(os.path.join(out, "last.pt"))
    check_equal("with --batch-size 48 (16 per rank) the three ranks train an epoch", state["epoch"], 0)


def exercise_2():
    """Different master ports: node 0 hosts a store on its port and waits for a node that never
    comes; node 1 knocks on a port where nobody listens. Both give up only at the rendezvous timeout,
    600 s by default for static rendezvous; ``--rdzv-conf timeout=N`` shortens it."""
    ports = [free_port(), free_port()]
    nodes = [[*TORCHRUN, "--nnodes=2", f"--node-rank={n}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
              f"--master-port={ports[n]}", "--rdzv-conf=timeout=3", *SCRIPT, "--train-size", "64",
              "--epochs", "1"] for n in range(2)]
    t0 = time.perf_counter()
    jobs = [start(cmd, cwd=working_folder()) for cmd in nodes]
    try:
        codes = [job.wait(120) for job in jobs]
    finally:
        for job in jobs:
            job.stop()
    seconds = time.perf_counter() - t0
    errors = [next((line for line in reversed(job.text().splitlines()) if "Error" in line), "") for job in jobs]
    for n, (code, error) in enumerate(zip(codes, errors)):
        print(f"node {n}: exit code {code}: {re.sub(r'[0-9]{4,5}', 'PORT', error)}")
    print(f"both ended after {seconds:.1f} s (timeout=3 s, plus start-up)")
    check("both nodes fail", all(code not in (0, None) for code in codes))
    check("node 0 timed out waiting for the second node", "waiting for clients" in errors[0])
    check("node 1 timed out connecting to its master port", "timed out" in errors[1])
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
    check_equal("without --rdzv-conf timeout=N they would wait (seconds)",
                static_tcp_rendezvous._default_timeout_seconds, 600)


def exercise_3():
    """A second kill with --max-restarts=1: no restart is left, torchrun gives up and names the root
    cause (exitcode -9, SIGKILL); last.pt from the last finished epoch is left on disk."""
    folder = build_dir("solutions_08") / "restart_twice"
    shutil.rmtree(folder, ignore_errors=True)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", *SCRIPT,
           "--train-size", "128", "--epochs", "3", "--batch-size", "32", "--ckpt-dir", str(folder)]
    job = start(cmd, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, cwd=working_folder())
    try:
        for round_ in ("0", "1"):
            if round_ == "0":
                job.wait_until(lambda: (folder / "last.pt").exists(), 120)
            job.wait_until(lambda: bool(job.pids(RANK="1", TORCHELASTIC_RESTART_COUNT=round_)), 120)
            os.kill(job.pids(RANK="1", TORCHELASTIC_RESTART_COUNT=round_)[0], signal.SIGKILL)
        code = job.wait(120)
    finally:
        job.stop()
    text = job.text()
    summary = [line.strip() for line in text.splitlines()
               if re.search(r"ChildFailedError|Root Cause|exitcode|Signal 9|restart", line)]
    print("\n".join(re.sub(r"\b\d{3,}\b", "N", line) for line in summary[-8:]))
    state = checkpoint.load(folder / "last.pt")
    left = sorted(p.name for p in folder.iterdir())
    print(f"exit code {code}; left in the checkpoint folder: {left}; last.pt holds epoch {state['epoch']}")
    check("torchrun gives up with an error exit code", code not in (0, None))
    check("and names the root cause: a worker killed by signal 9", "Signal 9 (SIGKILL)" in text)
    check("the checkpoint of the first epoch survives, complete", left == ["last.pt"] and state["epoch"] == 0)


def exercise_4():
    """4 nodes x 4 GPUs, one torchrun per node: one task per node, torchrun starts the 4 workers."""
    sbatch = '''#!/bin/bash
#SBATCH --job-name=train-ddp
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1          # one task per node: the torchrun launcher
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32           # for the 4 workers together
#SBATCH --time=01:00:00

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=8             # 32 cores / 4 workers
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # restarts that work with torch 2.14.1 (notebook 8)

srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" \\
    torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=4 --max-restarts=3 \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:29400" --rdzv-id="$SLURM_JOB_ID" \\
    -m d2lpar.examples.ddp_torch --out "$HOME/checkpoints/train-ddp" &
wait
'''
    path = build_dir("solutions_08") / "ddp_torch_4x4.sbatch"
    path.write_text(sbatch)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    check_equal("bash reads the script without a syntax error", syntax.returncode, 0)
    check("4 nodes, one task each, 4 GPUs each", all(s in sbatch for s in (
        "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=4", "--nproc-per-node=4")))
    # What the worker with local rank 2 on the fourth node will see (torchrun's variables):
    who = env.detect({"RANK": str(3 * 4 + 2), "WORLD_SIZE": "16", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                      "GROUP_RANK": "3", "MASTER_ADDR": "gpu01", "MASTER_PORT": "29400",
                      "TORCHELASTIC_RUN_ID": "123456"})
    print(who.describe())
    check_equal("world size 16, rank = node * 4 + local rank", (who.world_size, who.rank), (16, 14))


def _save_forever(path, atomic):
    torch.set_num_threads(1)
    big, step = torch.zeros(4_000_000), 0
    while True:
        state = {"step": step, "w": big + step}
        checkpoint.save(state, path) if atomic else torch.save(state, path)
        step += 1


def _kill_while_saving(path, atomic):
    """Start a saver, wait for one complete save, kill it in the middle of a later one: with
    torch.save while last.pt is shorter than a complete file (truncated, being rewritten), with
    checkpoint.save while its temporary file exists. Return whether last.pt still loads."""
    saver = multiprocessing.get_context("fork").Process(target=_save_forever, args=(str(path), atomic))
    saver.start()
    size = lambda: path.stat().st_size if path.exists() else 0  # noqa: E731
    in_a_save = (lambda: bool(list(path.parent.glob(f".{path.name}.tmp-*")))) if atomic else \
        (lambda: 0 < size() < 16_000_000)
    deadline = time.monotonic() + 60
    while size() < 16_000_000 and time.monotonic() < deadline:   # one complete save first
        time.sleep(0.001)
    while not in_a_save() and time.monotonic() < deadline:
        pass
    os.kill(saver.pid, signal.SIGKILL)
    saver.join(10)
    try:
        torch.load(path, weights_only=True)
        return True
    except Exception:  # torch.load's errors for a truncated file vary: any error means "lost"
        return False


def exercise_5():
    """torch.save truncates the file and then writes it: a kill in between leaves a file that does
    not load. checkpoint.save writes a temporary file and renames it: last.pt always loads."""
    folder = build_dir("solutions_08") / "kill_while_saving"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    attempts = 5
    loads = {}
    for atomic in (False, True):
        name = "checkpoint.save" if atomic else "torch.save"
        results = []
        for attempt in range(attempts):
            (folder / f"{name}-{attempt}").mkdir()
            results.append(_kill_while_saving(folder / f"{name}-{attempt}" / "last.pt", atomic))
        loads[name] = sum(results)
        print(f"{name:<16}: last.pt loads after {loads[name]} of {attempts} kills")
    check("torch.save: a kill in the middle of a save leaves a file that does not load (4 of 5 or more)",
          loads["torch.save"] <= 1)
    check("checkpoint.save: every kill leaves a file that loads", loads["checkpoint.save"] == attempts)
