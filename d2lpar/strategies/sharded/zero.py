"""ZeRO: data parallelism without the redundancy, stages 1, 2 and 3, built from a ring's two halves.

Data parallelism keeps on each of N ranks a full copy of the *model states* of Psi parameters:
parameters, gradients and optimizer state. With fp32 and Adam(W) that is p + g + k = 4 + 4 + 8 = 16
bytes per parameter (the ZeRO paper trains in mixed precision: 2 + 2 + 12). ZeRO (Rajbhandari et al.,
2020) cuts each of these flat buffers into N equal shards and lets rank r keep only its own:

    stage                 holds per rank (bytes)         sends per rank per step
    DP                    (p + g + k) Psi                 2 (N-1)/N p Psi   (ring all-reduce)
    1: optimizer state    (p + g) Psi + k Psi / N         2 (N-1)/N p Psi   (reduce-scatter, all-gather)
    2: + gradients        p Psi + (g + k) Psi / N         2 (N-1)/N p Psi
    3: + parameters       (p + g + k) Psi / N             3 (N-1)/N p Psi   (all-gather in forward, again
                                                                             in backward, reduce-scatter)

A ring all-reduce is a reduce-scatter followed by an all-gather (notebook 04). Stage 1 puts the
optimizer step between the two halves: reduce-scatter the gradients, so rank r holds the summed
gradient of its shard only; update only that shard with AdamW, whose state exists only for it;
all-gather the updated parameters. Same bytes as data parallelism, 1/N of the optimizer state.
Stage 2 also drops the full gradients: each unit's (a layer's) gradient is reduce-scattered as soon
as backward has produced it, and only the shard is kept. Stage 3 also shards the parameters: before
a unit's forward, and again before its backward, its parameters are all-gathered into the unit's
flat buffer, and afterwards the buffer's storage is resized to 0. Views of it, including those
autograd saved, stay valid and see the data again after the next gather (the trick FSDP uses), so
at most one unit is gathered at a time (two with ``prefetch``), at the price of a third collective.

Layout (``d2lpar.strategies.sharded.flat_shards``): a unit's trainable parameters are views into one flat
buffer padded to N S elements, S = ceil(Psi_unit / N), so every shard has S elements whatever Psi and
N (3 ranks too); the padding stays zero through AdamW. The formulas take the padded Psi; they equal
the unpadded ones when N divides every unit. Frozen parameters are not sharded (every rank keeps them).
AdamW runs on the pieces of a shard, one per parameter (and one for the padding), so each piece keeps
its own step count, as torch keeps one per parameter.

Stage 3 is built on ``fsdp.shard`` (the sharding wrapper: after backward each piece's ``.grad`` is
the mean gradient, so any optimizer can step it); ZeroAdamW adds AdamW and the measurements. Stages 1
and 2 keep the parameters whole and need no module: ``ZeroAdamW(model.parameters())`` shards the
optimizer state of any parameters, as ``torch.optim`` optimizers take them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.comm.collectives import ByteCounter, ring_all_gather, ring_rank_bytes, ring_reduce_scatter
from d2lpar.infra.adamw import AdamW, check_hyperparameters
from d2lpar.strategies.sharded import fsdp
from d2lpar.strategies.sharded.flat_shards import FlatUnit, padded_numel, shard_size, split_units

__all__ = ["STAGES", "shard_size", "padded_numel", "model_state_bytes", "sent_bytes", "ZeroAdamW"]

STAGES = (1, 2, 3)


def model_state_bytes(stage: int, numel: float, n: int, param_bytes: float = 4,
                      grad_bytes: float = 4, optimizer_bytes: float = 8) -> dict[str, float]:
    """Bytes one rank holds for parameters, gradients and optimizer state (stage 0: plain DP)."""
    if stage not in (0,) + STAGES:
        raise ValueError(f"stage must be 0 (plain data parallelism), 1, 2 or 3, got {stage!r}")
    return {"params": param_bytes * numel / (n if stage >= 3 else 1),
            "grads": grad_bytes * numel / (n if stage >= 2 else 1),
            "optimizer": optimizer_bytes * numel / (n if stage >= 1 else 1)}


def sent_bytes(stage: int, numel: float, n: int, param_bytes: float = 4,
               reshard_after_forward: bool = True) -> float:
    """Bytes one rank sends per step: 2 (N-1)/N p Psi, or 3 (N-1)/N p Psi for stage 3."""
    if stage not in (0,) + STAGES:
        raise ValueError(f"stage must be 0 (plain data parallelism), 1, 2 or 3, got {stage!r}")
    passes = 3 if stage == 3 and reshard_after_forward else 2  # ring passes over all parameters
    return passes * ring_rank_bytes("all_gather", param_bytes * numel, n)


class ZeroAdamW:
    """AdamW over a model whose states are sharded over the ranks of the current process group.

    ``ZeroAdamW(model, stage)`` then, per step: ``loss.backward()`` on this rank's part of the batch
    (a mean loss) and ``opt.step()``. The result equals single-process AdamW on the whole batch.
    ``counter`` counts the bytes this rank sends and receives; ``held()`` measures the bytes it keeps.
    At construction every parameter and buffer (trainable or not) takes rank 0's values, as DDP does.
    Stage 3 shards each unit with ``fsdp.shard_unit``: between steps ``model.state_dict()`` gives this
    rank's pieces (1-D), ``full_state_dict()`` the full tensors.

    ``ZeroAdamW(params, stage=1)`` takes parameters as a ``torch.optim`` optimizer does: plain ones
    get stage 1 (the default) or 2, all of them one unit (one flat buffer, as DeepSpeed flattens a
    parameter group); the parameters of modules sharded with ``fsdp.shard`` get stage 3, which they
    already are (leave ``stage`` out): AdamW on this rank's pieces of them.

    A parameter whose ``.grad`` is None on every rank at ``step()`` (a layer this step did not use) is
    not stepped, as ``torch.optim.AdamW`` skips it after ``zero_grad(set_to_none=True)``: no weight
    decay, no moment update, its step count unchanged; a unit none of whose parameters got a gradient
    is neither reduced nor gathered. One small all-reduce per step (not counted in ``counter``) lets the
    ranks agree on this. As with FSDP, every rank must use the same layers in a step. ``step()``
    leaves the gradients zeroed.
    """

    def __init__(self, params, stage: int | None = None, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, reshard_after_forward: bool = True,
                 prefetch: bool = False):
        model = params if isinstance(params, nn.Module) else None
        given = None if model is not None else _parameter_list(params)
        sharded = given is not None and any(fsdp.unit_of(p) is not None for p in given)
        if model is not None and stage is None:
            raise ValueError("ZeroAdamW(model, stage) needs the stage: 1 shards the optimizer state, "
                             "2 also the gradients, 3 also the parameters")
        stage = stage if stage is not None else (3 if sharded else 1)
        if stage not in STAGES:
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}: 1 shards the optimizer "
                             "state, 2 also the gradients, 3 also the parameters")
        if sharded and stage != 3:
            raise ValueError(f"these parameters are sharded already (fsdp.shard), which is stage 3: "
                             f"leave stage out, or pass the parameters of an unsharded model for "
                             f"stage {stage}")
        if given is not None and not sharded and stage == 3:
            raise ValueError("stage 3 shards the parameters themselves, which needs the modules that "
                             "use them: pass the model (ZeroAdamW(model, 3)), or fsdp.shard its "
                             "layers first and pass model.parameters()")
        check_hyperparameters(lr, betas, eps, weight_decay)
        if not dist.is_initialized():
            raise RuntimeError("ZeroAdamW shards over a process group, and none is initialised: run"
                               " it on ranks started by d2lpar.processes.launch.launch or torchrun")
        self.model, self.stage, self.prefetch = model, stage, prefetch
        self.n, self.rank = dist.get_world_size(), dist.get_rank()
        self.counter = ByteCounter()
        self.sharding: fsdp.Sharding | None = None
        self._params = list(model.parameters()) if model is not None else given
        self._whole: list[nn.Parameter] = []
        if sharded:  # stage 3 by fsdp.shard already: AdamW on the pieces (and the whole ones given)
            self.units = []
            for p in given:
                u = fsdp.unit_of(p)
                if u is None:
                    self._whole.append(p)
                elif all(u is not v for v in self.units):
                    self.units.append(u)
            self.sharding = self.units[0].sharding
            self.counter = self.sharding.counter
            self._adamw_on_pieces(lr, betas, eps, weight_decay, chosen={id(p) for p in given})
            return
        trainable = [p for p in self._params if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters: nothing to shard")
        if len({(p.dtype, p.device) for p in trainable}) > 1:
            raise ValueError("ZeroAdamW needs all trainable parameters on one device, one dtype")
        if model is not None and any(getattr(m, "_d2lpar_sharding", None) for m in model.modules()):
            raise ValueError("this model is sharded already (fsdp.shard or an earlier ZeroAdamW): "
                             "build a fresh model, or pass model.parameters() to use its shards")
        self._agree_on_parameters()
        self._broadcast_the_rest(trainable)
        if model is not None:
            units = split_units(model, trainable)
        else:
            units = [("(parameters)", None, trainable)]
        if stage == 3:
            self.sharding = fsdp.Sharding(self.counter, prefetch)
            self.units = [fsdp.shard_unit(name, mod, ps, self.sharding,
                                          reshard_after_forward and name != "(root)")
                          for name, mod, ps in units]
            self._adamw_on_pieces(lr, betas, eps, weight_decay)
            return
        self._lay_out(units, lr, betas, eps, weight_decay)

    # ------------------------------------------------------------------------------ construction

    def _lay_out(self, units, lr, betas, eps, weight_decay) -> None:
        """Stages 1 and 2: each unit's parameters become views into its flat buffer; the shard is a
        view of the buffer too, and AdamW runs on the shard's pieces."""
        self.units = [FlatUnit(name, mod, ps, self.n, self.rank, False) for name, mod, ps in units]
        for u in self.units:
            with torch.no_grad():
                for p, v in zip(u.params, u.views):
                    v.copy_(p)
                dist.broadcast(u.full, 0)  # start from rank 0's values (the rest: above)
                for p, v in zip(u.params, u.views):
                    p.data = v  # parameters become views into the flat buffer
            u.shard = nn.Parameter(u.own(u.full))  # a view: updating it updates the buffer
            if self.stage == 1:
                u.grad_full = torch.zeros_like(u.full)
                u.shard.grad = u.own(u.grad_full)
                self._attach_grad_views(u)
            else:
                u.shard.grad = torch.zeros_like(u.shard)
            # AdamW's tensors: the shard's piece of each parameter, views sharing its data and .grad
            u.segments = [(nn.Parameter(u.shard.detach()[a:b]), u.shard.grad[a:b], i)
                          for a, b, i in u.pieces()]
            self._register_hooks(u)
        self.opt = AdamW([seg for u in self.units for seg, _, _ in u.segments], lr=lr, betas=betas,
                         eps=eps, weight_decay=weight_decay)  # elementwise: runs on pieces as they are

    def _adamw_on_pieces(self, lr, betas, eps, weight_decay, chosen=None) -> None:
        """Stage 3: AdamW on each unit's pieces, the module's own Parameters (their ``.grad`` set by
        fsdp's reduce-scatter), plus the padding, so the state covers the whole shard."""
        for u in self.units:
            u.segments = [(u.params[i] if i is not None else nn.Parameter(u.shard.detach()[a:b]),
                           u.shard.grad[a:b], i) for a, b, i in u.pieces()
                          if i is None or chosen is None or id(u.params[i]) in chosen]
        self.opt = AdamW([seg for u in self.units for seg, _, _ in u.segments] + self._whole, lr=lr,
                         betas=betas, eps=eps, weight_decay=weight_decay)

    def _agree_on_parameters(self) -> None:
        if self.model is not None:
            named = list(self.model.named_parameters())
            buffers = list(self.model.named_buffers())
        else:
            named, buffers = [(str(i), p) for i, p in enumerate(self._params)], []
        trainable = [(name, tuple(p.shape), str(p.dtype)) for name, p in named if p.requires_grad]
        rest = [(name, tuple(t.shape), str(t.dtype)) for name, t in
                [(n, p) for n, p in named if not p.requires_grad] + buffers]
        every = [None] * self.n
        dist.all_gather_object(every, (trainable, rest))
        for what, k in (("trainable parameters", 0), ("frozen parameters and buffers", 1)):
            mine = (trainable, rest)[k]
            for r, theirs in enumerate(every):
                if theirs[k] != mine:
                    diff = sorted(set(theirs[k]) ^ set(mine))[:4] or "the same names in another order"
                    raise ValueError(f"rank {self.rank} and rank {r} disagree on the {what} "
                                     f"(name, shape, dtype) {diff}: build the same model on every "
                                     "rank before ZeroAdamW")

    @torch.no_grad()
    def _broadcast_the_rest(self, trainable: list[nn.Parameter]) -> None:
        """Frozen parameters and buffers take rank 0's values too (the trainable ones: with the units)."""
        ids = {id(p) for p in trainable}
        buffers = list(self.model.buffers()) if self.model is not None else []
        rest = [p for p in self._params if id(p) not in ids] + buffers
        for t in rest:
            data = t.data if t.is_contiguous() else t.data.contiguous()
            wire = data.view(torch.uint8) if data.dtype == torch.bool else data
            dist.broadcast(wire, 0)
            if data is not t.data:
                t.data.copy_(data)

    def _attach_grad_views(self, u: FlatUnit) -> None:
        """Stage 1: each .grad is a view into the flat gradient buffer; autograd adds in place."""
        u.grad_views = [u.grad_full[o:o + p.numel()].view_as(p)
                        for p, o in zip(u.params, u.offsets)]
        for p, g in zip(u.params, u.grad_views):
            p.grad = g

    def _register_hooks(self, u: FlatUnit) -> None:
        """Stages 1 and 2: a hook per parameter once autograd has accumulated its gradient (stage 3's
        hooks are fsdp's: ``Sharding._register_hooks``)."""
        for i, p in enumerate(u.params):
            p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: self._grad_ready(u, i))

    # ------------------------------------------------------------------------------- gradients

    def _grad_ready(self, u: FlatUnit, i: int) -> None:
        u.had[i] = True
        if self.stage == 1:
            return  # autograd added it into the flat gradient buffer: step() reduces it
        u.ready += 1
        if u.ready == len(u.params):
            self._reduce_unit(u)

    def _collect_gradients(self) -> list[list[bool]]:
        """Per unit, per parameter: did any rank get a gradient this step (one small all-reduce)?

        Stage 1 also moves a ``.grad`` that someone replaced into the flat buffer.
        """
        mine = []
        for u in self.units:
            for i, p in enumerate(u.params):
                if self.stage == 1:  # autograd fills the views, unless .grad was set to None
                    g = u.grad_views[i]
                    if p.grad is None:
                        g.zero_()
                        u.had[i] = False
                    elif p.grad.data_ptr() != g.data_ptr():  # someone replaced .grad: take it
                        g.copy_(p.grad)
                        u.had[i] = True
                elif p.grad is not None:  # stage 2: not yet reduced, or set by hand
                    u.had[i] = True
                mine.append(u.had[i])
            mine.append(u.reduced)
        flags = torch.tensor(mine, dtype=torch.int32, device=self.units[0].full.device)
        dist.all_reduce(flags)
        out, k = [], 0
        for u in self.units:
            out.append([bool(f) for f in flags[k:k + len(u.params)].tolist()])
            k += len(u.params)
            eager = int(flags[k])
            k += 1
            if eager not in (0, self.n):
                raise RuntimeError(f"unit {u.name!r} got all its gradients on {eager} of {self.n} "
                                   "ranks this step: every rank must use the same layers in a step")
        return out

    def _reduce_unit(self, u: FlatUnit) -> None:
        """Stage 2: reduce-scatter the unit's gradient now, keep the shard, drop the rest."""
        flat = torch.zeros(u.padded, dtype=u.full.dtype, device=u.full.device)
        start = 0
        for p in u.params:
            if p.grad is not None:
                flat[start:start + p.numel()].copy_(p.grad.view(-1))
            p.grad = None
            start += p.numel()
        ring_reduce_scatter(flat, self.counter)
        u.shard.grad.add_(u.own(flat))
        u.ready, u.reduced = 0, True

    def step(self) -> None:
        """Reduce what is left, update this rank's shards with AdamW, share the result.

        Parameters that got no gradient on any rank this step are skipped (see the class). Stage 3:
        fsdp reduced every gradient in backward (means already); AdamW steps the pieces, the next
        forward gathers them.
        """
        if self.stage == 3:
            return self._step_pieces()
        used = self._collect_gradients()  # per unit, per parameter: a gradient on some rank?
        for u, got in zip(self.units, used):
            for seg, grad, i in u.segments:  # AdamW skips a piece whose .grad is None
                seg.grad = grad if (any(got) if i is None else got[i]) else None
            if not any(got):
                continue
            if self.stage == 1:
                ring_reduce_scatter(u.grad_full, self.counter)
            elif not u.reduced:  # some of the unit's parameters got no gradient this step
                self._reduce_unit(u)
            u.shard.grad.div_(self.n)  # sums of N mean losses -> the mean over the whole batch
        self.opt.step()
        for u, got in zip(self.units, used):
            if self.stage == 1:
                u.grad_full.zero_()
                self._attach_grad_views(u)
            else:
                u.shard.grad.zero_()
            if any(got):
                ring_all_gather(u.full, self.counter)
            u.had, u.reduced = [False] * len(u.params), False

    def _step_pieces(self) -> None:
        for u in self.units:  # the padding is stepped with its unit (it stays zero)
            got = any(p.grad is not None for p in u.params)
            for seg, grad, i in u.segments:
                if i is None:
                    seg.grad = grad if got else None
        self.opt.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        """Gradients are zeroed by ``step``; this clears any a forward/backward left since."""
        for p in self._whole:
            p.grad = None
        for u in self.units:
            u.had, u.reduced = [False] * len(u.params), False
            if self.stage == 1:
                u.grad_full.zero_()
                self._attach_grad_views(u)
            else:
                u.shard.grad.zero_()
                u.ready = 0
                for p in (*u.params, *getattr(u, "unsharded", ())):
                    p.grad = None

    # -------------------------------------------------------------------------------- measuring

    @property
    def peak_gathered(self) -> int:
        """Stage 3: the most bytes of gathered units held at once during the steps (else 0)."""
        return self.sharding.peak_gathered if self.sharding is not None else 0

    def numel(self) -> int:
        """Psi as stored: trainable parameters, every unit padded to a multiple of N."""
        return sum(u.padded for u in self.units)

    def formula(self) -> dict[str, float]:
        """What the formulas say this rank holds and sends per step, summed over its units.

        Units that are not resharded after forward (the root's) cost two collectives, not three.
        """
        out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "sent": 0.0}
        for u in self.units:
            for k, v in model_state_bytes(self.stage, u.padded, self.n).items():
                out[k] += v
            out["sent"] += sent_bytes(self.stage, u.padded, self.n, reshard_after_forward=u.reshard)
        return out

    def held(self) -> dict[str, int]:
        """Bytes this rank keeps now, measured from its tensors (optimizer: its state tensors).

        Gradients: every storage behind a gradient, counted once: the flat gradient buffer (stage 1)
        or the shards (2, 3), and the ``.grad`` of every trainable parameter, so a full gradient
        left behind after the reduce-scatter (a stage 2 that forgot ``p.grad = None``) is counted.
        """
        params = sum(u.full.untyped_storage().nbytes() for u in self.units)
        if self.stage == 3:
            params += sum(u.shard.nbytes for u in self.units)
        grads = [u.grad_full if self.stage == 1 else u.shard.grad for u in self.units]
        grads += [p.grad for u in self.units for p in getattr(u, "unsharded", ())
                  if p.grad is not None]
        grads += [p.grad for p in self._params if p.requires_grad and p.grad is not None]
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        return {"params": params, "grads": sum(storages.values()), "optimizer": self.opt.state_bytes()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state, on every rank (a collective with stage 3: call it on all ranks)."""
        if self.model is None:
            raise ValueError("ZeroAdamW was given parameters, not the model: call "
                             "fsdp.full_state_dict(model) (stage 3) or read model.state_dict() "
                             "(stages 1 and 2 keep the parameters whole)")
        if self.stage == 3:
            return fsdp.full_state_dict(self.model)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _parameter_list(params) -> list[nn.Parameter]:
    """``params`` as a torch optimizer takes them: tensors (parameter-group dicts are refused)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("ZeroAdamW takes an iterable of parameters (model.parameters()) or a model,"
                        " not one tensor: wrap it in a list")
    out, seen = [], set()
    for p in params:
        if isinstance(p, dict):
            raise TypeError("ZeroAdamW takes one learning rate for all its parameters: pass the "
                            "parameters themselves, not parameter-group dicts")
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ZeroAdamW takes parameters (tensors), got a {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    if not out:
        raise ValueError("ZeroAdamW got an empty list of parameters: pass model.parameters()")
    return out
