"""Worked solutions to the exercises of notebook 07 (DistributedDataParallel, end to end).

Each ``exercise_k`` computes its answer, prints it and asserts what it claims. Ranks are started with
the course's launcher (gloo on the CPU; NCCL with a GPU each), as in the notebook.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from d2lpar.cost import costmodel as cm
from d2lpar.examples import train_ddp
from d2lpar.infra.check import check, check_changed, check_close
from d2lpar.infra.data import load_digits
from d2lpar.infra.models import count_parameters, lenet
from d2lpar.infra.paths import build_dir
from d2lpar.processes import env
from d2lpar.processes.launch import launch


def _train_one_epoch(train_size, drop_last, lr=0.05, global_batch=32):
    """One epoch of plain SGD on this rank's shard (or all of it in a single process)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    data = Subset(load_digits()[0], range(train_size))
    model = lenet(seed=0)
    net = DDP(model) if world > 1 else model
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                 drop_last=drop_last)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    steps = 0
    for X, y in DataLoader(data, batch_size=global_batch // world, sampler=sampler):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
        steps += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, len(sampler), steps


def exercise_1():
    """1437 examples on 2 ranks: the sampler pads one duplicate into the last global batch, so DDP's
    last step differs from one process's; drop_last drops a real example instead. Only full global
    batches make the two equal."""
    torch.set_num_threads(1)
    size = 1437  # 1408 = 44 x 32 trains equal to one process: notebook 07, section 5, checks it
    one, seen, steps = _train_one_epoch(size, drop_last=False)
    for drop_last in (False, True):
        (ddp, per_rank, ddp_steps), _ = launch(_train_one_epoch, 2, size, drop_last)
        gap = max((ddp[k] - v).abs().max().item() for k, v in one.items())
        print(f"{size} examples, drop_last={drop_last!s:<5}: {per_rank} per rank ({2 * per_rank} in "
              f"all, one process {seen}); {ddp_steps} steps; largest difference from one process {gap:.1e}")
        check(f"{size}, drop_last={drop_last}: DDP differs from one process beyond the check's 1e-5, "
              "and by less than 1e-2 (only the last of the 45 steps differs)", 1e-5 < gap < 1e-2)
    print("Without drop_last the last global batch holds 29 real examples plus one repeated from the "
          "start of the permutation, and the mean is over 30; with drop_last it holds 28 (one example "
          "never seen this epoch). One process averages the 29. The earlier steps are identical.")


def _first_labels_and_accuracy(call_set_epoch, epochs=3):
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, test_set = load_digits()
    data = Subset(train_set, range(704))
    model = lenet(seed=0)
    ddp = DDP(model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    firsts = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        for i, (X, y) in enumerate(DataLoader(data, batch_size=16, sampler=sampler)):
            if i == 0:
                firsts.append(y[:8].tolist())
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(X), y).backward()
            opt.step()
    who = env.detect()
    return firsts, train_ddp.evaluate(model, test_set, who, torch.device("cpu"))[1], model.state_dict()


def exercise_2():
    """Without set_epoch every epoch replays epoch 0's order: the first batch's labels repeat."""
    runs = {flag: launch(_first_labels_and_accuracy, 2, flag)[0] for flag in (False, True)}
    for flag, (firsts, acc, _) in runs.items():
        print(f"set_epoch {'called' if flag else 'removed'}: rank 0's first labels per epoch {firsts}; "
              f"final test accuracy {acc:.3f}")
    check("removed: the first batch is the same every epoch", all(f == runs[False][0][0] for f in runs[False][0]))
    check("called: the first batch changes between epochs", runs[True][0][0] != runs[True][0][1])
    check_changed("the two runs end with different weights (same epoch 0, other orders after)",
                  runs[False][2], runs[True][2])
    print("The final accuracy changes (here by much); by how much depends on the orders drawn. What "
          "removing set_epoch certainly does: every epoch feeds the same sequence of batches.")


def _load_after_wrapping(pretrained):
    rank = dist.get_rank()
    model = lenet(seed=rank)               # different on every rank
    ddp = DDP(model)                       # the broadcast happens here...
    if rank == 0:
        model.load_state_dict(pretrained)  # ...so this load reaches rank 0 only
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    X = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(X), torch.arange(8) % 10).backward()
    opt.step()
    return before, {k: v.clone() for k, v in model.state_dict().items()}


def exercise_3():
    """Loaded after wrapping, the weights reach rank 0 only; the ranks then differ for ever, because
    DDP never broadcasts parameters again: both take the same averaged step from different points."""
    pretrained = lenet(seed=42).state_dict()
    (b0, a0), (b1, a1) = launch(_load_after_wrapping, 2, pretrained)
    check_close("rank 0 holds the pretrained weights", b0, pretrained, rtol=0, atol=0)
    check_changed("rank 1 does not hold them", b1, pretrained)
    check_close("rank 1 holds rank 0's random initial weights (broadcast by DDP(...))", b1,
                lenet(seed=0).state_dict(), rtol=0, atol=0)
    check_changed("the first step moved rank 0's weights", a0, b0)
    diff_before = {k: b0[k] - b1[k] for k in b0}
    diff_after = {k: a0[k] - a1[k] for k in a0}
    check_close("after one step the ranks differ exactly as much as before (same averaged gradient)",
                diff_after, diff_before, rtol=1e-5, atol=1e-6)


def _different_files(folder, timeout_s):
    rank = int(os.environ["RANK"])
    t0 = time.perf_counter()
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous-rank{rank}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout_s))
        return "joined", time.perf_counter() - t0
    except RuntimeError as e:
        return f"RuntimeError: {str(e).splitlines()[0]}", time.perf_counter() - t0


def exercise_4():
    """Two files are two rendezvous of one rank each: each rank waits for a peer that never comes,
    for the whole timeout (30 minutes by default), then raises."""
    from torch.distributed.constants import default_pg_timeout
    folder = build_dir("solutions_07_rendezvous")
    for old in folder.glob("rendezvous-*"):
        old.unlink()
    results = launch(_different_files, 2, str(folder), 2, init_process_group=False, timeout=60)
    for rank, (what, seconds) in enumerate(results):
        print(f"rank {rank}: {what} after {seconds:.1f} s (timeout 2 s)")
    check("both ranks fail instead of joining", all(w != "joined" for w, _ in results))
    check("and only after the timeout", all(s >= 2 for _, s in results))
    print(f"default timeout: {default_pg_timeout}")
    check("without a timeout the wait is 30 minutes", default_pg_timeout == datetime.timedelta(minutes=30))


def _timed_epoch(argv):
    t0 = time.perf_counter()
    train_ddp.main(argv)
    return time.perf_counter() - t0


def exercise_5():
    """Measured here: CPU ranks share the cores. Predicted for V100s: LeNet with 16 examples per GPU
    is all per-operator cost, so the second GPU adds an all-reduce and saves almost nothing."""
    torch.set_num_threads(1)
    argv = ["--train-size", "1408", "--epochs", "1", "--batch-size", "32"]
    one = _timed_epoch(argv)
    two = launch(_timed_epoch, 2, argv, init_process_group=False)[0]
    print(f"measured here, one epoch (training, evaluation, start-up): 1 process {one:.2f} s, 2 ranks {two:.2f} s")
    gpu, link = cm.GPUS["V100, FP32"], cm.with_devices(cm.MACHINES["4 GPUs, PCIe 3.0"], 2)
    steps, K = 1408 // 32, 4 * count_parameters(lenet())
    predicted = {}
    for k in (1, 2):
        X, y = torch.rand(32 // k, 1, 28, 28), torch.randint(0, 10, (32 // k,))
        flops, ops = cm.training_work(lenet(), X, y)
        predicted[k] = steps * (gpu.time(flops, ops) + cm.allreduce_time("ring", K, k, link))
    print(f"predicted on V100s (PCIe 3.0), {steps} steps of 32: 1 GPU {predicted[1] * 1e3:.1f} ms, "
          f"2 GPUs {predicted[2] * 1e3:.1f} ms")
    check("predicted: 2 GPUs are no faster than one for LeNet at a global batch of 32",
          predicted[2] >= predicted[1])
