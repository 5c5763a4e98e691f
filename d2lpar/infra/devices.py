"""Devices, real or simulated.

The course is written for N accelerators, and most readers have none or one. ``get_devices(n)`` hands
out the first n GPUs when there are that many, and otherwise n *simulated* devices on the CPU
(``cpu:0``, ``cpu:1``, ...), saying so once. A simulated device computes correctly (the same numbers as
a GPU, up to floating-point rounding) but shares the CPU's cores and memory with the others, so it
shows correctness, bytes and schedules, not speed-ups.

GPUs are numbered as CUDA numbers them after ``CUDA_VISIBLE_DEVICES``: with ``CUDA_VISIBLE_DEVICES=0,5``
the process sees two GPUs, ``cuda:0`` (physical 0) and ``cuda:1`` (physical 5). Device strings and that
variable are checked here, so that a typo gives an error that says what to do instead of a CUDA
failure deep inside a training step.
"""

from __future__ import annotations

import argparse
import os
import re

import torch

__all__ = [
    "DeviceError", "gpu_count", "try_gpu", "get_devices", "parse_device", "is_simulated",
    "describe", "add_device_args", "devices_from_args",
]


class DeviceError(ValueError):
    """A device was asked for that this machine does not have."""


_announced: set[tuple] = set()


def _say_once(key: tuple, message: str) -> None:
    if key not in _announced:
        _announced.add(key)
        print(message)


def _visible_entries() -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES, or None when it is not set."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return None
    return [e.strip() for e in spec.split(",") if e.strip()]


def gpu_count() -> int:
    """How many CUDA GPUs this process can use, after CUDA_VISIBLE_DEVICES.

    Raises DeviceError when CUDA_VISIBLE_DEVICES names devices that CUDA cannot see (CUDA silently
    stops at the first bad entry, which leaves a job on fewer GPUs than its author meant).
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    entries = _visible_entries()
    if entries and entries[0] != "-1" and len(entries) > count:
        raise DeviceError(
            f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} names {len(entries)} "
            f"device(s) but CUDA can see {count}. List the GPUs with `nvidia-smi -L` and name only "
            "those, or unset CUDA_VISIBLE_DEVICES (set it to '' to hide every GPU and use the CPU).")
    return count


def try_gpu(i: int = 0) -> torch.device:
    """``cuda:i`` if that GPU exists, else the CPU (unlike d2l's, never an index error)."""
    return torch.device("cuda", i) if i < gpu_count() else torch.device("cpu")


def is_simulated(device: torch.device | str) -> bool:
    """A simulated device is a CPU device with an index: ``cpu:0``, ``cpu:1``, ..."""
    device = torch.device(device)
    return device.type == "cpu" and device.index is not None


def get_devices(n: int | None = None, *, simulate: bool = True) -> list[torch.device]:
    """Return n devices: real GPUs when there are n of them, simulated CPU devices otherwise.

    ``n=None`` means every GPU there is, or the one plain CPU when there is none. With
    ``simulate=False`` asking for more GPUs than exist raises DeviceError instead.
    """
    gpus = gpu_count()
    if n is None:
        return [torch.device("cuda", i) for i in range(gpus)] or [torch.device("cpu")]
    if not isinstance(n, int) or n < 1:
        raise DeviceError(f"asked for {n!r} devices; ask for a whole number of at least 1")
    if n <= gpus:
        return [torch.device("cuda", i) for i in range(n)]
    if not simulate:
        raise DeviceError(f"asked for {n} GPUs but this machine has {gpus}: ask for at most {gpus}, "
                          "or pass simulate=True to run on simulated CPU devices")
    devs = "a device" if n == 1 else f"{n} devices"
    names = "cpu:0" if n == 1 else f"cpu:0 .. cpu:{n - 1}"
    _say_once(("simulate", n, gpus),
              f"Asked for {devs}, found {gpus} GPU(s): simulating {devs} on the CPU ({names}).\n"
              f"  Results are exact; timings are not those of {'a GPU' if n == 1 else f'{n} GPUs'}.")
    return [torch.device("cpu", i) for i in range(n)]


_DEVICE_RE = re.compile(r"^(cpu|cuda|mps)(?::(\d+))?$")


def parse_device(spec: str | int | torch.device) -> torch.device:
    """Turn ``'cpu'``, ``'cuda'``, ``'cuda:1'``, ``'mps'`` or ``1`` into a device that exists here."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if isinstance(spec, int):
        spec = f"cuda:{spec}"
    match = _DEVICE_RE.match(str(spec).strip().lower())
    if not match:
        raise DeviceError(f"{spec!r} is not a device: write 'cpu', 'cuda', 'cuda:<index>' or 'mps'")
    kind, index = match.group(1), match.group(2)
    index = None if index is None else int(index)
    if kind == "cuda":
        gpus = gpu_count()
        if gpus == 0:
            raise DeviceError(f"{spec!r} asks for a GPU but this machine has none: use 'cpu', "
                              "or get_devices(n) to simulate n")
        if index is not None and index >= gpus:
            raise DeviceError(f"{spec!r} does not exist: this process sees {gpus} GPU(s), "
                              f"cuda:0 .. cuda:{gpus - 1} (after CUDA_VISIBLE_DEVICES)")
    if kind == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise DeviceError(f"{spec!r}: Apple's MPS backend is not available here; use 'cpu'")
    return torch.device(kind, index) if index is not None else torch.device(kind)


def describe(devices: list[torch.device]) -> str:
    """One line naming the devices and whether they are real or simulated."""
    names = ", ".join(str(d) for d in devices)
    if all(is_simulated(d) for d in devices):
        return f"{len(devices)} simulated device(s) on the CPU: {names}"
    return f"{len(devices)} device(s): {names}"


def add_device_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--devices 0,3`` and ``--cpu`` to a script's argument parser (the source notes'
    template)."""
    group = parser.add_argument_group("devices")
    group.add_argument("--devices", default=None, metavar="IDS",
                       help="comma-separated GPU indices to use, e.g. 0,3 (default: every GPU)")
    group.add_argument("--cpu", action="store_true", help="run on the CPU even if GPUs exist")
    return parser


def devices_from_args(args: argparse.Namespace) -> list[torch.device]:
    """The devices the flags of ``add_device_args`` ask for, checked against this machine."""
    if args.cpu:
        return [torch.device("cpu")]
    if args.devices is None:
        return get_devices()
    try:
        ids = [int(i) for i in str(args.devices).split(",") if i.strip()]
    except ValueError:
        raise DeviceError(f"--devices {args.devices!r}: give GPU indices separated by commas, "
                          "e.g. --devices 0,3") from None
    if not ids:
        raise DeviceError("--devices is empty: give GPU indices such as 0,3, or use --cpu")
    return [parse_device(i) for i in ids]
