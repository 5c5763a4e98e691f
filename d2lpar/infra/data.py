"""Data: splitting a batch over devices, and data sets that need no download.

``split_sizes(b, n)`` cuts a batch of b examples into n parts whose sizes differ by at most one
(the first ``b % n`` parts get the extra example). ``split_sizes(b, weights=...)`` cuts it in
proportion to the weights instead (a faster GPU gets more), rounding by largest remainder so the
sizes still add up to b. ``split_batch`` moves each part to its device; unlike d2l's it works on
CPU devices, real or simulated, and accepts batches that do not divide evenly.

``load_digits`` reads real handwritten digits that ship inside the package; ``fashion_mnist`` reads
Fashion-MNIST through torchvision from files already on disk, and never downloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

__all__ = ["even_sizes", "chunk_bounds", "split_sizes", "split_batch", "load_digits",
           "fashion_mnist", "load_data"]


def even_sizes(total: int, n: int) -> list[int]:
    """The course's one cutting rule: n parts whose sizes differ by at most one, the first larger.

    Parts may be empty when ``total < n`` (a ring cuts a short tensor this way); ``split_sizes``
    refuses that for batches, where every device needs at least one example.
    """
    if n < 1:
        raise ValueError(f"cannot cut {total} elements into {n} parts: use n >= 1")
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def chunk_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the n parts of ``even_sizes(total, n)``."""
    bounds, start = [], 0
    for size in even_sizes(total, n):
        bounds.append((start, start + size))
        start += size
    return bounds


def split_sizes(batch_size: int, n: int | None = None, *,
                weights: Sequence[float] | None = None) -> list[int]:
    """Sizes of the parts of a batch: n near-equal parts, or one part per weight, in proportion."""
    if weights is None:
        if n is None or n < 1:
            raise ValueError(f"cannot split a batch into {n!r} parts: give n >= 1")
        if batch_size < n:
            raise ValueError(f"a batch of {batch_size} cannot be split over {n} devices (each "
                             f"needs at least one example): use a batch of at least {n}, or fewer "
                             f"devices")
        return even_sizes(batch_size, n)
    elif n is not None and n != len(weights):
        raise ValueError(f"n={n} but {len(weights)} weights were given: give one weight per device")
    n = len(weights)
    if n < 1 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights {list(weights)} must be non-negative with a positive sum")
    if batch_size < n:
        raise ValueError(f"a batch of {batch_size} cannot be split over {n} devices (each needs at "
                         f"least one example): use a batch of at least {n}, or fewer devices")
    total = float(sum(weights))
    exact = [batch_size * w / total for w in weights]
    sizes = [int(e) for e in exact]
    # Largest remainder first; ties go to the earlier device, so equal weights give the rule above.
    order = sorted(range(n), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in order[: batch_size - sum(sizes)]:
        sizes[i] += 1
    if 0 in sizes:
        raise ValueError(f"weights {list(weights)} leave a device with no examples out of "
                         f"{batch_size}: use a larger batch or less uneven weights")
    return sizes


def split_batch(X: torch.Tensor, y: torch.Tensor | None, devices: Sequence[torch.device],
                weights: Sequence[float] | None = None, sizes: Sequence[int] | None = None):
    """Cut X (and y) along dimension 0, one part per device, and move each part to its device.

    Parts follow ``sizes`` if given, else ``split_sizes`` (even, or in proportion to ``weights``).
    Returns ``[X_0, X_1, ...]`` when y is None, else ``([X_0, ...], [y_0, ...])``.
    """
    if y is not None and len(X) != len(y):
        raise ValueError(f"X has {len(X)} examples but y has {len(y)}: they must match")
    if sizes is None:
        sizes = split_sizes(len(X), len(devices), weights=weights)
    sizes = list(sizes)
    if len(sizes) != len(devices) or sum(sizes) != len(X) or min(sizes) < 0:
        raise ValueError(f"sizes {sizes} must be one non-negative size per device ({len(devices)}) "
                         f"adding up to the batch ({len(X)})")
    xs = [part.to(dev) for part, dev in zip(torch.split(X, sizes), devices)]
    if y is None:
        return xs
    ys = [part.to(dev) for part, dev in zip(torch.split(y, sizes), devices)]
    return xs, ys


# ------------------------------------------------------------------------------------ datasets

_DIGITS = Path(__file__).parents[1] / "datasets" / "digits.csv.gz"


def load_digits(size: int = 28, train_fraction: float = 0.8, seed: int = 0):
    """Real handwritten digits that ship with the course: ``(train, test)`` TensorDatasets.

    Images are 1 x size x size floats in [0, 1] (8 x 8 originals, resized bilinearly so that LeNet's
    28 x 28 input fits); labels are 0..9. The split is a fixed shuffle, the same on every machine.
    """
    import gzip

    import numpy as np
    from torch.nn import functional as F
    from torch.utils.data import TensorDataset

    with gzip.open(_DIGITS, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    X = torch.from_numpy(table[:, :64]).view(-1, 1, 8, 8) / 16.0
    y = torch.from_numpy(table[:, 64]).long()
    if size != 8:
        X = F.interpolate(X, size=(size, size), mode="bilinear", align_corners=False)
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    cut = int(train_fraction * len(X))
    train, test = order[:cut], order[cut:]
    return TensorDataset(X[train], y[train]), TensorDataset(X[test], y[test])


def fashion_mnist(root: str, train: bool = True, resize: int | None = None):
    """Fashion-MNIST through torchvision, from files already on disk (nothing is downloaded).

    ``root`` is the folder that holds ``FashionMNIST/raw/`` (d2l's default is ``../data``). When the
    files are missing the error says how to get them.
    """
    import os

    import torchvision
    from torchvision import transforms

    steps = [transforms.ToTensor()]
    if resize:
        steps.insert(0, transforms.Resize(resize))
    raw = os.path.join(root, "FashionMNIST", "raw")
    try:
        return torchvision.datasets.FashionMNIST(root=root, train=train, download=False,
                                                 transform=transforms.Compose(steps))
    except RuntimeError as e:
        raise FileNotFoundError(
            f"Fashion-MNIST is not in {raw}: download it once where there is a network, with "
            f"torchvision.datasets.FashionMNIST({root!r}, download=True), or use load_digits(), "
            "which ships with the course") from e


def load_data(name: str = "digits", batch_size: int = 64, root: str = "../data",
              resize: int | None = None, num_workers: int = 0):
    """``(train_loader, test_loader)`` for 'digits' (ships with the course) or 'fashion_mnist'."""
    from torch.utils.data import DataLoader

    if name == "digits":
        train, test = load_digits(size=resize or 28)
    elif name == "fashion_mnist":
        train, test = fashion_mnist(root, True, resize), fashion_mnist(root, False, resize)
    else:
        raise ValueError(f"unknown data set {name!r}: use 'digits' or 'fashion_mnist'")
    return (DataLoader(train, batch_size, shuffle=True, num_workers=num_workers,
                       generator=torch.Generator().manual_seed(0)),
            DataLoader(test, batch_size, shuffle=False, num_workers=num_workers))
