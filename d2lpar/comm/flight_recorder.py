"""Reading flight-recorder dumps: which collective did the ranks stop agreeing on?

Every process group records its last N collectives (operation, sequence number, tensor sizes and
dtypes, state, Python stack) in a ring buffer; N is ``TORCH_FR_BUFFER_SIZE``, read once per process,
2000 by default in torch 2.14 (``FlightRecorder.hpp``), 0 turns the recorder off. There is one
buffer per event type: ``torch._C._distributed_c10d._dump_fr_trace()`` returns the generic one, into
which gloo records; NCCL's groups record into their own (``_dump_nccl_trace()``), which NCCL jobs
dump on a watchdog timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``). ``dump`` reads the generic one only.
With one dump per rank, a hang or a
mismatch is found by lining the ranks' collectives up by sequence number: the first number where
the ranks' operations, sizes or dtypes differ, or where a rank has no entry (it never got there), is
where the program went wrong, and the rank whose record differs from the majority's is the culprit
(with 2 ranks there is no majority: see ``first_disagreement``).

``dump(folder, run)`` writes rank r's buffer twice: ``fr_<r>.json`` (with the run's id, the rank and
the world size, for ``first_disagreement``) and ``rank_<r>`` (torch's pickle, for torch's own analyzer,
``python -m torch.distributed.flight_recorder.fr_trace <folder> -p rank_``). gloo names the default
group '' in the dump's configuration and '0' in its entries; the pickle gets '0' in both, which the
analyzer needs.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
from collections import Counter
from pathlib import Path

__all__ = ["FlightRecorderError", "dump", "read_dumps", "first_disagreement", "torch_analysis"]


class FlightRecorderError(ValueError):
    """The dumps cannot be compared (none, a rank missing, or from different runs)."""


def dump(folder: str | Path, run: str) -> Path:
    """In a rank: write its generic (gloo's) flight-recorder buffer under ``folder``; return the
    JSON's path."""
    import torch
    import torch.distributed as dist
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    raw = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    config = raw.get("pg_config", {})
    if "" in config:   # gloo's default group: '' here, '0' in the entries
        raw["pg_config"] = {("0" if k == "" else k): dict(v, name=v.get("name") or "0",
                                                          desc=v.get("desc") or "default_pg")
                            for k, v in config.items()}
    (folder / f"rank_{rank}").write_bytes(pickle.dumps(raw))
    entries = [{"seq": e.get("collective_seq_id"), "op": e.get("profiling_name"),
                "sizes": e.get("input_sizes"), "dtypes": e.get("input_dtypes"),
                "state": e.get("state"),
                "where": _where(e.get("frames", []))} for e in raw.get("entries", [])]
    path = folder / f"fr_{rank}.json"
    path.write_text(json.dumps({"run": run, "rank": rank, "world": world, "entries": entries}))
    return path


def _where(frames) -> str:
    """The first frame outside torch: the user's line that called the collective."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and "multiprocessing" not in name and "d2lpar/processes" not in name:
            return f"{name.rsplit('/', 1)[-1]} line {f.get('line')}, in {f.get('name')}"
    return "?"


def read_dumps(folder: str | Path) -> dict[int, list[dict]]:
    """rank -> its collectives, after checking that the folder holds one dump per rank of one run."""
    folder = Path(folder)
    files = sorted(folder.glob("fr_*.json")) if folder.is_dir() else []
    if not files:
        raise FlightRecorderError(f"{folder} holds no flight-recorder dumps (fr_<rank>.json): set "
                                  "TORCH_FR_BUFFER_SIZE before init_process_group and call dump() in every rank")
    dumps = [json.loads(f.read_text()) for f in files]
    runs = {d["run"] for d in dumps}
    if len(runs) > 1:
        by_run = {r: sorted(d["rank"] for d in dumps if d["run"] == r) for r in runs}
        raise FlightRecorderError(f"{folder} mixes dumps of {len(runs)} runs ({'; '.join(f'{r}: ranks {v}' for r, v in sorted(by_run.items()))}): "
                                  "compare the dumps of one run; clear the folder before each run")
    world = dumps[0]["world"]
    missing = sorted(set(range(world)) - {d["rank"] for d in dumps})
    if missing:
        raise FlightRecorderError(f"{folder} has no dump from rank(s) {missing} of {world}: that rank "
                                  "died or never dumped; its own log (or a py-spy dump of it) says where it was")
    return {d["rank"]: d["entries"] for d in dumps}


def first_disagreement(dumps: dict[int, list[dict]]) -> dict | None:
    """The first sequence number at which the ranks' collectives differ (None if they all agree):
    {'seq', 'per_rank': {rank: 'op sizes dtypes' or 'nothing'}, 'culprits', 'text'}.

    The culprits are the ranks whose record differs from the majority's; with no majority (always
    with 2 ranks) there are none: the records alone cannot say which rank went astray."""
    by_seq = {r: {e["seq"]: e for e in entries} for r, entries in dumps.items()}
    last = max((s for entries in by_seq.values() for s in entries), default=0)
    for seq in range(1, last + 1):
        seen = {r: _key(entries.get(seq)) for r, entries in by_seq.items()}
        if len(set(seen.values())) > 1:
            counts = Counter(seen.values()).most_common()
            text = f"collective #{seq}: " + "; ".join(f"rank {r}: {k}"
                                                      for r, k in sorted(seen.items()))
            if len(counts) > 1 and counts[0][1] == counts[1][1]:   # no majority (2 ranks: always)
                culprits = []
                text += ". No majority: the records cannot say which rank is the odd one out."
            else:
                culprits = sorted(r for r, k in seen.items() if k != counts[0][0])
                text += f". Odd one out: rank(s) {culprits}."
            lines = _first_other_call_site(by_seq, seq)
            if lines:
                sites = "; ".join(f"rank {r} at {w}" for r, w in sorted(lines[1].items()))
                text += f" Earlier, collective #{lines[0]} was called from different lines: {sites}"
            return {"seq": seq, "per_rank": seen, "culprits": culprits, "text": text}
    return None


def _first_other_call_site(by_seq, upto: int):
    """(seq, {rank: call site}) of the first collective before ``upto`` called from different lines
    on different ranks (often the real cause: a collective one rank skipped, paired with the next)."""
    for seq in range(1, upto + 1):
        sites = {r: entries[seq]["where"] for r, entries in by_seq.items() if seq in entries}
        if len(set(sites.values())) > 1:
            return seq, sites
    return None


def _key(entry) -> str:
    if entry is None:
        return "nothing (it never got there)"
    return f"{entry['op']} {entry['sizes']} {entry['dtypes']}"


def torch_analysis(folder: str | Path, first: int | None = None) -> str:
    """What torch's analyzer (``torch.distributed.flight_recorder.fr_trace``) prints for the folder.

    The analyzer matches every rank against the record of the rank whose dump it read first, and
    reads them in ``os.walk``'s order, which depends on the filesystem. ``first`` fixes that rank."""
    import logging

    out = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # importing it prints "tabulate is not installed" without that package
        from torch.distributed.flight_recorder import fr_trace
    read_dir = fr_trace.read_dir

    def read_dir_first(args):   # the same dumps, rank ``first``'s placed first
        details, version = read_dir(args)
        order = sorted(details, key=lambda f: details[f]["rank"] != first)
        return {f: details[f] for f in order}, version
    logger = logging.getLogger("Flight Recorder")   # the analyzer reports through this logger
    handler = logging.StreamHandler(out)
    saved = logger.handlers[:]
    logger.handlers = [handler]
    if first is not None:
        fr_trace.read_dir = read_dir_first
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            fr_trace.main([str(folder), "-p", "rank_"])
    finally:
        logger.handlers = saved
        fr_trace.read_dir = read_dir
    return out.getvalue()
