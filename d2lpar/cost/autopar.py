"""Automatic parallelism: a dependency graph, its independent parts, and a list scheduler.

A step of training is a graph of operations; an edge u -> v means v reads what u wrote. Two
operations joined by no path are *independent*: they may run at the same time on different devices,
or on a device and a copy link. MXNet's dependency engine runs operations from such a graph as
soon as their inputs are ready; compilers (XLA with GSPMD, ``jax.jit`` with shardings, Alpa) also
*place* them on devices. Eager PyTorch does neither: it runs operations in the order Python issues
them, on the device the user put their inputs on. This module is the course's model of the
automatic kind.

* ``forward_graph(model, x)`` traces a model with ``torch.fx`` and costs each operation in FLOPs
  (2 * out * in for a linear layer, one per output element for element-wise operations).
* ``data_parallel_graph`` builds the classic picture: a host (the CPU) holds the batch, each device
  gets its slice, runs forward and backward, and sends each layer's gradient back as soon as the
  backward pass has produced it; the host sums and updates.
* ``independent_parts(graph)`` removes the operations every path goes through and returns the
  connected pieces that are left: the parts that can run side by side.
* ``list_schedule(graph, devices)`` repeatedly starts, among the operations whose inputs are
  ready, the one that can start first, where it finishes first (a fixed resource if it has one;
  else the device with the earliest finish, paying bytes / bandwidth for inputs that live
  elsewhere). Ties in the start time go to the highest *upward rank* (the longest path from the
  operation to the end). The makespan is at least max(critical path, total work / devices).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from d2lpar.infra.timing import Timeline

__all__ = ["Op", "Graph", "forward_graph", "data_parallel_graph", "independent_parts",
           "list_schedule", "draw_graph"]


@dataclass
class Op:
    name: str
    flops: float = 0.0           # compute work (FLOPs)
    nbytes: float = 0.0          # size of the result (a copy moves this many bytes)
    deps: list[str] = field(default_factory=list)
    resource: str | None = None  # fixed device or link; None: the scheduler chooses a device
    kind: str = "compute"        # "compute" or "copy"
    params: int = 0              # parameters of the layer (data parallelism sends its gradient)
    label: str = "forward"       # the colour on a timeline: forward, backward, copy, update


class Graph:
    """Operations in insertion order (which must be a topological order)."""

    def __init__(self):
        self.ops: dict[str, Op] = {}

    def add(self, name: str, deps=(), **kw) -> Op:
        if name in self.ops:
            raise ValueError(f"operation {name!r} is already in the graph: give it another name")
        missing = [d for d in deps if d not in self.ops]
        if missing:
            raise ValueError(f"{name!r} depends on {missing}, which are not in the graph yet: add "
                             "operations after the ones they read")
        self.ops[name] = op = Op(name, deps=list(deps), **kw)
        return op

    def users(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.ops}
        for op in self.ops.values():
            for d in op.deps:
                out[d].append(op.name)
        return out

    def ancestors(self, name: str) -> set[str]:
        seen, todo = set(), list(self.ops[name].deps)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n); todo.extend(self.ops[n].deps)
        return seen

    def independent(self, a: str, b: str) -> bool:
        """True when no path joins a and b: they may run at the same time."""
        return a != b and a not in self.ancestors(b) and b not in self.ancestors(a)

    def critical_path(self, duration) -> float:
        finish: dict[str, float] = {}
        for op in self.ops.values():
            finish[op.name] = max((finish[d] for d in op.deps), default=0.0) + duration(op)
        return max(finish.values(), default=0.0)

    def __len__(self) -> int:
        return len(self.ops)


def _flops(node, module, shape) -> float:
    numel = 1
    for s in shape:
        numel *= s
    if isinstance(module, nn.Linear):
        return 2.0 * numel * module.in_features
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return 2.0 * numel * module.in_channels // module.groups * kh * kw
    return 0.0 if node.op == "call_module" and isinstance(module, nn.Flatten) else float(numel)


def forward_graph(model: nn.Module, x: torch.Tensor, suffix: str = "", resource: str | None = None,
                  graph: Graph | None = None, input_op: str | None = None) -> Graph:
    """The forward pass of ``model`` on ``x`` as a Graph (names get ``suffix``; the input is
    ``input_op`` when given, else a zero-cost op ``input``)."""
    from torch.fx import symbolic_trace
    from torch.fx.passes.shape_prop import ShapeProp
    gm = symbolic_trace(model)
    ShapeProp(gm).propagate(x)
    graph = graph if graph is not None else Graph()
    names: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            names[node.name] = input_op or graph.add("input" + suffix, resource=resource,
                                                    nbytes=x.numel() * x.element_size()).name
        elif node.op == "output":
            continue
        else:
            meta = node.meta["tensor_meta"]
            module = gm.get_submodule(node.target) if node.op == "call_module" else None
            deps = [names[a.name] for a in node.all_input_nodes]
            nbytes = torch.Size(meta.shape).numel() * meta.dtype.itemsize
            params = sum(p.numel() for p in module.parameters()) if module is not None else 0
            name = node.name
            if module is not None:
                target = str(node.target)
                name = f"{type(module).__name__.lower()}{target}" if target.isdigit() else target
            names[node.name] = graph.add(name + suffix, deps, nbytes=nbytes, params=params,
                                         flops=_flops(node, module, meta.shape),
                                         resource=resource).name
    return graph


def data_parallel_graph(model: nn.Module, x: torch.Tensor, devices=("gpu0", "gpu1"),
                        host: str = "cpu") -> Graph:
    """One data-parallel training step of ``model`` on batch ``x`` over a host and ``devices``."""
    n, g = len(devices), Graph()
    g.add("load batch", resource=host, nbytes=x.numel() * x.element_size(), label="load")
    shard = x[: max(1, len(x) // n)]
    grads: dict[str, list[str]] = {}
    for d in devices:
        link = f"{host}<->{d}"
        copy = g.add(f"copy x->{d}", ["load batch"], nbytes=shard.numel() * shard.element_size(),
                     resource=link, kind="copy", label="copy").name
        before = len(g)
        forward_graph(model, shard, f"@{d}", d, g, input_op=copy)
        fwd = list(g.ops.values())[before:]
        last = g.add(f"loss@{d}", [fwd[-1].name], flops=fwd[-1].nbytes / 4, resource=d,
                     label="loss").name
        back: dict[str, str] = {}
        for op in reversed(fwd):  # backward: each op after its users' backward
            users = [u for u in g.users()[op.name] if u in back] or [last]
            deps = [back[u] if u in back else u for u in users] + [op.name]
            back[op.name] = g.add(f"grad {op.name}", deps, flops=2 * op.flops, resource=d,
                                  label="backward").name
            if op.params:
                layer = op.name.split("@")[0]
                grads.setdefault(layer, []).append(g.add(
                    f"copy grad {layer} {d}->{host}", [back[op.name]], nbytes=4 * op.params,
                    resource=link, kind="copy", label="copy").name)
    for layer, copies in grads.items():
        g.add(f"sum grads {layer}", copies, flops=n * g.ops[copies[0]].nbytes / 4, resource=host,
              label="sum + update")
        g.add(f"update {layer}", [f"sum grads {layer}"], flops=2 * g.ops[copies[0]].nbytes / 4,
              resource=host, label="sum + update")
    return g


def independent_parts(graph: Graph) -> list[list[str]]:
    """Groups of operations that can run side by side: remove every operation that is ordered
    with respect to all others (every path goes through it), return the connected pieces left."""
    anc = {n: graph.ancestors(n) for n in graph.ops}
    names = list(graph.ops)
    ordered_with_all = {a for a in names
                        if all(b == a or b in anc[a] or a in anc[b] for b in names)}
    rest = [n for n in names if n not in ordered_with_all]
    parent = {n: n for n in rest}

    def find(n):
        while parent[n] != n:
            parent[n] = parent[parent[n]]; n = parent[n]
        return n

    for n in rest:
        for d in graph.ops[n].deps:
            if d in parent:
                parent[find(n)] = find(d)
    parts: dict[str, list[str]] = {}
    for n in rest:
        parts.setdefault(find(n), []).append(n)
    return list(parts.values())


def list_schedule(graph: Graph, devices, speed: float | dict = 1e9, bandwidth: float = 1e9,
                  placement: dict | None = None) -> tuple[Timeline, dict[str, str]]:
    """Schedule ``graph`` (durations: FLOPs / speed, bytes / bandwidth); return its Timeline (in
    seconds from 0) and where each operation ran. Unplaced compute ops go to one of ``devices``."""
    speeds = speed if isinstance(speed, dict) else {d: speed for d in devices}
    placement = dict(placement or {})

    def duration(op: Op, where: str) -> float:
        return op.nbytes / bandwidth if op.kind == "copy" else op.flops / speeds.get(where, min(
            speeds.values()))

    users = graph.users()
    rank: dict[str, float] = {}
    for op in reversed(list(graph.ops.values())):  # upward rank, with the fastest device's time
        rank[op.name] = duration(op, max(speeds, key=speeds.get)) + max(
            (rank[u] for u in users[op.name]), default=0.0)
    free: dict[str, float] = {}
    finish: dict[str, float] = {}
    where: dict[str, str] = {}
    timeline = Timeline()
    waiting = {n: len(op.deps) for n, op in graph.ops.items()}
    ready = [n for n, k in waiting.items() if k == 0]
    def earliest(name: str) -> tuple[str, float, float]:
        op = graph.ops[name]
        fixed = op.resource or placement.get(name)
        best = None
        for dev in [fixed] if fixed else list(devices):
            inputs = max((finish[d] + (graph.ops[d].nbytes / bandwidth  # implicit transfer
                                       if not fixed and where[d] != dev and graph.ops[d].kind !=
                                       "copy" else 0.0) for d in op.deps), default=0.0)
            start = max(inputs, free.get(dev, 0.0))
            if best is None or start + duration(op, dev) < best[2]:
                best = (dev, start, start + duration(op, dev))
        return best

    while ready:  # start whatever can start first; among equal starts, the highest upward rank
        options = {n: earliest(n) for n in ready}
        name = min(ready, key=lambda n: (options[n][1], -rank[n]))
        ready.remove(name)
        dev, start, end = options[name]
        free[dev], finish[name], where[name] = end, end, dev
        if end > start:
            timeline.add(dev, graph.ops[name].label, start, end)
        for u in users[name]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    return timeline, where


def draw_graph(graph: Graph, where: dict[str, str] | None = None, ax=None, figsize=(8, 3),
               colors: dict[str, str] | None = None, names: bool = True):
    """Draw the graph left to right by depth: one row per device or link, each operation coloured
    by its ``label`` (forward, backward, copy, ...), circles for compute and squares for copies.

    ``colors`` maps labels to colours; pass ``label_colors(s.label for s in timeline.spans)`` to use
    the colours ``plot_timeline`` gives the same labels. ``names`` writes each operation's name.
    """
    import matplotlib.pyplot as plt
    from d2lpar.infra.plot import label_colors
    depth: dict[str, int] = {}
    for op in graph.ops.values():
        depth[op.name] = max((depth[d] + 1 for d in op.deps), default=0)
    place = where or {n: op.resource or "?" for n, op in graph.ops.items()}
    lanes = list(dict.fromkeys(place[n] for n in graph.ops))  # one row per device or link
    colors = dict(colors or label_colors(op.label for op in graph.ops.values()))
    taken: dict[tuple[int, int], int] = {}
    pos = {}
    for n in graph.ops:
        cell = (depth[n], lanes.index(place[n]))
        k = taken[cell] = taken.get(cell, -1) + 1
        pos[n] = (depth[n] + 0.25 * k, -cell[1] - 0.25 * k)
    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    for op in graph.ops.values():
        for d in op.deps:
            ax.annotate("", pos[op.name], pos[d], arrowprops=dict(arrowstyle="->", lw=0.5,
                                                                   color="#888888"))
    for n, (px, py) in pos.items():
        op = graph.ops[n]
        ax.scatter(px, py, s=60, color=colors.get(op.label, "#BBBBBB"), zorder=3,
                   marker="s" if op.kind == "copy" else "o")
        if names:
            ax.annotate(n, (px, py), xytext=(0, 6), textcoords="offset points", ha="center",
                        fontsize=6, rotation=30)
    used = list(dict.fromkeys(op.label for op in graph.ops.values()))
    kinds = list(dict.fromkeys(op.kind for op in graph.ops.values()))
    handles = [plt.Line2D([], [], marker="o", ls="", color=colors.get(lab, "#BBBBBB"))
               for lab in used]
    handles += [plt.Line2D([], [], marker="s" if k == "copy" else "o", ls="", mfc="none",
                           color="#555555") for k in kinds]
    ax.legend(handles, used + [f"shape: {k}" for k in kinds], loc="upper left",
              bbox_to_anchor=(1.01, 1), frameon=False, fontsize="small")
    ax.set_xlabel("depth (longest chain of inputs)")
    ax.set_yticks([-i for i in range(len(lanes))], lanes, fontsize="small")
    ax.margins(y=0.25)
    ax.figure.tight_layout()
    return ax
