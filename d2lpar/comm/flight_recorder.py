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
    """The dumps cannot be compared: none, a file that is not a whole dump, dumps of different runs
    or world sizes, a rank out of range, twice or missing."""


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
    """rank -> its collectives, after checking that the folder holds one dump per rank of one run:
    every file a whole dump (``_load``), one run id, one world size, every rank below it, none
    twice, none missing. A folder reused by an earlier run with more ranks keeps that run's extra
    files: they are named, never read as ranks of this one."""
    folder = Path(folder)
    files = sorted(folder.glob("fr_*.json")) if folder.is_dir() else []
    if not files:
        raise FlightRecorderError(f"{folder} holds no flight-recorder dumps (fr_<rank>.json): set "
                                  "TORCH_FR_BUFFER_SIZE before init_process_group and call dump() in every rank")
    dumps = {f: _load(f) for f in files}
    runs = {d["run"] for d in dumps.values()}
    if len(runs) > 1:
        by_run = {r: sorted(d["rank"] for d in dumps.values() if d["run"] == r) for r in runs}
        raise FlightRecorderError(f"{folder} mixes dumps of {len(runs)} runs ({'; '.join(f'{r}: ranks {v}' for r, v in sorted(by_run.items()))}): "
                                  "compare the dumps of one run; clear the folder before each run")
    by_world: dict[int, list[Path]] = {}
    for f, d in dumps.items():
        by_world.setdefault(d["world"], []).append(f)
    if len(by_world) > 1:
        said = "; ".join(f"{_names(fs)} say{'s' * (len(fs) == 1)} {w}"
                         for w, fs in sorted(by_world.items()))
        raise FlightRecorderError(f"{folder}: the dumps disagree on the world size ({said})"
                                  f"{_stale(dumps, by_world)}, or clear the folder before each run")
    world = next(iter(by_world))
    holder: dict[int, Path] = {}
    for f, d in dumps.items():
        if not 0 <= d["rank"] < world:
            raise FlightRecorderError(f"{f} holds rank {d['rank']}, but its world of {world} has "
                                      f"ranks 0-{world - 1}: it is not from this run; delete it, or "
                                      "clear the folder before each run")
        if d["rank"] in holder:
            raise FlightRecorderError(f"{holder[d['rank']].name} and {f.name} both hold rank "
                                      f"{d['rank']}'s dump in {folder}: keep the one from the run "
                                      "you mean, or clear the folder before each run")
        holder[d["rank"]] = f
    missing = sorted(set(range(world)) - set(holder))
    if missing:
        raise FlightRecorderError(f"{folder} has no dump from rank(s) {missing} of {world}: that rank "
                                  "died or never dumped; its own log (or a py-spy dump of it) says where it was")
    return {d["rank"]: d["entries"] for d in dumps.values()}


def _names(files) -> str:
    return ", ".join(f.name for f in sorted(files))


def _stale(dumps: dict[Path, dict], by_world: dict[int, list[Path]]) -> str:
    """When the newest files make a whole run (ranks 0..w-1 of their world w, each once) and every
    other file is older: the clause that names those older files as an earlier run's leftovers."""
    newest = max(by_world, key=lambda w: min(f.stat().st_mtime for f in by_world[w]))
    mine = by_world[newest]
    others = [f for w, fs in by_world.items() if w != newest for f in fs]
    whole = sorted(dumps[f]["rank"] for f in mine) == list(range(newest))
    if not whole or max(f.stat().st_mtime for f in others) >= min(f.stat().st_mtime for f in mine):
        return ": they come from different runs; compare the dumps of one run"
    return (f": {_names(others)} {'is' if len(others) == 1 else 'are'} older than the {len(mine)} "
            f"dumps of a world of {newest}, left by an earlier run in this folder; delete "
            f"{'it' if len(others) == 1 else 'them'}")


_FIELDS = {"run": str, "rank": int, "world": int, "entries": list}
_ENTRY = ("seq", "op", "sizes", "dtypes", "where")


def _load(path: Path) -> dict:
    """One dump, checked: a JSON object with a run id, a rank, a world size (at least 1) and a list
    of entries, each with a whole ``seq`` and an ``op``, ``sizes``, ``dtypes`` and ``where``. A file
    that is anything else is one sentence naming it."""
    redo = "delete it, or run again so that its rank dumps it anew"
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise FlightRecorderError(f"{path} is not text (binary or damaged), so not a dump: "
                                  f"{redo}") from None
    if not text.strip():
        raise FlightRecorderError(f"{path} is empty (its rank stopped while it was written?): "
                                  f"{redo}")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise FlightRecorderError(f"{path} is cut short or damaged ({e.msg}, at character "
                                  f"{e.pos}), so not a whole dump: {redo}") from None
    if not isinstance(d, dict):
        raise FlightRecorderError(f"{path} holds a JSON {type(d).__name__}, not a dump (an object "
                                  f"of run, rank, world and entries): {redo}")
    for key, kind in _FIELDS.items():
        if key not in d:
            raise FlightRecorderError(f"{path} has no {key!r}, so it is not a dump written by "
                                      f"dump(): {redo}")
        wrong = not isinstance(d[key], kind) or isinstance(d[key], bool)
        if wrong or (key == "world" and d[key] < 1):
            raise FlightRecorderError(f"{path} has {key} = {d[key]!r:.40}, not a "
                                      f"{'positive ' * (key == 'world')}{kind.__name__}: {redo}")
    for i, e in enumerate(d["entries"]):
        lacks = [k for k in _ENTRY if k not in e] if isinstance(e, dict) else list(_ENTRY)
        if lacks:
            raise FlightRecorderError(f"{path} has an entry (number {i}) without "
                                      f"{', '.join(lacks)}: {redo}")
        if not isinstance(e["seq"], int) or isinstance(e["seq"], bool) or e["seq"] < 0:
            raise FlightRecorderError(f"{path} has an entry (number {i}) whose seq is "
                                      f"{e['seq']!r:.20}, not a whole number: {redo}")
    return d


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
