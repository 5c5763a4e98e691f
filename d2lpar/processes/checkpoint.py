"""Checkpoints that survive a crash while saving, and that load safely.

``torch.save(state, "last.pt")`` truncates ``last.pt`` first and then writes it: a process killed in
between (out of memory, a pre-empted node, a SIGKILL from the scheduler) leaves a file that no longer
loads, and the previous good checkpoint is gone with it. ``save`` writes to a temporary file in the
same folder, flushes it to disk (``fsync``), then renames it over the old one with ``os.replace``.
A rename within one file system is atomic: a reader sees the old file or the new one, never half of
one. So at every instant there is one complete checkpoint on disk.

``load`` uses ``torch.load(..., weights_only=True)``, which refuses to run arbitrary pickled code
(a checkpoint is a file from somewhere; unpickling it could run anything), and ``map_location`` so a
checkpoint written on ``cuda:0`` loads on the CPU or on another rank's GPU. ``restore`` compares the
parameter names and shapes before loading, and a checkpoint of another model is a clear error.

With DistributedDataParallel, save ``model.module.state_dict()`` (``training_state`` unwraps for you)
from rank 0 only, and let the other ranks wait at a barrier.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointError", "save", "load", "training_state", "restore", "resume", "unwrap"]

FORMAT = "d2lpar-training-state-1"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or belongs to another model."""


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside its wrappers (else the model itself).

    DistributedDataParallel, DataParallel and the course's simulated and balanced variants all keep
    the wrapped model in ``.module`` (hence the ``module.`` prefix in their state dicts); every such
    layer is peeled. (A model of your own that names a submodule ``module`` would be peeled too.)
    """
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` to ``path`` atomically: temp file, flush, fsync, ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a save that was killed
        try:
            stale.unlink()
        except OSError:
            pass
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Load a checkpoint with ``weights_only=True`` onto ``map_location`` (a device, or a mapping)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: check the path, or start from scratch")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError) as e:
        raise CheckpointError(f"{path} is not a loadable checkpoint ({_why(e)}). It may be truncated "
                              "by a crash during a non-atomic save, or hold objects that "
                              "weights_only=True refuses: save it again with "
                              "d2lpar.processes.checkpoint.save") from None


def _why(e: Exception) -> str:
    """torch's reason, without its advice to retry with ``weights_only=False`` (which would run any
    code the file holds: not advice to pass on for a file that is damaged or of unknown origin)."""
    text = str(e).strip()
    if "Weights only load failed" not in text:
        first = text.splitlines()[0] if text else type(e).__name__
        return first.split(". ")[0].rstrip(".")  # torch's first sentence; the rest is advice
    advice = re.compile(r"weights_only|Weights only load failed|Check the documentation|Please file an "
                        r"issue|trust|^\s*\(\d\)", re.I)
    lines = [line.split(" Please use")[0].replace("WeightsUnpickler error:", "").strip()
             for line in text.splitlines()]
    reasons = [line for line in lines if line and not advice.search(line)]
    reason = reasons[0].rstrip(".") if reasons else "an object it does not load"
    return f"the unpickler refused it: {reason}"


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   epoch: int = 0, **extra: Any) -> dict[str, Any]:
    """Everything needed to resume: model (unwrapped), optimizer, the epoch just finished, extras."""
    state = {"format": FORMAT, "epoch": int(epoch), "model": unwrap(model).state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    state.update(extra)
    return state


def _compare(saved: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    """Differences between a saved state dict and a model, in words (empty when they match)."""
    wanted = unwrap(model).state_dict()
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if k not in wanted]
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(wanted[k].shape)}"
              for k in wanted if k in saved and hasattr(saved[k], "shape")
              and saved[k].shape != wanted[k].shape]
    problems = []
    if any(k.startswith("module.") for k in unexpected):
        problems.append("the checkpoint's names start with 'module.': it was saved from the DDP "
                        "wrapper; save model.module.state_dict() instead (or strip the prefix)")
    if missing:
        problems.append(f"{len(missing)} missing, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected, e.g. {unexpected[:3]}")
    if shapes:
        problems.append(f"{len(shapes)} of other shapes, e.g. {shapes[:2]}")
    return problems


def restore(state: dict[str, Any], model: nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load a ``training_state`` dict (or a bare state dict) into model and optimizer; return its epoch.

    Raises CheckpointError, naming what differs, when the checkpoint belongs to another model.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"expected a dict from training_state, got {type(state).__name__}")
    weights = state["model"] if state.get("format") == FORMAT else state
    problems = _compare(weights, model)
    if problems:
        raise CheckpointError("this checkpoint is from another model: parameter names or shapes "
                              "differ (" + "; ".join(problems) + "). Build the same model that was "
                              "saved, or start from scratch with a new checkpoint folder")
    unwrap(model).load_state_dict(weights)
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    return int(state.get("epoch", -1))


def resume(path: str | os.PathLike, model: nn.Module,
           optimizer: torch.optim.Optimizer | None = None, map_location: Any = "cpu"
           ) -> tuple[int, dict[str, Any] | None]:
    """Restore from ``path`` if it exists: return (first epoch to run, the state); (0, None) if not."""
    if not Path(path).is_file():
        return 0, None
    state = load(path, map_location=map_location)
    return restore(state, model, optimizer) + 1, state
