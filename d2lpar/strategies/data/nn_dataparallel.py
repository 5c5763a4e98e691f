"""``nn.DataParallel`` seen from inside: its four steps, its memory trap, its saved names.

Every forward of ``nn.DataParallel(module, device_ids, output_device)``:

1. **replicate** the module's parameters and buffers from ``device_ids[0]`` to every device (on
   every step: the copies are thrown away afterwards);
2. **scatter** the input along dimension 0 into one chunk per device;
3. **parallel_apply**: each replica runs on its chunk, one Python thread per device;
4. **gather** the outputs on ``output_device`` (default ``device_ids[0]``).

Backward runs these in reverse, so the replicas' gradients are *summed onto device_ids[0]*, the
only copy the optimizer updates. On GPUs the replicate is ``comm.broadcast_coalesced`` and the sum
``comm.reduce_add`` (NCCL broadcast and reduce when NCCL is there, a loop of copies otherwise);
``traffic_per_step`` counts the bytes both ways. ``moved`` counts the forward's bytes on the tensors. On a machine without a GPU ``nn.DataParallel`` just calls the
module. ``SimulatedDataParallel`` takes the same four steps on any devices, simulated CPU devices
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
           "busiest"]


def strip_module_prefix(state_dict: dict) -> dict:
    """Drop the leading ``module.`` that a wrapper's ``state_dict()`` puts before every name."""
    prefix = "module."
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}


def _chunk_sizes(batch: int, n: int, gpu0_bsz: int | None, weights) -> list[int]:
    if gpu0_bsz is not None:
        return balanced_sizes(batch, n, gpu0_bsz)
    return split_sizes(batch, n, weights=weights)


class SimulatedDataParallel(nn.Module):
    """``nn.DataParallel``'s replicate / scatter / parallel_apply / gather, on any devices.

    ``gpu0_bsz`` gives device 0 that many examples (the balanced variant); ``weights`` splits in
    proportion instead. ``trace`` keeps a list of lines describing the last forward.
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
        n, t = len(self.devices), []
        state = dict(self.module.named_parameters())
        state.update(self.module.named_buffers())
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        # 1. replicate: .to() is differentiable, so gradients come back to the original tensors.
        copies = [{k: v.to(d) for k, v in state.items()} for d in self.devices]
        t.append(f"replicate      {nbytes} bytes of parameters from {self.devices[0]} to each of "
                 f"{n - 1} other device(s)")
        # 2. scatter
        sizes = _chunk_sizes(len(x), n, self.gpu0_bsz, self.weights)
        xs = split_batch(x, None, self.devices, sizes=sizes)
        t.append(f"scatter        batch {tuple(x.shape)} -> " +
                 ", ".join(f"{d}: {tuple(c.shape)}" for d, c in zip(self.devices, xs)))
        # 3. parallel_apply (threads on GPUs; simulated devices take turns)
        outs = [functional_call(self.module, c, (xi,)) if len(xi) else None
                for c, xi in zip(copies, xs)]
        t.append("parallel_apply " + ", ".join(
            f"{d}: {tuple(o.shape) if o is not None else '-'}" for d, o in zip(self.devices, outs)))
        # 4. gather
        y = gather(outs, self.output_device)
        # bytes that left device 0 (replicate; scatter of a batch that sits on device 0) and that
        # reached the output device (gather), counted on the tensors themselves
        self.moved = {"replicate": sum(v.numel() * v.element_size() for c in copies[1:]
                                       for v in c.values()),
                      "scatter": sum(c.numel() * c.element_size() for c in xs[1:]),
                      "gather": sum(o.numel() * o.element_size() for d, o in zip(self.devices, outs)
                                    if o is not None and d != self.output_device)}
        t.append(f"gather         outputs {tuple(y.shape)} on {self.output_device}")
        self.trace = t
        return y


class BalancedDataParallel(nn.DataParallel):
    """``nn.DataParallel`` that gives GPU 0 only ``gpu0_bsz`` examples of each batch (the source
    notes' class, rewritten): ``BalancedDataParallel(gpu0_bsz // acc_grad, net, device_ids=...)``.

    With a batch of 8 on 3 GPUs and gpu0_bsz=2 the chunks are 2, 3, 3. Without GPUs it behaves as
    ``nn.DataParallel`` does there: it calls the module.
    """

    def __init__(self, gpu0_bsz: int, *args, **kwargs):
        if gpu0_bsz < 1:
            raise ValueError(f"gpu0_bsz={gpu0_bsz}: give GPU 0 at least one example (to leave it "
                             "out entirely, drop it from device_ids instead)")
        self.gpu0_bsz = gpu0_bsz
        super().__init__(*args, **kwargs)

    def scatter(self, inputs, kwargs, device_ids):
        from torch.nn.parallel._functions import Scatter
        batch = next(x for x in inputs if isinstance(x, torch.Tensor)).size(self.dim)
        gpu0 = min(self.gpu0_bsz, batch - len(device_ids) + 1)  # a short last batch still splits
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
    "DDP": {"every device": (sent, received)}}``, both directions counted the same way for both.
    P parameter bytes, k devices, X input and Y output bytes of the whole batch; s = (k-1)/k.

    DataParallel, every step: replicate broadcasts P from device 0; scatter sends the other devices
    their inputs (s X from device 0, or X/k to each device from the host when the batch is still on
    the CPU); gather brings s Y of outputs to device 0, and backward sends their gradients (s Y)
    back out; the replicas' gradients are reduced onto device 0.

    * ``nccl=True`` (every CUDA build): the broadcast and the reduce are NCCL collectives
      (``comm.broadcast_coalesced``, ``nccl.reduce`` in ``comm.reduce_add``), which pass the data
      along a chain of devices: device 0 sends P (broadcast) and receives P (reduce); a device in
      the middle of the chain receives and sends P in each (2P each way; P with k = 2).
    * ``nccl=False`` (the fallback without NCCL, and the course's simulated devices): device 0
      copies P to each of the k-1 others and receives k-1 gradients: (k-1)P each way.

    DDP: each process loads its own inputs and computes its own loss; the ring all-reduce sends and
    receives 2(k-1)P/k on every device (the once-per-forward buffer broadcast is left out).
    """
    P, X, Y = param_bytes, input_bytes, output_bytes
    out_x = 0 if inputs_from_host else X * (k - 1) // k   # inputs device 0 sends to the others
    out_y = Y * (k - 1) // k                              # outputs gathered, their gradients back
    own_x = X // k                                        # what another device receives of X
    if k == 1:
        dp0, other = (0, X if inputs_from_host else 0), (0, 0)
    elif nccl:
        chain = 2 * P if k >= 3 else P                    # broadcast relay + reduce relay
        dp0 = (P + out_x + out_y, P + out_y + (own_x if inputs_from_host else 0))
        other = (chain + Y // k, chain + own_x + Y // k)
    else:
        dp0 = ((k - 1) * P + out_x + out_y, (k - 1) * P + out_y + (own_x if inputs_from_host else 0))
        other = (P + Y // k, P + own_x + Y // k)
    ring = 2 * (k - 1) * P // k
    return {"DataParallel": {"device 0": dp0, "another device": other},
            "DDP": {"every device": (ring, ring)}}


def busiest(traffic: dict) -> int:
    """The most bytes any device moves in one direction (a link's busier direction sets its time)."""
    return max(max(pair) for pair in traffic.values())
