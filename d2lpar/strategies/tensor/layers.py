"""Column- and row-parallel layers, and the source notes' channel split of a convolution.

``ColumnParallelLinear`` holds rows r of W (out/t output features) and needs the whole input;
``RowParallelLinear`` holds columns r (in/t input features) and its partial outputs are summed. Put
one after the other and the split output of the first is the split input of the second: one
all-reduce per pair (Megatron), or a reduce-scatter + all-gather pair with sequence parallelism.

A convolution is a linear map over channels at every pixel, so the same two cuts apply:
``OutChannelSplitConv2d`` computes out/t channels and all-gathers them (the two-GPU AlexNet: every
rank then holds the whole output, and the backward pass all-reduces the input gradient, because every
rank used the whole input); ``InChannelSplitConv2d`` convolves in/t input channels and all-reduces
the partial sums. Each layer takes ``full=``, the single-device layer whose part this rank keeps
(default: a new one, made on the group's first rank and broadcast), and ``group=`` (default: the world).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from d2lpar.strategies.tensor.mappings import (all_gather_seq, check_same_input, check_same_shape, copy_to_region,
                                               gather_from_region, reduce_from_region,
                                               reduce_scatter_seq, require_divisible,
                                               scatter_to_region, shard, tp_world)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "OutChannelSplitConv2d",
           "InChannelSplitConv2d"]


# ----------------------------------------------------------------------------------- the layers

def _init_like(module: nn.Module, full: nn.Module | None, make) -> None:
    """Take this rank's part of ``full`` (the single-device layer); with none, of ``make()``.

    A layer made here is broadcast from the group's first rank, so every rank cuts the same one.
    """
    fresh = full is None
    full = make() if fresh else full
    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            whole = getattr(full, name).detach().clone()
            if fresh and dist.get_world_size(module.group) > 1:
                dist.broadcast(whole, dist.get_global_rank(module.group or dist.group.WORLD, 0),
                               group=module.group)
            p.copy_(whole if p.tp_dim is None else shard(whole, p.tp_dim, module.group))


class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r: rank r computes out/t output features from the whole input.

    input_comm: 'copy' (f: the input is replicated), 'gather' (sequence parallel: all-gather the
    sequence shards along dim 1 first) or None (the caller already did it, for layers sharing one f).
    gather_output: all-gather the outputs (the source notes' channel split) instead of leaving
    them split.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 input_comm: str | None = "copy", gather_output: bool = False,
                 full: nn.Linear | None = None):
        super().__init__()
        rank, size = tp_world(group)
        require_divisible("out_features", out_features, size)
        check_same_shape("ColumnParallelLinear", (in_features, out_features, bias), group)
        if input_comm not in ("copy", "gather", None):
            raise ValueError(f"input_comm={input_comm!r}: use 'copy', 'gather' or None")
        self.group, self.input_comm, self.gather_output = group, input_comm, gather_output
        self._input_checked = False
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features // size, in_features))
        self.weight.tp_dim = 0
        self.bias = nn.Parameter(torch.empty(out_features // size)) if bias else None
        if bias:
            self.bias.tp_dim = 0
        _init_like(self, full, lambda: nn.Linear(in_features, out_features, bias=bias))

    def forward(self, x):
        if not self._input_checked:   # once: ranks fed different batches would abort in a collective
            check_same_input("ColumnParallelLinear", x, self.group)
            self._input_checked = True
        if self.input_comm == "copy":
            x = copy_to_region(x, self.group)
        elif self.input_comm == "gather":
            x = all_gather_seq(x, 1, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, -1, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b: rank r holds in/t input columns; partial outputs are summed.

    output_comm: 'reduce' (g: all-reduce), 'scatter' (sequence parallel: reduce-scatter along dim 1,
    the bias then has a partial gradient per rank) or None (the caller sums).
    split_input: the input is replicated; keep this rank's in/t features first.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 output_comm: str | None = "reduce", split_input: bool = False,
                 full: nn.Linear | None = None):
        super().__init__()
        rank, size = tp_world(group)
        require_divisible("in_features", in_features, size)
        check_same_shape("RowParallelLinear", (in_features, out_features, bias), group)
        if output_comm not in ("reduce", "scatter", None):
            raise ValueError(f"output_comm={output_comm!r}: use 'reduce', 'scatter' or None")
        self.group, self.output_comm, self.split_input = group, output_comm, split_input
        self._input_checked = False
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // size))
        self.weight.tp_dim = 1
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if bias:
            self.bias.tp_dim = None  # added once, after the sum
            self.bias.sequence_parallel = output_comm == "scatter"
        _init_like(self, full, lambda: nn.Linear(in_features, out_features, bias=bias))

    def forward(self, x):
        if not self._input_checked:
            check_same_input("RowParallelLinear", x, self.group)
            self._input_checked = True
        if self.split_input:
            x = scatter_to_region(x, -1, self.group)
        y = F.linear(x, self.weight)
        if self.output_comm == "reduce":
            y = reduce_from_region(y, self.group)
        elif self.output_comm == "scatter":
            y = reduce_scatter_seq(y, 1, self.group)
        return y if self.bias is None else y + self.bias


class OutChannelSplitConv2d(nn.Module):
    """The source notes' channel parallelism: rank r computes out/t channels, then all ranks
    gather them."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, padding: int = 0,
                 group=None, full: nn.Conv2d | None = None):
        super().__init__()
        rank, size = tp_world(group)
        require_divisible("out_channels", out_channels, size)
        check_same_shape("OutChannelSplitConv2d", (in_channels, out_channels, kernel_size, padding),
                         group)
        self.group, self.padding, self._input_checked = group, padding, False
        self.weight = nn.Parameter(torch.empty(out_channels // size, in_channels, kernel_size,
                                               kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels // size))
        self.weight.tp_dim = self.bias.tp_dim = 0
        _init_like(self, full, 
                   lambda: nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding))

    def forward(self, x):
        if not self._input_checked:
            check_same_input("OutChannelSplitConv2d", x, self.group)
            self._input_checked = True
        y = F.conv2d(copy_to_region(x, self.group), self.weight, self.bias, padding=self.padding)
        self.local = y.detach()  # this rank's channels, as they enter the all-gather
        return gather_from_region(y, 1, self.group)


class InChannelSplitConv2d(nn.Module):
    """Rank r convolves its in/t input channels; the partial outputs are summed (an all-reduce)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, padding: int = 0,
                 group=None, split_input: bool = True, full: nn.Conv2d | None = None):
        super().__init__()
        rank, size = tp_world(group)
        require_divisible("in_channels", in_channels, size)
        check_same_shape("InChannelSplitConv2d", (in_channels, out_channels, kernel_size, padding),
                         group)
        self.group, self.padding, self.split_input = group, padding, split_input
        self._input_checked = False
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // size, kernel_size,
                                               kernel_size))
        self.bias = nn.Parameter(torch.empty(out_channels))
        self.weight.tp_dim, self.bias.tp_dim = 1, None
        _init_like(self, full, 
                   lambda: nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding))

    def forward(self, x):
        if not self._input_checked:
            check_same_input("InChannelSplitConv2d", x, self.group)
            self._input_checked = True
        if self.split_input:
            x = scatter_to_region(x, 1, self.group)
        partial = F.conv2d(x, self.weight, padding=self.padding)
        self.local = partial.detach().clone()  # this rank's partial sum, as it enters the all-reduce
        y = reduce_from_region(partial, self.group)
        return y + self.bias.view(1, -1, 1, 1)
