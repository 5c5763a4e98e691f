"""Small models the course trains: LeNet, an MLP and a small ResNet.

They are small on purpose: every notebook must execute in seconds on a 2-core CPU. Each builder takes
a seed so that a parallel run and its single-device baseline start from the same parameters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["lenet", "mlp", "small_resnet", "count_parameters"]


def _seeded(seed: int | None):
    if seed is not None:
        torch.manual_seed(seed)


def lenet(num_classes: int = 10, seed: int | None = 0) -> nn.Sequential:
    """LeNet-5 as in d2l (sigmoid replaced by ReLU, max pooling), for 1 x 28 x 28 images."""
    _seeded(seed)
    return nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, num_classes))


def mlp(sizes: tuple[int, ...] = (784, 256, 256, 10), seed: int | None = 0) -> nn.Sequential:
    """Linear layers with ReLU between them; flattens its input first."""
    _seeded(seed)
    layers: list[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, stride=stride)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(cout), nn.BatchNorm2d(cout)
        self.skip = nn.Conv2d(cin, cout, 1, stride=stride) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (self.skip(x) if self.skip is not None else x))


def small_resnet(num_classes: int = 10, in_channels: int = 1, width: int = 16,
                 seed: int | None = 0) -> nn.Sequential:
    """A ResNet with three stages of one residual block each (d2l's resnet18, shrunk)."""
    _seeded(seed)
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        _Residual(width, width), _Residual(width, 2 * width, 2), _Residual(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
