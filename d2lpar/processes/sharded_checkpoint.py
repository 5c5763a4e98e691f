"""Sharded checkpoints: every rank writes its own shards, and any number of ranks reads them back.

``torch.distributed.checkpoint`` (DCP) saves a state dict whose tensors may be DTensors (the shards
FSDP2 keeps): each rank writes only the pieces it holds (``__<rank>_0.distcp``) and the coordinator
writes ``.metadata``, which records for every key its *global* shape and which file holds which
piece. Loading plans from that metadata, not from the layout of the ranks that saved, so a checkpoint
written by 2 ranks loads on 4, or into one plain process (``no_dist=True``): the loader asks each
file for the slices its own shards need. Nothing is gathered to one rank, at saving or at loading.

DCP's own error for a checkpoint saved from another model surfaces deep inside its planner. ``load``
reads the metadata first and names every key that is missing from the checkpoint or has another
shape there, with the keys only the checkpoint has, before any rank reads a byte. A damaged
checkpoint (a ``.metadata`` that cannot be read, a shard file missing or shorter than the metadata
says) is named with its folder and file, rather than as an unpickling or read error from inside DCP.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointMismatch", "CheckpointDamaged", "flatten", "describe", "check_files",
           "mismatches", "save", "load"]


class CheckpointMismatch(ValueError):
    """The checkpoint's keys or shapes do not fit the state dict it was asked to fill."""


class CheckpointDamaged(ValueError):
    """A file of the checkpoint is missing, cut short or unreadable."""


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts (and lists) as one dict with dotted keys, the names DCP gives them."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {prefix: state}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def describe(path: str | Path) -> dict[str, tuple | None]:
    """Key -> global shape of every tensor in a checkpoint (None for other saved objects)."""
    import torch.distributed.checkpoint as dcp
    if not (Path(path) / ".metadata").exists():
        raise FileNotFoundError(f"{path} is not a DCP checkpoint (it has no .metadata): save one with "
                                "d2lpar.processes.sharded_checkpoint.save or dcp.save")
    meta = _metadata(path).state_dict_metadata
    return {k: (tuple(v.size) if hasattr(v, "size") else None) for k, v in meta.items()}


def _metadata(path: str | Path):
    import torch.distributed.checkpoint as dcp
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise CheckpointDamaged(f"the checkpoint {path} is damaged: its file .metadata cannot be read "
                                f"({type(e).__name__}: {str(e)[:200]}). It was not written completely "
                                "or was changed since: save the checkpoint again, or load an older "
                                "one") from None


def check_files(path: str | Path) -> None:
    """Raise CheckpointDamaged naming the first shard file that is missing or shorter than the
    metadata says (each piece is stored at an offset and length in one of the ``.distcp`` files)."""
    need: dict[str, int] = {}
    for info in _metadata(path).storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = Path(path) / name
        if not file.exists():
            raise CheckpointDamaged(f"the checkpoint {path} is damaged: its shard file {name} is "
                                    "missing (every rank that saved wrote one; copy the whole folder)")
        if file.stat().st_size < size:
            raise CheckpointDamaged(f"the checkpoint {path} is damaged: its shard file {name} has "
                                    f"{file.stat().st_size} bytes where the metadata needs {size} (it "
                                    "was cut short while saving or copying): save it again")


def mismatches(state_dict: dict, path: str | Path) -> list[str]:
    """What stops ``state_dict`` from being loaded from ``path``, one line per problem ([] if none).

    Keys only in the checkpoint are listed under the top-level keys of ``state_dict`` only (asking
    for ``{"model": ...}`` does not list the checkpoint's ``optim`` entries).
    """
    saved = describe(path)
    wanted = {k: (tuple(v.shape) if isinstance(v, torch.Tensor) else None)
              for k, v in flatten(state_dict).items()}
    problems = [f"missing from the checkpoint: {k}" for k in wanted if k not in saved]
    problems += [f"shape of {k}: checkpoint {saved[k]}, here {wanted[k]}" for k in wanted
                 if k in saved and wanted[k] is not None and saved[k] != wanted[k]]
    if problems:
        asked = {k.split(".")[0] for k in wanted}  # only under the top-level keys asked for
        extra = sorted(k for k in set(saved) - set(wanted) if k.split(".")[0] in asked)
        if extra:
            problems.append(f"only in the checkpoint: {', '.join(extra[:8])}"
                            + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))
    return problems


def save(state_dict: dict, path: str | Path) -> None:
    """Each rank writes its shards of ``state_dict`` under the folder ``path``."""
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state_dict, checkpoint_id=str(path))


def load(state_dict: dict, path: str | Path, no_dist: bool = False) -> dict:
    """Fill ``state_dict`` in place from ``path`` after checking its keys and shapes; return it.

    no_dist: load in one process without a process group (the whole tensors, from every file).
    Non-tensor values (a step count) are replaced in the dict: read them back from it.
    """
    import torch.distributed.checkpoint as dcp
    problems = mismatches(state_dict, path)
    check_files(path)
    if problems:
        raise CheckpointMismatch(f"the checkpoint {path} does not fit this state dict (was it saved "
                                 "from another model?):\n  " + "\n  ".join(problems))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state_dict, checkpoint_id=str(path), no_dist=no_dist)
    return state_dict
