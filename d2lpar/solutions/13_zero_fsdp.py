"""Worked solutions to the exercises of notebook 13 (ZeRO and FSDP).

Each ``exercise_k`` computes its answer, prints it and asserts what it claims. Ranks are started with
the course's launcher (gloo on the CPU; NCCL with a GPU each), as in the notebook.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from d2lpar.infra.adamw import AdamW
from d2lpar.infra.check import check, check_close, check_equal
from d2lpar.processes.launch import launch
from d2lpar.strategies.sharded import zero


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 33), nn.ReLU(), nn.Linear(33, 31), nn.ReLU(),
                         nn.Linear(31, 17), nn.ReLU(), nn.Linear(17, 4))


def make_batches(steps=3, batch=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 10, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def exercise_1():
    """Smallest N for which each stage's model states of 7.5B parameters fit in 16 GB (2 + 2 + 12)."""
    psi, budget = 7.5e9, 16e9

    def smallest(stage, limit=4096):
        for n in range(1, limit + 1):
            if sum(zero.model_state_bytes(stage, psi, n, 2, 2, 12).values()) <= budget:
                return n
        return None
    found = {stage: smallest(stage) for stage in (0, 1, 2, 3)}
    print(f"GPUs needed to fit in 16 GB: {found} (None: never)")
    # Stage 1 keeps (p + g) Psi = 30 GB unsharded whatever N; stage 2 keeps p Psi = 15 GB, leaving
    # 1 GB for 14 Psi / N: N >= 105; stage 3 needs 16 Psi / N <= 16 GB: N >= 8.
    check_equal("DP and stage 1 never fit; stage 2 from 105 GPUs; stage 3 from 8", found,
                {0: None, 1: None, 2: 105, 3: 8})


def _stage3(batches):
    rank, n = dist.get_rank(), dist.get_world_size()
    net = make_model()
    opt = zero.ZeroAdamW(net, 3, lr=1e-2)
    sent = []
    for X, y in batches:
        before = opt.counter.sent
        mine = slice(rank * len(X) // n, (rank + 1) * len(X) // n)
        nn.functional.cross_entropy(net(X[mine]), y[mine]).backward()
        opt.step()
        sent.append(opt.counter.sent - before)
    return {"psi": opt.numel(), "sent": sent, "state": opt.full_state_dict()}


def _one_process(model, batches, params=None):
    opt = torch.optim.AdamW(params if params is not None else model.parameters(), lr=1e-2)
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.state_dict()


def exercise_2():
    """Stage 3 on 3 ranks: the padding, its share of the traffic, and the formula with padded Psi."""
    batches = make_batches()
    psi = sum(p.numel() for p in make_model().parameters())
    res = launch(_stage3, 3, batches)
    padded = res[0]["psi"]
    units = [sum(p.numel() for p in layer.parameters()) for layer in make_model()[::2]]
    print(f"units {units}: Psi = {psi}, padded to multiples of 3: {padded}; padding "
          f"{padded - psi} elements, {(padded - psi) / padded:.2%} of the bytes sent")
    check_equal("padding = what rounding each unit up to a multiple of 3 adds",
                padded - psi, zero.padded_numel(units, 3) - psi)
    check("there is some padding (no unit but the first and last divides by 3)", padded > psi)
    for rank, r in enumerate(res):
        check_equal(f"rank {rank}: bytes sent per step == 3 (N-1)/N 4 Psi_padded",
                    r["sent"], [zero.sent_bytes(3, padded, 3)] * len(batches))
    check_close("and the model equals one process", res[0]["state"],
                _one_process(make_model(), batches))


def _frozen_stage2(batches):
    rank, n = dist.get_rank(), dist.get_world_size()
    net = make_model()
    net[0].requires_grad_(False)
    opt = zero.ZeroAdamW(net, 2, lr=1e-2)
    for X, y in batches:
        mine = slice(rank * len(X) // n, (rank + 1) * len(X) // n)
        nn.functional.cross_entropy(net(X[mine]), y[mine]).backward()
        opt.step()
    return opt.full_state_dict(), opt.held(), opt.numel()


def exercise_3():
    """A frozen first layer under stage 2: untouched, and not counted in what ZeRO holds."""
    batches = make_batches()
    start = make_model().state_dict()
    baseline = make_model()
    baseline[0].requires_grad_(False)
    expected = _one_process(baseline, batches, [p for p in baseline.parameters() if p.requires_grad])
    state, held, psi = launch(_frozen_stage2, 2, batches)[0]
    trainable = sum(p.numel() for p in make_model()[2:].parameters())
    print(f"held with layer 0 frozen: {held}; sharded Psi {psi} (trainable {trainable})")
    check_close("the frozen layer did not move", {k: state[k] for k in ("0.weight", "0.bias")},
                {k: start[k] for k in ("0.weight", "0.bias")}, rtol=0, atol=0)
    check_close("the rest equals one process training only the trainable parameters", state, expected)
    check_equal("ZeroAdamW shards the trainable parameters' states only: bytes held == formula",
                held, zero.model_state_bytes(2, psi, 2))
    frozen = 4 * sum(p.numel() for p in make_model()[0].parameters())  # fp32, whole on every rank
    all_trainable = zero.model_state_bytes(2, zero.padded_numel(
        [sum(p.numel() for p in m.parameters()) for m in make_model()[::2]], 2), 2)
    print(f"per rank: sharded states {sum(held.values())} B + frozen layer, not sharded, {frozen} B;"
          f" with every layer trainable: {sum(all_trainable.values()):.0f} B")
    check("freezing a layer saves its gradients and AdamW state, though its weights stay whole",
          sum(held.values()) + frozen < sum(all_trainable.values()))


def _fsdp_memory(width, layers):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    cuda = "nccl" in dist.get_backend_config()  # the launcher's GPU group: "cpu:gloo,cuda:nccl"
    local = int(os.environ["LOCAL_RANK"])  # this node's GPU for this process, not the global rank
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # the ranks' device
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = AdamW(net.parameters(), lr=1e-3)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    net(torch.randn(8, width, device=device)).square().mean().backward()
    opt.step()
    psi = sum(p.numel() for p in net.parameters())
    held = sum(p.to_local().nbytes + p.grad.to_local().nbytes for p in net.parameters()) \
        + sum(t.to_local().nbytes for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return psi, held, peak


def exercise_4():
    """FSDP2 on one rank: memory against 16 bytes per parameter (the GPU's peak, or the CPU's tensors)."""
    if torch.cuda.is_available():  # a few hundred million parameters: 16 layers of 4096 x 4096
        psi, held, peak = launch(_fsdp_memory, 1, 4096, 16)[0]
        print(f"Psi = {psi}: max_memory_allocated {peak / 1e9:.2f} GB, 16 Psi = {16 * psi / 1e9:.2f} GB,"
              f" ratio {peak / (16 * psi):.3f}")
        check("the peak is at least the model states (activations and workspace come on top)",
              peak >= 16 * psi)
    else:  # 2 ranks: each rank's shards, measured from the tensors, against 16 Psi / N
        per_rank = launch(_fsdp_memory, 2, 64, 4)
        psi = per_rank[0][0]
        for rank, (_, held, _) in enumerate(per_rank):
            print(f"no GPU: rank {rank} of 2 holds {held} bytes of parameter, gradient and AdamW "
                  f"shards for Psi = {psi}: {held / psi:.0f} bytes per parameter of the model")
            check_equal(f"rank {rank}: 16 bytes per parameter, over 2 ranks (64 rows divide by 2)",
                        held, 16 * psi // 2)
