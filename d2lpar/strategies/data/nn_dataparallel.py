"""``nn.DataParallel`` seen from inside: its four steps, its memory trap, its saved names.

Every forward of ``nn.DataParallel(module, device_ids, output_device)``:

1. **scatter** the input along dimension 0 with ``Tensor.chunk`` semantics (chunks of
   ceil(B/k) examples: 10 on 4 devices is 3, 3, 3, 1; 5 on 4 is 2, 2, 1 and only 3 devices are
   used, ``device_ids[:len(inputs)]``);
2. **replicate** the module's parameters and buffers from ``device_ids[0]`` to every device that
   got a chunk (on every step: the copies are thrown away afterwards);
3. **parallel_apply**: each replica runs on its chunk, one Python thread per device;
4. **gather** the outputs on ``output_device`` (default ``device_ids[0]``).

Backward runs these in reverse, so the replicas' gradients are *summed onto device_ids[0]*, the
only copy the optimizer updates. On GPUs the replicate is ``comm.broadcast_coalesced`` and the sum
``comm.reduce_add`` (NCCL broadcast and reduce when NCCL is there, a loop of copies otherwise);
``traffic_per_step`` counts the bytes both ways, ``phases_per_step`` those of each phase in turn;
``moved`` counts them on the tensors. Without a GPU ``nn.DataParallel`` just calls the module.
``SimulatedDataParallel`` takes the same four steps on any devices, simulated CPU devices
included, so they can be watched; its gradients flow back to the one original module exactly as
``nn.DataParallel``'s do.

**Device 0 runs out of memory first.** Besides its share of the activations it holds the gathered
outputs of the whole batch (and their gradients), the reduced gradients and all optimizer state:
    mem_0 = P (2 + s) + (a + o) b_0 + 2 o B,    mem_i = 2P + (a + o) b_i    (i > 0)
for P parameter bytes, s optimizer slots, a activation bytes and o output bytes per example.
Giving device 0 fewer examples (``BalancedDataParallel``, ``gpu0_bsz``) evens this out.

**Names.** The wrapper holds the model as ``.module``, so its ``state_dict()`` keys start with
``module.``; a plain model will not load them. Save ``unwrap(model).state_dict()``, and load old
files through ``strip_module_prefix``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.func import functional_call

from d2lpar.processes.checkpoint import unwrap
from d2lpar.infra.data import split_batch, split_sizes
from d2lpar.strategies.data.data_parallel import balanced_sizes, gather
from d2lpar.infra.activations import saved_activation_bytes

__all__ = ["SimulatedDataParallel", "BalancedDataParallel", "strip_module_prefix", "unwrap",
           "model_bytes", "memory_per_device", "best_gpu0_bsz", "traffic_per_step",
           "busiest", "torch_chunk_sizes", "phases_per_step"]


def strip_module_prefix(state_dict: dict) -> dict:
    """Drop the leading ``module.`` that a wrapper's ``state_dict()`` puts before every name."""
    prefix = "module."
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}


def torch_chunk_sizes(batch: int, n: int) -> list[int]:
    """The chunks ``nn.DataParallel``'s scatter makes of a batch for n devices: ``Tensor.chunk``.

    Chunks of ceil(batch / n) examples, the last one shorter, and fewer than n chunks when the
    batch runs out first (torch then uses only ``device_ids[:len(chunks)]``).
    """
    return [len(c) for c in torch.arange(batch).chunk(n)]


def _chunk_sizes(batch: int, n: int, gpu0_bsz: int | None, weights) -> list[int]:
    if gpu0_bsz is not None:
        return balanced_sizes(batch, n, gpu0_bsz)
    if weights is not None:
        return split_sizes(batch, n, weights=weights)
    return torch_chunk_sizes(batch, n)


class SimulatedDataParallel(nn.Module):
    """``nn.DataParallel``'s replicate / scatter / parallel_apply / gather, on any devices.

    By default it splits the batch as torch does (``torch_chunk_sizes``: 10 on 4 devices is
    3, 3, 3, 1, and 5 on 4 uses 3 devices); ``gpu0_bsz`` gives device 0 that many examples (the
    balanced variant); ``weights`` splits in proportion. ``trace``: lines on the last forward.
    """

    def __init__(self, module: nn.Module, devices: Sequence[torch.device],
                 output_device: torch.device | None = None, gpu0_bsz: int | None = None,
                 weights: Sequence[float] | None = None):
        super().__init__()
        self.module, self.devices = module, list(devices)
        self.output_device = output_device if output_device is not None else self.devices[0]
        self.gpu0_bsz, self.weights = gpu0_bsz, weights
        self.trace: list[str] = []
        self.moved: dict[str, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = []
        state = dict(self.module.named_parameters())
        state.update(self.module.named_buffers())
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        # 1. scatter (torch's order: scatter, then replicate): a short batch may fill fewer
        # chunks than there are devices, and only the devices that get a chunk are used
        sizes = _chunk_sizes(len(x), len(self.devices), self.gpu0_bsz, self.weights)
        used = self.devices[:len(sizes)]
        n = len(used)
        xs = split_batch(x, None, used, sizes=sizes)
        # 2. replicate: .to() is differentiable, so gradients come back to the original tensors.
        copies = [{k: v.to(d) for k, v in state.items()} for d in used]
        t.append(f"scatter        batch {tuple(x.shape)} -> " +
                 ", ".join(f"{d}: {tuple(c.shape)}" for d, c in zip(used, xs)) +
                 (f" ({len(self.devices) - n} device(s) unused)" if n < len(self.devices) else ""))
        t.append(f"replicate      {nbytes} bytes of parameters from {used[0]} to each of "
                 f"{n - 1} other device(s)")
        # 3. parallel_apply (threads on GPUs; simulated devices take turns)
        outs = [functional_call(self.module, c, (xi,)) if len(xi) else None
                for c, xi in zip(copies, xs)]
        t.append("parallel_apply " + ", ".join(
            f"{d}: {tuple(o.shape) if o is not None else '-'}" for d, o in zip(used, outs)))
        # 4. gather
        y = gather(outs, self.output_device)
        self._count_bytes(used, copies, xs, outs)
        t.append(f"gather         outputs {tuple(y.shape)} on {self.output_device}")
        self.trace = t
        return y

    def _count_bytes(self, used, copies, xs, outs) -> None:
        """``moved``: bytes counted on the tensors that go to or come from another device than
        device 0 (the output device for the gather). In the forward: replicate and scatter out,
        gather in; when a backward runs, hooks count the outputs' gradients going back out and the
        replicas' gradients coming in (the reduce), as autograd delivers them."""
        others = [i for i, d in enumerate(used) if d != self.output_device]

        def nbytes_of(ts):
            return sum(v.numel() * v.element_size() for v in ts)
        self.moved = {"replicate": nbytes_of(v for c in copies[1:] for v in c.values()),
                      "scatter": nbytes_of(xs[1:]),
                      "gather": nbytes_of(outs[i] for i in others if outs[i] is not None),
                      "output gradients": 0, "reduce": 0}

        def count(key):
            def hook(grad):
                self.moved[key] += grad.numel() * grad.element_size()
            return hook
        for c in copies[1:]:
            for v in c.values():
                if v.requires_grad:
                    v.register_hook(count("reduce"))
        for i in others:
            if outs[i] is not None and outs[i].requires_grad:
                outs[i].register_hook(count("output gradients"))


class BalancedDataParallel(nn.DataParallel):
    """``nn.DataParallel`` that gives GPU 0 only ``gpu0_bsz`` examples of each batch (the source
    notes' class, rewritten): ``BalancedDataParallel(gpu0_bsz // acc_grad, net, device_ids=...)``.

    With a batch of 8 on 3 GPUs and gpu0_bsz=2 the chunks are 2, 3, 3. Without GPUs it behaves as
    ``nn.DataParallel`` does there: it calls the module.
    """

    def __init__(self, gpu0_bsz: int, module: nn.Module, device_ids=None, output_device=None,
                 dim: int = 0):
        if gpu0_bsz < 1:
            raise ValueError(f"gpu0_bsz={gpu0_bsz}: give GPU 0 at least one example (to leave it "
                             "out entirely, drop it from device_ids instead)")
        self.gpu0_bsz = gpu0_bsz
        super().__init__(module, device_ids, output_device, dim)
        self.dim = dim          # torch sets it only when there are GPUs; scatter reads it

    def scatter(self, inputs, kwargs, device_ids):
        """Cut the positional tensors with ``balanced_sizes``; unlike torch's ``scatter_kwargs``
        it does not split tensors inside lists, dicts or keyword arguments (each device gets
        those whole). A batch smaller than the device count goes to its first ``batch`` devices,
        one example each; torch's ``forward`` then replicates to ``device_ids[:len(inputs)]``."""
        from torch.nn.parallel._functions import Scatter
        batch = next(x for x in inputs if isinstance(x, torch.Tensor)).size(self.dim)
        device_ids = list(device_ids)[:batch]  # fewer examples than devices: the first `batch`
        gpu0 = min(self.gpu0_bsz, batch - len(device_ids) + 1)  # a short batch: device 0 gives way
        sizes = balanced_sizes(batch, len(device_ids), gpu0)
        chunks = [Scatter.apply(device_ids, sizes, self.dim, x) if isinstance(x, torch.Tensor)
                  else [x] * len(device_ids) for x in inputs]
        scattered = [tuple(c[i] for c in chunks) for i in range(len(device_ids))]
        return scattered, [dict(kwargs or {}) for _ in device_ids]


# ------------------------------------------------------------------------------ memory and traffic

def model_bytes(module: nn.Module, example: torch.Tensor) -> dict[str, int]:
    """P (parameter bytes), a (activation bytes per example, measured from autograd's saved
    tensors for one example) and o (output bytes per example) of a model."""
    P = sum(p.numel() * p.element_size() for p in module.parameters())
    a = saved_activation_bytes(module, example[:1])
    with torch.no_grad():
        out = module(example[:1])
    return {"P": P, "a": a, "o": out.numel() * out.element_size()}


def memory_per_device(sizes: Sequence[int], P: int, a: int, o: int,
                      optimizer_slots: int = 1) -> list[dict[str, int]]:
    """Bytes each device holds in one ``nn.DataParallel`` training step (the module's formula)."""
    B, rows = sum(sizes), []
    for i, b in enumerate(sizes):
        row = {"parameters": P, "gradients": P, "optimizer": optimizer_slots * P if i == 0 else 0,
               "activations": a * b, "outputs": o * b + (2 * o * B if i == 0 else 0)}
        row["total"] = sum(row.values())
        rows.append(row)
    return rows


def best_gpu0_bsz(batch: int, n: int, P: int, a: int, o: int, optimizer_slots: int = 1) -> int:
    """The share of device 0 that makes the largest per-device memory smallest."""
    def peak(g):
        return max(r["total"] for r in memory_per_device(balanced_sizes(batch, n, g), P, a, o,
                                                          optimizer_slots))
    return min(range(1, batch - n + 2), key=lambda g: (peak(g), -g))


def traffic_per_step(param_bytes: int, k: int, input_bytes: int, output_bytes: int,
                     nccl: bool = True, inputs_from_host: bool = False) -> dict:
    """Bytes each device sends and receives per training step: ``nn.DataParallel`` against DDP.

    Returns ``{"DataParallel": {"device 0": (sent, received), "another device": (sent, received)},
    "DDP": {"every device": (sent, received)}}``, counted the same way for both, the batch's trip
    from the host included (it starts on the CPU for both).
    P parameter bytes, k devices, X input and Y output bytes of the whole batch; s = (k-1)/k.

    DataParallel, every step: the batch goes to device 0 (``dp(X.cuda())``: device 0 receives X),
    or, with ``inputs_from_host``, straight from the host to each device (X/k each, ``Scatter`` of
    a CPU tensor); replicate broadcasts P from device 0; scatter sends the other devices their
    inputs (s X from device 0, none from the host); gather brings s Y of outputs to device 0, and
    backward sends their gradients (s Y) back out; the replicas' gradients are reduced onto
    device 0 after the whole backward.

    * ``nccl=True`` (every CUDA build): the broadcast and the reduce are NCCL collectives
      (``comm.broadcast_coalesced``, ``nccl.reduce`` in ``comm.reduce_add``), which pass the data
      along a chain of devices: device 0 sends P (broadcast) and receives P (reduce); a device in
      the middle of the chain receives and sends P in each (2P each way; P with k = 2).
    * ``nccl=False`` (the fallback without NCCL, and the course's simulated devices): device 0
      copies P to each of the k-1 others and receives k-1 gradients: (k-1)P each way.

    DDP: each process copies its own X/k from the host and computes its own loss; the ring
    all-reduce sends and receives 2(k-1)P/k on every device (the once-per-forward buffer broadcast
    is left out).
    """
    P, X, Y = param_bytes, input_bytes, output_bytes
    out_x = 0 if inputs_from_host else X * (k - 1) // k   # inputs device 0 sends to the others
    out_y = Y * (k - 1) // k                              # outputs gathered, their gradients back
    own_x = X // k                                        # what another device receives of X
    in_0 = own_x if inputs_from_host else X               # host -> device 0
    if k == 1:
        dp0, other = (0, X), (0, 0)
    elif nccl:
        chain = 2 * P if k >= 3 else P                    # broadcast relay + reduce relay
        dp0 = (P + out_x + out_y, P + out_y + in_0)
        other = (chain + Y // k, chain + own_x + Y // k)
    else:
        dp0 = ((k - 1) * P + out_x + out_y, (k - 1) * P + out_y + in_0)
        other = (P + Y // k, P + own_x + Y // k)
    ring = 2 * (k - 1) * P // k
    return {"DataParallel": {"device 0": dp0, "another device": other},
            "DDP": {"every device": (ring, ring + own_x)}}


def phases_per_step(param_bytes: int, k: int, input_bytes: int, output_bytes: int,
                    nccl: bool = True, inputs_from_host: bool = False) -> dict:
    """The phases of one step that run one after the other, each with the bytes its busiest
    device moves in its busier direction: ``{"DataParallel": [(phase, bytes)], "DDP": [...]}``.

    Within a phase a full-duplex link sends and receives at once, so the busier direction sets
    the phase's time; the phases of ``nn.DataParallel`` add: the batch reaches the GPUs, then
    device 0 sends (broadcast and scatter in the forward), receives the outputs, sends their
    gradients, and receives the reduce only after the whole backward. DDP's ranks load their own
    X/k at once (one link each), and its all-reduce runs in buckets during the backward (its bytes
    here are the most it can add to a step; hidden behind the backward it adds less).
    """
    P, X, Y = param_bytes, input_bytes, output_bytes
    s_x, s_y, own_x = X * (k - 1) // k, Y * (k - 1) // k, X // k
    fanout = P if nccl else (k - 1) * P   # device 0's share of broadcast and reduce (a relay: P)
    dp = ([("batch, host -> each device (X/k)", own_x),
           ("broadcast P from device 0", fanout)] if inputs_from_host else
          [("batch, host -> device 0 (X)", X),
           ("broadcast P + scatter (k-1)X/k from device 0", fanout + s_x)])
    if k == 1:
        dp = [dp[0]]
    else:
        dp += [("gather outputs to device 0", s_y),
               ("output gradients out of device 0", s_y),
               ("reduce P to device 0, after the backward", fanout)]
    ddp = [("batch, host -> each rank (X/k)", own_x)]
    if k > 1:
        ddp.append(("ring all-reduce, during the backward", 2 * (k - 1) * P // k))
    return {"DataParallel": dp, "DDP": ddp}


def busiest(traffic: dict) -> int:
    """The most bytes any device moves in one direction (within one phase, the busier direction
    of a full-duplex link sets its time; ``phases_per_step`` adds the phases)."""
    return max(max(pair) for pair in traffic.values())
