"""FSDP by hand: each chosen module keeps 1/N of its parameters and gathers them only to compute.

``shard(layer)`` makes ``layer`` a *unit*, as FSDP2's ``fully_shard`` makes one parameter group per
call: its trainable parameters (less those of sub-modules already sharded, so shard bottom-up) are
laid out in one flat buffer padded to N S elements (``flat_shards``), and rank r keeps only its
shard of S elements, in the parameters' own dtype (the *master* copy). The module's parameters
become this rank's **pieces** of that shard: the same Parameter objects, now 1-D, each the part of
the parameter inside the shard (possibly empty), so an optimizer built on ``model.parameters()``
updates exactly this rank's shard. Around the module's forward and backward:

    before forward       all-gather the shards into the flat buffer (cast to compute_dtype if given;
                         floating inputs are cast too); the module computes with full-shape views
    after forward        reshard_after_forward=True: free the buffer (its storage resized to 0)
    before backward      gather again: the views autograd saved see the data again
    its gradients ready  copy them into one flat buffer in the master dtype (fp32 even when the
                         compute dtype is bf16), reduce-scatter it round the ring, divide by N, free
                         the gathered buffer

so after ``loss.backward()`` on each rank's part of the batch (a mean loss), every sharded
parameter's ``.grad`` holds its piece of the MEAN gradient, the gradient one process computes on the
whole batch, and an element-wise ``torch.optim`` optimizer (SGD, Adam, AdamW, RMSprop: each element's
update depends on that element alone) steps it as one process would. One that couples elements does
not: Adafactor's row and column factors and LBFGS's dot products over all parameters would be
computed on 1-D pieces. So does gradient clipping: ``clip_grad_norm_`` on the pieces gives this
rank's norm; the global norm is the square root of the all-reduced (SUM) squared norms of the
pieces, plus once those of the parameters left whole. At the end of backward one small all-reduce
lets the ranks agree which parameters any rank used: a unit some of whose parameters got no gradient
is reduced then, and a parameter no rank used keeps ``.grad`` None, as torch leaves it.

``finish_grad_sync(model)``, after each backward on every rank, finishes the synchronisation: it
averages the gradients of the parameters left whole (a norm the caller did not shard) with a ring
all-reduce, and the first time checks that those parameters are equal on every rank (``shard`` copies
rank 0's values only to what it shards). Between steps ``model.state_dict()`` gives this rank's
pieces (1-D, the same keys); ``full_state_dict(model)`` gathers full tensors (a collective).
Move the model to its device before ``shard``, and keep every rank's calls in the same order.
``shard`` needs the whole model built on every rank first (it copies rank 0's values into the
shards); FSDP2 can start from a model on the meta device, shard it, then ``to_empty`` and
``reset_parameters`` allocate and initialise only each rank's shards.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from d2lpar.comm.collectives import ByteCounter, ring_all_gather, ring_all_reduce, ring_reduce_scatter
from d2lpar.strategies.sharded.flat_shards import CONTAINERS, FlatUnit

__all__ = ["shard", "finish_grad_sync", "full_state_dict", "units_of", "unit_of", "piece_span",
           "Sharding", "Unit", "shard_unit"]


class Unit(FlatUnit):
    """One sharded module's parameters: ``shard`` (this rank's S elements, an nn.Parameter whose
    ``.grad`` holds the mean gradient's shard), ``full`` (the gathered buffer, in the compute
    dtype) and ``unsharded`` (full-shape Parameters viewing ``full``: what the module computes with).
    ``params`` are the module's own Parameter objects, now pieces of ``shard``."""

    def __init__(self, name: str, module: nn.Module, params: list[nn.Parameter], sharding: Sharding,
                 reshard: bool, compute_dtype: torch.dtype | None):
        n, rank = dist.get_world_size(), dist.get_rank()
        super().__init__(name, module, params, n, rank, reshard, compute_dtype)
        self.sharding, self.n, self.compute_dtype = sharding, n, compute_dtype
        first = params[0]
        sizes = torch.tensor([self.padded, -self.padded], device=first.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # a broadcast of unequal sizes would hang
        if sizes.tolist() != [self.padded, -self.padded]:
            raise ValueError(f"unit {name!r} has {self.numel} trainable elements on rank {rank} and "
                             "not on another: build the same model on every rank before shard")
        with torch.no_grad():
            master = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
            for p, o in zip(params, self.offsets):
                master[o:o + p.numel()].copy_(p.reshape(-1))
            dist.broadcast(master, 0)  # every rank starts from rank 0's values
            self.shard = nn.Parameter(self.own(master).clone())
        self.shard.grad = torch.zeros_like(self.shard)
        self.unsharded = [nn.Parameter(torch.empty(0, dtype=v.dtype, device=v.device))
                          for v in self.views]
        for q, v in zip(self.unsharded, self.views):
            q.data = v  # a view of the buffer with its own version counter: the gathers that write
            # the buffer do not count as changes to what autograd saved
        # where each parameter is registered (twice for a weight tied inside the module)
        self.slots = [[(m, k) for m in module.modules() for k, q in m._parameters.items() if q is p]
                      for p in params]
        cut = {i: (a, b) for a, b, i in self.pieces() if i is not None}
        for i, p in enumerate(params):
            a, b = cut.get(i, (0, 0))
            p.data = self.shard.data[a:b]  # the module's Parameter becomes this rank's piece
            p._d2lpar_unit = self
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def register(self, tensors) -> None:
        """Make the module's attributes these tensors (FSDP2 swaps ``module._parameters`` too)."""
        for slots, t in zip(self.slots, tensors):
            for m, k in slots:
                m._parameters[k] = t


class Sharding:
    """What the units of one model share: a byte counter, the gathered bytes (live and peak), the
    prefetch switch, and the call queued for the end of the current backward."""

    def __init__(self, counter: ByteCounter | None = None, prefetch: bool = False):
        self.units: list[Unit] = []
        self.counter = counter or ByteCounter()
        self.prefetch = prefetch
        self.live = self.peak_gathered = 0
        self.queued = False

    def _register_hooks(self, u: Unit) -> None:
        """Gather before the module's forward, free after it, gather again before its backward;
        a hook per parameter once autograd has accumulated its gradient."""
        for i, q in enumerate(u.unsharded):
            q.register_post_accumulate_grad_hook(lambda q, u=u, i=i: u.sharding._grad_ready(u, i))
        u.module.register_forward_pre_hook(
            lambda m, args, kwargs, u=u: u.sharding._before_forward(u, args, kwargs), with_kwargs=True)
        u.module.register_forward_hook(lambda m, args, out, u=u: u.sharding._after_forward(u, out))

    # ------------------------------------------------------------------------- gather and free

    def _gather(self, u: Unit) -> None:
        if u.gathered:
            return
        u.full.untyped_storage().resize_(u.nbytes)
        with torch.no_grad():
            u.own(u.full).copy_(u.shard)  # cast to the compute dtype, if there is one
            ring_all_gather(u.full, self.counter)
        u.gathered = True
        u.register(u.unsharded)
        self.live += u.nbytes
        self.peak_gathered = max(self.peak_gathered, self.live)

    def _free(self, u: Unit) -> None:
        if u.gathered:
            u.full.untyped_storage().resize_(0)
            u.gathered = False
            u.register(u.params)
            self.live = max(0, self.live - u.nbytes)

    def _neighbour(self, u: Unit, step: int) -> Unit | None:
        i = self.units.index(u) + step
        if 0 <= i < len(self.units) and self.units[i].reshard:
            return self.units[i]
        return None

    def _before_forward(self, u: Unit, args, kwargs):
        self._gather(u)
        if self.prefetch and (nxt := self._neighbour(u, +1)) is not None:
            self._gather(nxt)
        if u.compute_dtype is not None:
            return _cast(args, u.compute_dtype), _cast(kwargs, u.compute_dtype)
        return None

    def _after_forward(self, u: Unit, out) -> None:
        if u.reshard:
            self._free(u)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: u.sharding._before_backward(u))

    def _before_backward(self, u: Unit) -> None:
        self._queue_finish()
        self._gather(u)
        if self.prefetch and (prev := self._neighbour(u, -1)) is not None:
            self._gather(prev)

    # ------------------------------------------------------------------------------- gradients

    def _grad_ready(self, u: Unit, i: int) -> None:
        self._queue_finish()
        u.had[i] = True
        u.ready += 1
        if u.ready == len(u.params):
            self._reduce_unit(u)

    def _reduce_unit(self, u: Unit, used: list[bool] | None = None) -> None:
        """Reduce-scatter the unit's gradient in the master dtype; each used piece's ``.grad`` gets
        (or, if it has one, adds) its part of the sum / N; free the gathered buffer."""
        flat = torch.zeros(u.padded, dtype=u.shard.dtype, device=u.shard.device)
        for q, o in zip(u.unsharded, u.offsets):
            if q.grad is not None:
                flat[o:o + q.numel()].copy_(q.grad.reshape(-1))
                q.grad = None
        ring_reduce_scatter(flat, self.counter)
        mean = u.own(flat).div_(u.n)  # N mean losses summed -> the mean over the whole batch
        for a, b, i in u.pieces():
            if i is not None and (used is None or used[i]):
                p = u.params[i]
                if p.grad is None:
                    p.grad = u.shard.grad[a:b].copy_(mean[a:b])
                else:
                    p.grad.add_(mean[a:b])  # accumulating: the caller did not zero it
        for i, p in enumerate(u.params):  # a parameter with no piece here gets an empty gradient
            if p.numel() == 0 and p.grad is None and (used is None or used[i]):
                p.grad = u.shard.grad[:0]
        u.ready, u.reduced = 0, True
        self._free(u)

    def _queue_finish(self) -> None:
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        """End of backward: one all-reduce of flags (did any rank get this gradient? was the unit
        reduced already?), then the units some of whose parameters got no gradient are reduced."""
        self.queued = False
        if not self.units:
            return
        mine = [int(f) for u in self.units for f in (*u.had, u.reduced)]
        flags = torch.tensor(mine, dtype=torch.int32, device=self.units[0].shard.device)
        dist.all_reduce(flags)
        k = 0
        for u in self.units:
            got = [bool(f) for f in flags[k:k + len(u.params)].tolist()]
            eager = int(flags[k + len(u.params)])
            k += len(u.params) + 1
            if eager not in (0, u.n):
                raise RuntimeError(f"unit {u.name!r} got all its gradients on {eager} of {u.n} ranks"
                                   " in this backward: every rank must use the same layers")
            if any(got) and not u.reduced:
                self._reduce_unit(u, got)
            u.had, u.reduced, u.ready = [False] * len(u.params), False, 0
            self._free(u)


# -------------------------------------------------------------------------------------- the API

def _check_group(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{what} shards over a process group, and none is initialised: run it on "
                           "ranks started by d2lpar.processes.launch.launch or torchrun")


def shard_unit(name: str, module: nn.Module, params: list[nn.Parameter], sharding: Sharding,
               reshard: bool = True, compute_dtype: torch.dtype | None = None) -> Unit:
    """Shard ``params`` (trainable, one dtype and device) as one unit run by ``module``."""
    if len({(p.dtype, p.device) for p in params}) > 1:
        raise ValueError(f"unit {name!r} mixes dtypes or devices "
                         f"{sorted({f'{p.dtype} {p.device}' for p in params})}: a unit is one flat "
                         "buffer; shard its layers separately or convert them to one dtype first")
    u = Unit(name, module, params, sharding, reshard, compute_dtype)
    sharding.units.append(u)
    sharding._register_hooks(u)
    module._d2lpar_unit, module._d2lpar_sharding = u, sharding
    return u


def shard(module: nn.Module, *, reshard_after_forward: bool = True,
          compute_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard ``module``'s trainable parameters over the ranks of the default process group.

    Call it bottom-up, on every rank, on the modules you choose (each layer, then perhaps the root:
    it takes the parameters no sharded layer took, such as weights tied between layers); parameters
    under no sharded module stay whole (``finish_grad_sync`` averages their gradients). A
    ``ModuleList`` or ``ModuleDict`` is refused: it is never called, so its gather would never run.
    ``compute_dtype`` (e.g. ``torch.bfloat16``): gather and compute in it, reduce in the master dtype.
    Returns ``module``, changed in place (its parameters are now this rank's pieces).
    """
    _check_group("shard")
    if isinstance(module, CONTAINERS):
        raise TypeError(f"a {type(module).__name__} is never called, so the gather before its forward"
                        " would never run: shard each of its layers instead (for layer in container: "
                        "shard(layer)), or the module that calls them")
    if getattr(module, "_d2lpar_sharding", None) is not None:
        raise ValueError(f"this {type(module).__name__} is sharded already: shard each module once")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                          and compute_dtype.is_floating_point):
        raise ValueError(f"compute_dtype must be a floating torch dtype such as torch.bfloat16, "
                         f"got {compute_dtype!r}")
    inner = []  # the shardings of sharded sub-modules: merged into one
    for m in module.modules():
        s = getattr(m, "_d2lpar_sharding", None)
        if s is not None and all(s is not t for t in inner):
            inner.append(s)
    sharding = inner[0] if inner else Sharding()
    for other in inner[1:]:
        for u in other.units:
            u.sharding = sharding
            sharding.units.append(u)
        sharding.live += other.live
        sharding.counter.sent += other.counter.sent
        sharding.counter.received += other.counter.received
        sharding.counter.messages += other.counter.messages
    names = {id(m): name or "(root)" for name, m in module.named_modules()}
    for m in module.modules():
        if getattr(m, "_d2lpar_sharding", None) is not None:
            m._d2lpar_sharding = sharding
    _refuse_ties_across(module, sharding, names)
    taken = {id(t) for u in sharding.units for t in (*u.params, *u.unsharded)}
    own = [p for p in module.parameters() if p.requires_grad and id(p) not in taken]
    if own:
        compute = None if compute_dtype == own[0].dtype else compute_dtype
        shard_unit(type(module).__name__, module, own, sharding, reshard_after_forward, compute)
    else:
        module._d2lpar_unit, module._d2lpar_sharding = None, sharding
    order = {id(m): k for k, m in enumerate(module.modules())}  # prefetch follows the module tree
    sharding.units.sort(key=lambda u: order.get(id(u.module), -1))
    return module


def _refuse_ties_across(module: nn.Module, sharding: Sharding, names: dict) -> None:
    """A parameter of a sharded sub-module that another module outside it uses (a tied weight)
    would be gathered only around the first one's forward."""
    for u in sharding.units:
        inside = {id(m) for m in u.module.modules()}
        mine = {id(t) for t in (*u.params, *u.unsharded)}
        for m in module.modules():
            if id(m) in inside:
                continue
            for k, q in m._parameters.items():
                if id(q) in mine:
                    raise ValueError(f"{names[id(m)]}.{k} is also a parameter of {names[id(u.module)]}"
                                     f", sharded on its own: shard their common parent instead of "
                                     f"{names[id(u.module)]} (it takes shared weights), or untie them")


def unit_of(p: torch.Tensor) -> Unit | None:
    """The unit whose piece ``p`` is, or None for a parameter no ``shard`` took."""
    return getattr(p, "_d2lpar_unit", None)


def piece_span(p: torch.Tensor) -> tuple[int, int]:
    """Where this rank's piece ``p`` lies in its full parameter: ``full.view(-1)[start:stop]``."""
    u = unit_of(p)
    if u is None:
        raise ValueError("piece_span takes a parameter that shard() sharded: this one is whole")
    i = next(k for k, q in enumerate(u.params) if q is p)
    for a, b, k in u.pieces():
        if k == i:
            return u.lo + a - u.offsets[i], u.lo + b - u.offsets[i]
    return 0, 0


def units_of(model: nn.Module) -> list[Unit]:
    """The units under ``model``, in the order of ``model.modules()``."""
    return [m._d2lpar_unit for m in model.modules() if getattr(m, "_d2lpar_unit", None) is not None]


def _shardings(units: list[Unit]) -> list[Sharding]:
    out: list[Sharding] = []
    for u in units:
        if all(u.sharding is not s for s in out):
            out.append(u.sharding)
    return out


_whole_checked: weakref.WeakSet = weakref.WeakSet()


def finish_grad_sync(model: nn.Module) -> None:
    """After backward, on every rank: finish what is pending and average the whole parameters'
    gradients (a ring all-reduce, then / N), so that every trainable ``.grad`` is the mean."""
    _check_group("finish_grad_sync")
    units = units_of(model)
    for s in _shardings(units):
        s._finish()  # nothing left after a backward; a gradient set by hand is reduced here
    sharded = {id(t) for u in units for t in (*u.params, *u.unsharded)}
    whole = [p for p in model.parameters() if id(p) not in sharded]
    if model not in _whole_checked:
        _check_equal_on_every_rank(whole)
        _whole_checked.add(model)
    trainable = [p for p in whole if p.requires_grad]
    if not trainable:
        return
    got = torch.tensor([p.grad is not None for p in trainable], dtype=torch.int32,
                       device=trainable[0].device)  # NCCL reduces only tensors on the GPU
    dist.all_reduce(got)
    counter = units[0].sharding.counter if units else ByteCounter()
    used = [p for p, g in zip(trainable, got.tolist()) if g]
    for kind in sorted({(p.dtype, p.device) for p in used}, key=str):
        group = [p for p in used if (p.dtype, p.device) == kind]
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                          torch.zeros(p.numel(), dtype=kind[0], device=kind[1]) for p in group])
        ring_all_reduce(flat, counter)
        flat.div_(dist.get_world_size())
        start = 0
        for p in group:
            mean = flat[start:start + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = mean
            else:
                p.grad.copy_(mean)
            start += p.numel()


def _check_equal_on_every_rank(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        return
    different = torch.zeros(1, dtype=torch.int32, device=tensors[0].device)
    for kind in sorted({(t.dtype, t.device) for t in tensors}, key=str):
        flat = torch.cat([t.detach().reshape(-1) for t in tensors if (t.dtype, t.device) == kind])
        theirs = flat.clone()
        dist.broadcast(theirs, 0)
        different += int(not torch.equal(theirs, flat))
    dist.all_reduce(different, op=dist.ReduceOp.MAX)
    if different.item():
        raise ValueError("the parameters left whole (in no sharded module) differ between ranks: "
                         "build the model from one seed on every rank, or broadcast rank 0's values"
                         " to them before training (shard copies them only to what it shards)")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state with full tensors, on every rank (a collective: call it on all).

    Each unit's master shards (fp32, whatever the compute dtype) are all-gathered into a buffer of
    their own (bytes not counted as training traffic; the training buffers are left as they are)."""
    units = units_of(model)
    spare = ByteCounter()
    try:
        for u in units:
            flat = torch.zeros(u.padded, dtype=u.shard.dtype, device=u.shard.device)
            u.own(flat).copy_(u.shard.detach())
            ring_all_gather(flat, spare)
            u.register([flat[o:o + v.numel()].view(v.shape) for v, o in zip(u.views, u.offsets)])
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        for u in units:
            u.register(u.unsharded if u.gathered else u.params)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _cast(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(v, dtype) for v in obj)
    return obj
