"""Run a pipeline schedule on real ranks: activations go forward, gradients come back, by send/recv.

Each rank holds its stages (stage s on rank s % p) and walks its list of actions from
``d2lpar.strategies.pipeline.schedules``:

* ``sF m``: receive micro-batch m's input from stage s-1 (stage 0 slices the batch), run the stage,
  send the output to stage s+1 (the last stage computes the loss instead);
* ``sB m``: receive the gradient of the output from stage s+1 (the last stage starts from its loss),
  run the backward, send the gradient of the input to stage s-1;
* ``sI m`` / ``sW m`` (zero-bubble): the same backward in two passes, the input gradient first (stage
  s-1 waits for it), the weight gradients later. The stage runs layer by layer with the tensors
  between layers detached, so that W computes each layer's weight gradient from the gradient that I
  left at its output, without redoing I's work.

**Loss and gradient scale.** The loss is the mean over the whole batch of B examples. Micro-batch k
has n_k examples and a loss ``loss_fn`` that is a mean over them, so the stage backpropagates
``loss_k * n_k / B``; summed over micro-batches this is the full-batch mean (with equal micro-batches
it is sum_k loss_k / m). Gradients accumulate in ``.grad`` over the micro-batches and equal a single
process's gradient of the full batch: not m times it (dividing by m is what such code forgets).

Messages are ``isend`` (never blocks) and ``irecv`` posted a few actions ahead and waited for when
needed, each with a tag naming (stage, micro-batch, direction), so messages between two ranks can
arrive in any order.
Receive buffers need shapes: ``check_stages`` runs the stages on *meta* tensors in the caller (no
compute, no memory), so a stage whose output does not fit the next stage is reported before any rank
starts, with both stages and both shapes. A rank that raises ends the whole run: the launcher stops
the others (no rank is left in a ``recv``) and raises ``RankFailed`` naming the rank.

``wait={"F": tF, "B": tB, ...}`` makes each action last at least that long (the real computation,
then a sleep for the rest): a stand-in for a device that computes while its CPU thread waits, so that
four ranks on two cores show the timeline four devices would. Messages and their order stay real.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.infra.activations import SavedTensors
from d2lpar.infra.data import chunk_bounds
from d2lpar.infra.partition import balanced_bounds
from d2lpar.infra.timing import Span, Timeline
from d2lpar.processes.launch import launch
from d2lpar.strategies.pipeline.schedules import Schedule, ScheduleError, split_layers, validate
from d2lpar.strategies.pipeline.simulator import action_overhead, idle_fractions, message_latency

__all__ = ["split_model", "split_balanced", "check_stages", "run_schedule", "run_pipeline", "PipelineResult",
           "idle_fractions", "message_latency", "action_overhead"]


def split_model(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into ``stages`` consecutive parts of near-equal layer counts.

    The parts share the model's parameters (no copies)."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        raise TypeError(f"split_model cuts a sequence of layers (nn.Sequential, nn.ModuleList or a "
                        f"list), not a {type(model).__name__}: write the model as "
                        f"nn.Sequential(...) of its layers, or cut it yourself into a list of "
                        f"stages")
    layers = list(model)
    return [nn.Sequential(*layers[a:b]) for a, b in split_layers(len(layers), stages)]


def split_balanced(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut a Sequential into ``stages`` consecutive parts of near-equal *parameter* counts.

    ``split_model`` counts modules, so a wide first layer or a narrow last one makes the stages
    unequal. For Linear layers the multiply-adds per sample equal the weights, so balancing the
    parameters balances the compute. Each cut falls right after a layer with parameters (the
    parameter-free modules before a layer, a ReLU or a Flatten, go with it); among the cuts the
    one whose largest stage is smallest is taken.
    """
    layers = list(model)
    units, current = [], []                 # a unit: parameter-free modules, then one with params
    for layer in layers:
        current.append(layer)
        if any(True for _ in layer.parameters()):
            units.append(current)
            current = []
    if current:                             # trailing parameter-free modules join the last unit
        if units:
            units[-1] += current
        else:
            units.append(current)
    if not 1 <= stages <= len(units):
        raise ScheduleError(f"cannot cut {len(units)} layers with parameters into {stages} stages: "
                            f"use 1 to {len(units)} stages, or split_model")
    weight = [sum(q.numel() for m in unit for q in m.parameters()) for unit in units]
    return [nn.Sequential(*[m for unit in units[a:b] for m in unit])
            for a, b in balanced_bounds(weight, stages)]


def _expects(module: nn.Module) -> str:
    for sub in module.modules():
        for attr in ("in_features", "in_channels", "normalized_shape", "num_features"):
            if hasattr(sub, attr):
                return f"{attr}={getattr(sub, attr)} ({type(sub).__name__})"
    return f"its first layer ({type(module).__name__})"


def _float_dtype(module: nn.Module) -> torch.dtype | None:
    """The floating-point dtype of the module's parameters (None if it has none)."""
    return next((q.dtype for q in module.parameters() if q.is_floating_point()), None)


def check_stages(stages: list[nn.Module], X: torch.Tensor, microbatches: int) -> list[list[tuple]]:
    """Run the stages one after the other on meta tensors; return each stage's output (shape, dtype)
    per micro-batch. A stage that cannot take its predecessor's output (shape or dtype), or that
    returns something other than one tensor, raises ValueError naming the stages."""
    if len(X) < microbatches:
        raise ValueError(f"a batch of {len(X)} cannot be cut into {microbatches} micro-batches: use "
                         f"at most {len(X)} micro-batches or a larger batch")
    wants = _float_dtype(stages[0]) if stages else None
    if wants is not None and X.is_floating_point() and X.dtype != wants:
        raise ValueError(f"the input is {X.dtype}, but stage 0's parameters are {wants}: convert the "
                         f"batches (X.to({wants})) or the model")
    shapes: list[list[tuple]] = [[] for _ in stages]
    sizes = [hi - lo for lo, hi in chunk_bounds(len(X), microbatches)]
    for size in sorted(set(sizes), key=sizes.index):   # at most two sizes: run each once
        h = torch.empty((size,) + tuple(X.shape[1:]), dtype=X.dtype, device="meta")
        for s, stage in enumerate(stages):
            state = {k: torch.empty_like(v, device="meta")
                     for k, v in list(stage.named_parameters()) + list(stage.named_buffers())}
            try:
                out = torch.func.functional_call(stage, state, (h,))
            except Exception as e:
                where = (f"stage {s - 1} outputs shape {tuple(h.shape)}, but stage {s} expects "
                         if s else f"the input has shape {tuple(h.shape)}, but stage 0 expects ")
                raise ValueError(f"{where}{_expects(stage)}: {type(e).__name__}: {e}. Cut the model "
                                 f"so that each stage's output fits the next stage's input") from None
            if not isinstance(out, torch.Tensor):
                raise ValueError(f"stage {s} returns a {type(out).__name__}, but a pipeline stage "
                                 f"sends one tensor to the next: return a single tensor (concatenate "
                                 f"or drop the other outputs)")
            wants = _float_dtype(stages[s + 1]) if s + 1 < len(stages) else None
            if wants is not None and out.is_floating_point() and out.dtype != wants:
                raise ValueError(f"stage {s} outputs {out.dtype}, but stage {s + 1}'s parameters are "
                                 f"{wants}: give every stage the same dtype (model.to({wants}) before "
                                 f"split_model)")
            shapes[s].append((tuple(out.shape), out.dtype))
            h = out
    by_size = [dict(zip(sorted(set(sizes), key=sizes.index), col)) for col in shapes]
    return [[col[n] for n in sizes] for col in by_size]


def _dot(outs, grads) -> torch.Tensor:
    """sum_k <out_k, grad_k>: its gradient with respect to each out_k is exactly grad_k.

    ``torch.autograd.backward(out, grad)`` computes the same, but in torch 2.14 its first call with an
    explicit gradient imports sympy (1.5-4 s per fresh rank here); a scalar's backward does not.
    """
    return sum((o * g).sum() for o, g in zip(outs, grads))


class _Stage:
    """One stage on this rank: its module and what each micro-batch left for its backward."""

    def __init__(self, module: nn.Module, split: bool):
        self.module, self.split = module, split
        self.layers = list(module) if split and isinstance(module, nn.Sequential) else [module]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.saved: dict[int, dict] = {}
        self.tracker = SavedTensors(module)
        self.mb_bytes = 0

    def forward(self, mb: int, x: torch.Tensor, loss_fn=None, target=None, weight: float = 1.0):
        before = self.tracker.current
        with self.tracker:
            if not self.split:
                out = self.module(x)
                loss = loss_fn(out, target) * weight if loss_fn is not None else None
                self.saved[mb] = {"x": x, "out": out if loss is None else loss}
            else:   # layer by layer, detached between layers: I and W can then be run apart
                pieces, h = [], x
                loss_layer = [lambda o: loss_fn(o, target) * weight] if loss_fn else []
                for layer in self.layers + loss_layer:
                    inp = h.detach().requires_grad_(h.requires_grad)
                    h = layer(inp)
                    if h.requires_grad:
                        pieces.append((inp, h))
                out = h if loss_fn is None else None
                loss = h if loss_fn is not None else None
                self.saved[mb] = {"x": x, "pieces": pieces}
        self.mb_bytes = self.mb_bytes or self.tracker.current - before
        return out, loss

    def backward(self, mb: int, grad: torch.Tensor | None, kind: str):
        """B: the whole backward; I: input gradient only; W: weight gradients.
        Returns the gradient of the stage's input (None for W)."""
        saved = self.saved[mb]
        if not self.split:
            out = saved.pop("out")
            if out.requires_grad:   # not when nothing before it has a parameter: nothing to do
                (out if grad is None else _dot([out], [grad])).backward()
            del self.saved[mb]
            return saved["x"].grad
        if kind == "I":
            g, todo = grad, []
            for inp, out in reversed(saved["pieces"]):
                g = torch.ones_like(out) if g is None else g
                todo.append((out, g))
                if not inp.requires_grad:   # the stage's input is the batch: nothing to send back
                    g = None
                    continue
                g = torch.autograd.grad(_dot([out], [g]), inp, retain_graph=True)[0]   # input only
            saved["todo"] = todo
            del saved["pieces"]
            return g
        outs, grads = zip(*self.saved.pop(mb)["todo"]) if saved["todo"] else ((), ())
        if self.params and outs:
            _dot(outs, grads).backward(inputs=self.params)
        return None


def _device_of(module: nn.Module, default: torch.device) -> torch.device:
    """Where the stage lives: its first parameter's or buffer's device (a stage may have neither)."""
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return default


# Receives are posted this many actions ahead: gloo moves a message only once its receive is posted,
# so a receive posted late costs a wake-up of the sender's transport thread (measured: interleaved
# 1F1B, p=2, m=16 idled 0.155 with 1 action ahead, 0.059 with 4, 0.050 with 8; formula 0.030).
# The price is up to this many receive buffers allocated early.
LOOKAHEAD = 8


def run_schedule(schedule: Schedule, modules: dict[int, nn.Module], X: torch.Tensor,
                 y: torch.Tensor, loss_fn, shapes: list[list[tuple]],
                 wait: dict[str, float] | None = None, ranks: list[int] | None = None) -> dict:
    """This rank's part of one training step (inside a launched rank; gradients land in .grad).

    ranks: the global ranks that run the pipeline, pipeline rank i on ``ranks[i]`` (a pipeline
    group of a 3D mesh); default: the world, pipeline rank = global rank.
    Returns this rank's spans, the loss of the micro-batches its last stage saw, and per stage the
    peak bytes of saved activations and the bytes of one micro-batch's activations; and the peak
    of all this rank's stages together (``rank_peak``, sampled after each action).
    """
    p, m, S = schedule.ranks, schedule.microbatches, schedule.stages
    if len(shapes) != S or any(len(col) != m for col in shapes):
        raise ValueError(f"shapes must come from check_stages(stages, X, {m}) for this schedule's "
                         f"{S} stages and {m} micro-batches")
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = list(range(p)) if ranks is None else list(ranks)
    if len(ranks) != p or me not in ranks:
        raise ValueError(f"ranks={ranks}: give the {p} global ranks of this rank's pipeline, "
                         f"this rank ({me}) among them")
    rank = ranks.index(me)   # pipeline rank; messages go to global ranks[...]
    stages = {s: _Stage(modules[s], schedule.split) for s in schedule.stages_of(rank)}
    bounds = chunk_bounds(len(X), m)
    device = _device_of(modules[schedule.stages_of(rank)[0]], X.device)
    local: dict[tuple, torch.Tensor] = {}   # messages between stages on this same rank
    works, spans, loss = [], [], 0.0

    def send(t: torch.Tensor, to_stage: int, tag: int) -> None:
        if schedule.rank_of(to_stage) == rank:
            local[tag] = t
        else:
            dst = ranks[schedule.rank_of(to_stage)]
            works.append((dist.isend(t.contiguous(), dst, tag=tag), t))

    def source(a):
        """(shape, dtype, from stage, tag) of the message action ``a`` waits for, or None."""
        if a.kind == "F" and a.stage > 0:
            return (*shapes[a.stage - 1][a.mb], a.stage - 1, 2 * ((a.stage - 1) * m + a.mb))
        if a.kind in "BI" and a.stage < S - 1:
            return (*shapes[a.stage][a.mb], a.stage + 1, 2 * (a.stage * m + a.mb) + 1)
        return None

    posted: dict[int, tuple] = {}   # receives posted ahead, so data flows as soon as it is sent

    def post(i: int) -> None:
        src = source(order[i]) if i < len(order) and i not in posted else None
        if src is not None and schedule.rank_of(src[2]) != rank:
            buf = torch.empty(src[0], dtype=src[1], device=device)
            posted[i] = (dist.irecv(buf, ranks[schedule.rank_of(src[2])], tag=src[3]), buf)

    def recv(i: int) -> torch.Tensor:
        src = source(order[i])
        if schedule.rank_of(src[2]) == rank:
            return local.pop(src[3])
        post(i)
        work, buf = posted.pop(i)
        work.wait()
        return buf

    order, rank_peak = schedule.order[rank], 0
    for i, a in enumerate(order):
        s, mb, st = a.stage, a.mb, stages[a.stage]
        lo, hi = bounds[mb]
        fwd_tag, bwd_tag = 2 * (s * m + mb), 2 * ((s - 1) * m + mb) + 1
        if a.kind == "F":
            x = X[lo:hi].to(device) if s == 0 else recv(i)
            if s > 0:
                x.requires_grad_()
        elif a.kind in "BI":
            g = None if s == S - 1 else recv(i)
        for ahead in range(i + 1, i + 1 + LOOKAHEAD):
            post(ahead)
        t0 = time.perf_counter()
        if a.kind == "F":
            last = s == S - 1
            out, l = st.forward(mb, x, loss_fn if last else None,
                                y[lo:hi].to(device) if last else None, (hi - lo) / len(X))
        else:
            gx = st.backward(mb, g if a.kind != "W" else None, a.kind)
        if wait and wait.get(a.kind):   # the stand-in device finishes, then the result can be sent
            time.sleep(max(0.0, wait[a.kind] - (time.perf_counter() - t0)))
        spans.append((f"rank {me}", str(a), t0, time.perf_counter()))
        # the rank's saved bytes peak at the end of a forward: sample them after each action
        rank_peak = max(rank_peak, sum(t.tracker.current for t in stages.values()))
        if a.kind == "F":
            if last:
                loss += l.item()
            else:
                send(out.detach(), s + 1, fwd_tag)
        elif a.kind != "W" and s > 0:
            send(gx, s - 1, bwd_tag)
    for w, _ in works:
        w.wait()
    return {"spans": spans, "loss": loss,
            "peak": {s: st.tracker.peak for s, st in stages.items()}, "rank_peak": rank_peak,
            "mb_bytes": {s: st.mb_bytes for s, st in stages.items()}}


def _worker(schedule, stages, batches, loss_fn, lr, shapes, wait, warmup):
    rank = dist.get_rank()
    mine = {s: stages[s] for s in schedule.stages_of(rank)}
    if torch.cuda.is_available() and dist.get_backend() != "gloo":   # NCCL: a GPU per rank
        mine = {s: mod.to(f"cuda:{rank}") for s, mod in mine.items()}
    params = [q for mod in mine.values() for q in mod.parameters()]
    opt = torch.optim.SGD(params, lr=lr) if lr and params else None   # a stage may have no parameters
    losses = []
    for _ in range(warmup):   # first calls are slow (allocations, lazy set-up): keep them off the clock
        run_schedule(schedule, mine, *batches[0], loss_fn, shapes[0], wait)
    for (X, y), batch_shapes in zip(batches, shapes):
        for q in params:
            q.grad = None
        dist.barrier()        # every rank starts the step together: a late rank is not a bubble
        out = run_schedule(schedule, mine, X, y, loss_fn, batch_shapes, wait)
        losses.append(out["loss"])
        grads = {s: {k: q.grad.detach().cpu().clone() for k, q in mod.named_parameters()
                     if q.grad is not None} for s, mod in mine.items()}
        if opt:
            opt.step()
    out["losses"] = losses
    out["grads"] = grads
    out["params"] = {s: {k: v.detach().cpu() for k, v in mod.state_dict().items()} for s, mod in mine.items()}
    return out


@dataclass
class PipelineResult:
    schedule: Schedule
    params: list[dict]          # per stage, its state dict after the last step
    grads: list[dict]           # per stage, the gradients of the last step
    losses: list[float]         # per step, the full-batch mean loss
    timeline: Timeline          # the last step's actions, lanes 'rank r'
    peak_bytes: list[int]       # per stage, most bytes of saved activations held at once (last step)
    mb_bytes: list[int]         # per stage, bytes saved by one micro-batch's forward
    idle: list[float] = field(default_factory=list)   # per rank, measured idle fraction (last step)
    rank_peak_bytes: list[int] = field(default_factory=list)   # per rank, all its stages together

    @property
    def peak_microbatches(self) -> list[float]:
        return [pk / b if b else 0.0 for pk, b in zip(self.peak_bytes, self.mb_bytes)]


def _shapes_per_batch(stages, batches, microbatches: int) -> list[list[list[tuple]]]:
    """``check_stages`` for every batch: a DataLoader's last batch is often shorter, and each batch's
    messages must be received into buffers of that batch's sizes (checked once per input shape);
    each batch's targets must be as many as its inputs."""
    seen: dict[tuple, list[list[tuple]]] = {}
    out = []
    for i, (X, y) in enumerate(batches):
        if len(y) != len(X):
            raise ValueError(f"batch {i} has {len(X)} inputs but {len(y)} targets: give one target "
                             f"per input")
        key = (tuple(X.shape), X.dtype)
        if key not in seen:
            try:
                seen[key] = check_stages(stages, X, microbatches)
            except ValueError as e:
                raise ValueError(f"batch {i} (input shape {tuple(X.shape)}): {e}") from None
        out.append(seen[key])
    return out


def run_pipeline(schedule: Schedule, stages: list[nn.Module], batches, loss_fn=nn.functional.cross_entropy,
                 lr: float = 0.0, wait: dict[str, float] | None = None, warmup: int = 0,
                 timeout: float = 60.0) -> PipelineResult:
    """Train ``stages`` on ``batches`` (a list of (X, y)) with the schedule on ``schedule.ranks`` ranks.

    Checks the schedule and the stages' shapes here, before any rank starts; ``lr=0`` computes the
    gradients without updating; ``warmup`` untimed steps (gradients discarded) come first. Each step
    starts with a barrier. The caller's stages are not changed. Batches may differ in size (a
    DataLoader's shorter last batch): each batch's messages are sized from that batch.
    """
    validate(schedule)
    if len(stages) != schedule.stages:
        raise ScheduleError(f"{schedule.name} with p={schedule.ranks}, v={schedule.stages_per_rank} "
                            f"needs {schedule.stages} stages, got {len(stages)}: cut the model with "
                            f"split_model(model, {schedule.stages})")
    if not (isinstance(lr, (int, float)) and 0 <= lr < float("inf")):
        raise ValueError(f"lr={lr!r}: give a finite learning rate >= 0 (0 computes gradients only)")
    batches = list(batches)
    if not batches:
        raise ValueError("run_pipeline got no batches: give a list of (X, y) pairs")
    shapes = _shapes_per_batch(stages, batches, schedule.microbatches)
    results = launch(_worker, schedule.ranks, schedule, stages, batches, loss_fn, lr, shapes, wait,
                     warmup, timeout=timeout)
    merged = {k: {} for k in ("params", "grads", "peak", "mb_bytes")}
    for res in results:
        for k in merged:
            merged[k].update(res[k])
    S = schedule.stages
    last = results[schedule.rank_of(S - 1)]
    timeline = Timeline(Span(*sp) for res in results for sp in res["spans"])
    return PipelineResult(schedule, [merged["params"][s] for s in range(S)],
                          [merged["grads"][s] for s in range(S)], last["losses"], timeline,
                          [merged["peak"][s] for s in range(S)], [merged["mb_bytes"][s] for s in range(S)],
                          idle_fractions(timeline, schedule.ranks),
                          [res["rank_peak"] for res in results])
