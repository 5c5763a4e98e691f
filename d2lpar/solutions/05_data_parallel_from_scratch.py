"""Worked solutions to the exercises of notebook 05 (data parallelism from scratch).

Each ``exercise_k`` computes its answer, prints it and asserts what it claims. Devices are simulated
on the CPU when there are not enough GPUs, as in the notebook.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from d2lpar.comm.collectives import ring_schedule
from d2lpar.cost import costmodel as cm
from d2lpar.infra.check import check, check_changed, check_close
from d2lpar.infra.data import chunk_bounds, load_digits, split_batch
from d2lpar.infra.devices import get_devices
from d2lpar.infra.models import count_parameters, lenet
from d2lpar.strategies.data.data_parallel import DataParallelSGD, allreduce_grads, evaluate, replicate

torch.set_num_threads(1)
_data: dict = {}


def _digits():
    if not _data:
        _data["train"], _data["test"] = load_digits()
    return _data["train"], _data["test"]


def _batches(batch_size=50, steps=5):
    loader = DataLoader(_digits()[0], batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    return [b for b, _ in zip(loader, range(steps))]


def _single_device(batches, lr=0.1, momentum=0.0):
    net = lenet(seed=1)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return net


class LocalMeanSGD(DataParallelSGD):
    """The exercise's variant: each device's loss is the mean over its *own* examples, and the
    summed gradients are divided by k (DDP's averaging)."""

    def step(self, X, y):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        micro = torch.split(X, len(X) // self.accumulation), torch.split(y, len(y) // self.accumulation)
        for Xm, ym in zip(*micro):
            xs, ys = split_batch(Xm, ym, self.devices, sizes=self.sizes(len(Xm)))
            for net, xi, yi in zip(self.replicas, xs, ys):
                (self.loss(net(xi), yi) / len(xi) / self.accumulation).backward()  # own count
        allreduce_grads(self.replicas)
        with torch.no_grad():
            for r in self.replicas:
                for p in r.parameters():
                    p.grad /= len(self.devices)                                 # average over k
        for opt in self.optimizers:
            opt.step()


def exercise_1():
    """Local means, averaged over k: right only when every device has the same number of examples."""
    batches = _batches()
    reference = _single_device(batches)
    cases = [(1, {}), (2, {}), (3, {}), (4, {}),
             (3, {"split": "balanced", "gpu0_bsz": 8}),
             (3, {"split": "proportional", "weights": [1.0, 1.0, 0.5]})]
    verdicts = {}
    for k, options in cases:
        trainer = LocalMeanSGD(lenet(seed=1), get_devices(k), lr=0.1, **options)
        for X, y in batches:
            trainer.step(X, y)
        sizes = trainer.sizes(len(batches[0][0]))
        error = max((a - b).abs().max().item() for a, b in
                    zip(trainer.net.parameters(), reference.parameters()))
        verdicts[k, str(options)] = (sizes, error < 1e-5)
        print(f"k={k} parts {str(sizes):<16} {str(options):<50} largest difference {error:.1e}: "
              f"{'matches one device' if error < 1e-5 else 'DIFFERS'}")
    for (k, options), (sizes, same) in verdicts.items():
        check(f"k={k} {options}: matches one device exactly when all parts are equal ({sizes})",
              same == (len(set(sizes)) == 1))
    print("Why: the mean of k local means weights an example by 1/(k b_i) instead of 1/B; the two agree "
          "only when every b_i = B/k. Dividing by the global B is right for any split.")


def exercise_2():
    """Momentum: still one device's steps, because every copy sees the same gradient and state."""
    batches = _batches()
    reference = _single_device(batches, momentum=0.9)
    trainer = DataParallelSGD(lenet(seed=1), get_devices(3), lr=0.1, momentum=0.9)
    for X, y in batches:
        trainer.step(X, y)
    check_changed("momentum moved the parameters away from plain SGD's",
                  trainer.net, _single_device(batches, momentum=0.0))
    check_close("3 devices with momentum 0.9 == torch.optim.SGD(momentum=0.9) on one device",
                trainer.net, reference, rtol=1e-4, atol=1e-5)
    check("the three copies are still identical", trainer.in_sync())
    print("The copies stay identical: each starts equal, receives the same all-reduced gradient and "
          "keeps its own momentum buffer, which is therefore the same on every copy.")


def _train(batch, lr, epochs=4, warmup_from=None):
    """k devices with a global batch B train exactly like one device with B (section 2), so one
    device stands for k = batch / 8 here."""
    train_set, test_set = _digits()
    net = lenet(seed=0)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    loader = DataLoader(train_set, batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    accuracy = []
    for epoch in range(epochs):
        for i, (X, y) in enumerate(loader):
            if warmup_from is not None:  # linear warm-up over the first epoch
                rate = warmup_from + (lr - warmup_from) * (i + 1) / len(loader) if epoch == 0 else lr
                for group in opt.param_groups:
                    group["lr"] = rate
            opt.zero_grad()
            nn.functional.cross_entropy(net(X), y).backward()
            opt.step()
        accuracy.append(evaluate(net, DataLoader(test_set, 256)))
    return accuracy


def exercise_3():
    """k = 8: 23 steps per epoch are too few; the scaled rate helps, warm-up does not close the gap."""
    b, base = 8, 0.025
    runs = {"k=1, lr 0.025": _train(b, base), "k=8, lr 0.025": _train(8 * b, base),
            "k=8, lr 0.2": _train(8 * b, 8 * base),
            "k=8, lr 0.2, warm-up": _train(8 * b, 8 * base, warmup_from=base)}
    for name, acc in runs.items():
        print(f"{name:<22} test accuracy per epoch: " + " ".join(f"{a:.3f}" for a in acc))
    one = runs["k=1, lr 0.025"][-1]
    check("k=8: the scaled rate ends better than the base rate", runs["k=8, lr 0.2"][-1] > runs["k=8, lr 0.025"][-1])
    for name in ("k=8, lr 0.2", "k=8, lr 0.2, warm-up"):
        check(f"{name}: still far (> 0.2) below k=1 after 4 epochs", runs[name][-1] < one - 0.2)
    print("With 1437 images a global batch of 64 leaves 23 steps per epoch: linear scaling cannot make "
          "up for 8 times fewer steps this early, and a warm-up spends the first of those epochs at "
          "lower rates. The rule is for long runs on large data sets.")


def _ring_allreduce_grads(replicas):
    """Ring all-reduce of the flattened gradients over the replicas, driven by ring_schedule.
    Returns the bytes each device received."""
    k = len(replicas)
    flats = [torch.cat([p.grad.reshape(-1) for p in r.parameters()]) for r in replicas]
    bounds = chunk_bounds(flats[0].numel(), k)
    received = [0] * k
    for phase in ("reduce-scatter", "all-gather"):
        steps = [s for s in ring_schedule(k) if s.phase == phase]
        for step in range(k - 1):
            # every device sends at once: take the messages first, then apply them
            msgs = [(s.rank, (s.rank + 1) % k, s.send_chunk) for s in steps if s.step == step]
            payload = [flats[src][slice(*bounds[c])].clone() for src, _, c in msgs]
            for (src, dst, c), data in zip(msgs, payload):
                part = flats[dst][slice(*bounds[c])]
                part.add_(data.to(part.device)) if phase == "reduce-scatter" else part.copy_(data)
                received[dst] += data.numel() * data.element_size()
    for r, flat in zip(replicas, flats):
        offset = 0
        for p in r.parameters():
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    return received


def exercise_4():
    """The ring over k replicas gives the same sums as allreduce_grads; each device receives
    2(k-1)K/k bytes instead of device 0's 2(k-1)K."""
    k = 4
    X, y = _batches(48, 1)[0]
    nets = {name: replicate(lenet(seed=0), get_devices(k)) for name in ("ring", "device 0")}
    for replicas in nets.values():
        for r, xi, yi in zip(replicas, *split_batch(X, y, get_devices(k))):
            (nn.functional.cross_entropy(r(xi), yi, reduction="sum") / len(X)).backward()
    before = [p.grad.clone() for p in nets["ring"][1].parameters()]
    received = _ring_allreduce_grads(nets["ring"])
    allreduce_grads(nets["device 0"])
    check_changed("the ring changed device 1's gradients (they were its part only)",
                  [p.grad for p in nets["ring"][1].parameters()], before)
    for i in range(k):
        check_close(f"device {i}: ring sum == allreduce_grads sum",
                    [p.grad for p in nets["ring"][i].parameters()],
                    [p.grad for p in nets["device 0"][i].parameters()], rtol=1e-5, atol=1e-7)
    K = 4 * count_parameters(lenet())
    print(f"K = {K} bytes; received per device: {received}; 2(k-1)K/k = {2 * (k - 1) * K / k:.0f}")
    check("every device received 2(k-1)K/k bytes (chunks differ by at most one element)",
          all(abs(r - 2 * (k - 1) * K / k) <= 2 * (k - 1) * 4 for r in received))


def exercise_5():
    """Where FLOPs catch up with per-operator costs on the described V100, and 4 GPUs at 4096."""
    gpu, gpus = cm.GPUS["V100, FP32"], cm.MACHINES["4 GPUs, PCIe 3.0"]
    X, y = torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))
    flops, ops = cm.training_work(lenet(), X, y)
    per_example = flops / len(X)
    even = ops * gpu.launch * gpu.rate / per_example
    print(f"{ops} operators x {gpu.launch * 1e6:g} us = {ops * gpu.launch * 1e3:.3f} ms; "
          f"{per_example / 1e6:.2f} MFLOPs per example at {gpu.rate / 1e12:g} TFLOP/s: "
          f"equal at about {even:.0f} examples per GPU")
    check("the crossover is between 500 and 2000 examples per GPU", 500 < even < 2000)
    K, B = 4 * count_parameters(lenet()), 4096
    step = {k: gpu.step_time(per_example * B / k, ops) + cm.allreduce_time("ring", K, k, gpus)
            for k in (1, 4)}   # launches overlap kernels: the longer of the two
    print(f"global batch {B}: one GPU {step[1] * 1e3:.2f} ms, four {step[4] * 1e3:.2f} ms, "
          f"speed-up {step[1] / step[4]:.2f}x")
    check("at 4096 the speed-up is real but below 4 (operators and all-reduce do not shrink)",
          1.5 < step[1] / step[4] < 4)
