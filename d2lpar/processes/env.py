"""Who am I? Rank, world size, local rank and master address, from whichever launcher started us.

Every distributed process needs four facts before ``init_process_group``: its global ``rank`` in
``0 .. world_size-1``, the ``world_size`` (total processes, normally nodes x processes per node), its
``local_rank`` on its own machine (which GPU to use), and where rank 0 listens (master address and
port). With N nodes of G processes each, the process with local rank l on node n has

    rank = n * G + l,    world_size = N * G,    local_rank = l in 0 .. G-1.

Launchers hand these over differently, and ``detect()`` reads them all:

* ``torchrun`` (and ``d2lpar.processes.launch``): variables RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
  GROUP_RANK, MASTER_ADDR, MASTER_PORT; then ``init_method='env://'``.
* the legacy ``python -m torch.distributed.launch``: the same variables, plus the *argument*
  ``--local-rank=N`` (PyTorch >= 2.0) or ``--local_rank=N`` (older versions) appended to the script's
  command line. Pass the parsed value as ``local_rank_arg``; it must agree with LOCAL_RANK.
* SLURM's ``srun``: SLURM_PROCID (rank), SLURM_NTASKS (world size), SLURM_LOCALID (local rank),
  SLURM_NODEID (node rank) and the node list (``gpu[01-03,07]`` means gpu01, gpu02, gpu03, gpu07);
  the master is the first host of the list unless MASTER_ADDR says otherwise.
* nothing: one plain process, rank 0 of 1.

Contradictions (a world size the launcher disagrees with, a rank outside the world, a missing master
address) raise ``EnvError`` with a sentence that says what to fix, instead of a hang at rendezvous.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["EnvError", "DistEnv", "detect", "expand_nodelist", "local_rank_from_argv",
           "slurm_master_port"]


class EnvError(RuntimeError):
    """The launcher's variables are missing or contradict each other."""


@dataclass(frozen=True)
class DistEnv:
    """What one process knows about its place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = "single"  # 'torchrun', 'env', 'torch.distributed.launch', 'slurm' or 'single'

    @property
    def distributed(self) -> bool:
        """True when there is more than one process, so a process group is needed."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, saves checkpoints and hosts the rendezvous store."""
        return self.rank == 0

    @property
    def init_method(self) -> str:
        """What to pass to ``init_process_group``: env:// when the launcher set the variables."""
        if self.launcher in ("torchrun", "env", "torch.distributed.launch"):
            return "env://"
        if self.master_addr is None or self.master_port is None:
            raise EnvError("no master address: set MASTER_ADDR and MASTER_PORT")
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    def describe(self) -> str:
        where = f", master {self.master_addr}:{self.master_port}" if self.distributed else ""
        return (f"{self.launcher}: rank {self.rank} of {self.world_size}, local rank "
                f"{self.local_rank} of {self.local_world_size} on node {self.node_rank}{where}")


# ------------------------------------------------------------------------------------------ helpers

def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise EnvError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a whole number") from None


def _near_misses(env: Mapping[str, str], name: str) -> str:
    """' (found MASTER_ADRESS: a typo?)' when a variable with a similar name is set."""
    close = difflib.get_close_matches(name, [k for k in env if k != name], n=2, cutoff=0.75)
    return f" (found {', '.join(close)}: a typo?)" if close else ""


def local_rank_from_argv(argv: Sequence[str]) -> int | None:
    """The value of ``--local-rank N``/``--local-rank=N`` (or the older ``--local_rank``), else None."""
    for i, arg in enumerate(argv):
        for flag in ("--local-rank", "--local_rank"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg[len(flag) + 1:]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                raise EnvError(f"{flag} needs a whole number, got {value!r}") from None
    return None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list:
    ``'gpu[01-03,07],cpu5'`` -> gpu01 gpu02 gpu03 gpu07 cpu5.

    Ranges keep their zero padding; several bracket groups in one name multiply out
    (``'r[1-2]n[1-2]'`` -> r1n1 r1n2 r2n1 r2n2).
    """
    hosts: list[str] = []
    depth, start = 0, 0
    parts = []
    for i, ch in enumerate(nodelist + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise EnvError(f"unbalanced ']' in node list {nodelist!r}")
        elif ch == "," and depth == 0:
            parts.append(nodelist[start:i].strip())
            start = i + 1
    if depth != 0:
        raise EnvError(f"unbalanced '[' in node list {nodelist!r}")
    for part in filter(None, parts):
        pieces = re.split(r"\[([^\]]*)\]", part)  # text, group, text, group, ..., text
        choices: list[list[str]] = []
        for k, piece in enumerate(pieces):
            choices.append([piece] if k % 2 == 0 else _expand_group(piece, nodelist))
        hosts.extend("".join(c) for c in itertools.product(*choices))
    if not hosts:
        raise EnvError(f"the node list {nodelist!r} names no host")
    return hosts


def _expand_group(group: str, nodelist: str) -> list[str]:
    out = []
    for item in group.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if not m:
            raise EnvError(f"cannot read {item!r} in node list {nodelist!r}: expected N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise EnvError(f"range {item!r} in node list {nodelist!r} runs backwards")
        out.extend(str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1))
    return out


def slurm_master_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT if set, else a port every task of the job computes alike from SLURM_JOB_ID."""
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    job = env.get("SLURM_JOB_ID", "")
    return 20000 + int(job) % 20000 if job.isdigit() else 29500


# ------------------------------------------------------------------------------------------- detect

def detect(environ: Mapping[str, str] | None = None, *, local_rank_arg: int | None = None,
           expected_world_size: int | None = None) -> DistEnv:
    """Read rank, world size, local rank and master from the launcher that started this process.

    environ: the variables to read (default ``os.environ``).
    local_rank_arg: the value the script parsed from ``--local-rank``/``--local_rank`` (legacy
        launcher), or None.
    expected_world_size: the world size the caller planned for (e.g. a ``--world-size`` option); a
        launcher that says otherwise is an error.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env and "SLURM_PROCID" not in env:
        who = _from_torchrun(env, local_rank_arg)
    elif "SLURM_PROCID" in env:
        who = _from_slurm(env)
        if local_rank_arg is not None and local_rank_arg != who.local_rank:
            raise EnvError(f"--local-rank={local_rank_arg} but SLURM_LOCALID={who.local_rank}: "
                           "under srun, drop the --local-rank argument")
    elif local_rank_arg is not None or "LOCAL_RANK" in env:
        raise EnvError("a local rank was given (--local-rank or LOCAL_RANK) but not RANK and "
                       "WORLD_SIZE: start the script with torchrun, which sets all of them, e.g. "
                       "`torchrun --nproc-per-node=2 script.py`")
    else:
        who = DistEnv()
    _validate(who, env)
    if expected_world_size is not None and expected_world_size != who.world_size:
        raise EnvError(f"this job was planned for world size {expected_world_size}, but {who.launcher} "
                       f"started {who.world_size} process(es): launch {expected_world_size} processes "
                       "(nodes x processes per node), or change the world size you ask for")
    return who


def _from_torchrun(env: Mapping[str, str], local_rank_arg: int | None) -> DistEnv:
    for name in ("RANK", "WORLD_SIZE"):
        if name not in env:
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise EnvError(f"{other} is set but {name} is not{_near_misses(env, name)}: torchrun sets "
                           "both; when you set them by hand, set RANK, WORLD_SIZE, MASTER_ADDR and "
                           "MASTER_PORT together")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if "LOCAL_RANK" in env:
        local = _int(env, "LOCAL_RANK")
        if local_rank_arg is not None and local_rank_arg != local:
            raise EnvError(f"--local-rank={local_rank_arg} but LOCAL_RANK={local}: they must agree")
    else:  # set by hand without LOCAL_RANK: take the argument, else assume a single node
        local = local_rank_arg if local_rank_arg is not None else rank
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    node = _int(env, "GROUP_RANK", rank // max(local_world, 1))
    if local_rank_arg is not None:
        launcher = "torch.distributed.launch"
    else:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
    port = env.get("MASTER_PORT")
    return DistEnv(rank, world, local, local_world, node, env.get("MASTER_ADDR") or None,
                   _int(env, "MASTER_PORT") if port else None, launcher)


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    if "SLURM_NTASKS" not in env:
        raise EnvError("SLURM_PROCID is set but SLURM_NTASKS is not"
                       f"{_near_misses(env, 'SLURM_NTASKS')}: run the script with srun inside an "
                       "allocation (sbatch or salloc), which sets both")
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if "SLURM_NPROCS" in env and _int(env, "SLURM_NPROCS") != world:
        raise EnvError(f"SLURM_NTASKS={world} but SLURM_NPROCS={env['SLURM_NPROCS']}: they must agree")
    if env.get("WORLD_SIZE") and _int(env, "WORLD_SIZE") != world:
        raise EnvError(f"WORLD_SIZE={env['WORLD_SIZE']} but SLURM started {world} tasks "
                       "(SLURM_NTASKS): unset WORLD_SIZE, or ask srun for that many tasks")
    local = _int(env, "SLURM_LOCALID", 0)
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
    m = re.match(r"\d+", per_node)  # '4' or '4(x2)' or '4(x2),3'
    local_world = int(m.group()) if m else world // max(_int(env, "SLURM_NNODES", 1), 1)
    node = _int(env, "SLURM_NODEID", 0)
    addr = env.get("MASTER_ADDR")
    if not addr:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(name):
                addr = expand_nodelist(env[name])[0]
                break
    return DistEnv(rank, world, local, local_world, node, addr or None, slurm_master_port(env), "slurm")


def _validate(who: DistEnv, env: Mapping[str, str]) -> None:
    if who.world_size < 1:
        raise EnvError(f"world size {who.world_size} from {who.launcher}: it must be at least 1")
    if not 0 <= who.rank < who.world_size:
        raise EnvError(f"rank {who.rank} is outside 0..{who.world_size - 1} (world size "
                       f"{who.world_size}, from {who.launcher}): every rank must be below the world size")
    if who.local_rank < 0 or who.local_rank >= max(who.local_world_size, 1):
        raise EnvError(f"local rank {who.local_rank} is outside 0..{who.local_world_size - 1}")
    if who.local_world_size > who.world_size:
        raise EnvError(f"{who.local_world_size} processes per node but world size {who.world_size}: "
                       "the world size counts the processes of all nodes, so it cannot be smaller")
    if who.distributed and not who.master_addr:
        hint = (" or a node list (SLURM_JOB_NODELIST)" if who.launcher == "slurm" else "")
        raise EnvError(f"no master address for a world of {who.world_size}: MASTER_ADDR is not set"
                       f"{_near_misses(env, 'MASTER_ADDR')}{hint}. Set MASTER_ADDR to the host of "
                       "rank 0 (and MASTER_PORT to a free port there), or start with torchrun, which "
                       "sets them")
    if who.distributed and who.master_port is None:
        raise EnvError(f"MASTER_PORT is not set{_near_misses(env, 'MASTER_PORT')}: set it to a free "
                       "port on the master host, e.g. MASTER_PORT=29500")
