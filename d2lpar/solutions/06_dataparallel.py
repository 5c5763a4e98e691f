"""Worked solutions to the exercises of notebook 06 (``nn.DataParallel``).

Each ``exercise_k`` computes its answer, prints it and asserts what it claims. Exercise 3 times real
GPUs when there are two or more, and otherwise predicts from a described GPU (its CPU variant).
"""

from __future__ import annotations

import runpy
import time

import torch
from torch import nn

from d2lpar.cost import costmodel as cm
from d2lpar.infra.check import check, check_close, check_equal
from d2lpar.infra.devices import get_devices, gpu_count
from d2lpar.infra.models import count_parameters, lenet, small_resnet
from d2lpar.infra.paths import build_dir
from d2lpar.strategies.data.data_parallel import balanced_sizes
from d2lpar.strategies.data.nn_dataparallel import (SimulatedDataParallel, best_gpu0_bsz,
                                               memory_per_device, phases_per_step)

torch.set_num_threads(1)
MiB = 2**20
# The ResNet-50 of section 4 (224 x 224 images): measured there, rounded here so that no solution
# has to build it again.
RESNET50 = {"P": int(97.5 * MiB), "a": int(82.3 * MiB), "o": 4000}


def exercise_1():
    """No optimizer state: device 0 loses its extra 2P, so its share grows back to an even split;
    huge outputs (a language model's logits) push it down to the minimum."""
    B, k = 64, 4
    best = {slots: best_gpu0_bsz(B, k, **RESNET50, optimizer_slots=slots) for slots in (2, 1, 0)}
    print(f"ResNet-50, batch {B} on {k} devices: best gpu0_bsz by optimizer slots {best}")
    check("fewer optimizer slots: device 0 takes more examples", best[2] < best[1] < best[0])
    check_equal("plain SGD: the even share", best[0], B // k)
    # A GPT-2-sized language model: 50257 logits per token, 1024 tokens per example, fp32.
    lm = dict(RESNET50, o=50257 * 1024 * 4)
    g = best_gpu0_bsz(B, k, **lm, optimizer_slots=0)
    rows = memory_per_device(balanced_sizes(B, k, g), **lm, optimizer_slots=0)
    print(f"outputs of {lm['o'] / MiB:.0f} MiB per example: best gpu0_bsz = {g}; device 0 then holds "
          f"{rows[0]['outputs'] / 2**30:.1f} GB of gathered outputs, device 1 {rows[1]['outputs'] / 2**30:.1f} GB")
    check("large outputs: device 0 gets a single example and is still the largest", g == 1
          and rows[0]["total"] == max(r["total"] for r in rows))
    print("The 2oB of gathered outputs (and their gradients) sit on device 0 whatever its share: no "
          "split fixes that; compute the loss on every device instead (DDP does).")


def exercise_2():
    """Gathering on the last device moves the outputs' 2oB there; parameters, reduced gradients and
    optimizer state stay on device_ids[0], where the module lives."""
    devices = get_devices(3)
    X = torch.rand(12, 1, 28, 28)
    wrapped = SimulatedDataParallel(lenet(seed=0), devices, output_device=devices[-1])
    out = wrapped(X)
    print("\n".join(wrapped.trace))
    check("the outputs are gathered on the last device", wrapped.trace[-1].endswith(f"on {devices[-1]}"))
    check_close("and are still the module's outputs", out.cpu(), lenet(seed=0)(X))
    P, a, o = (RESNET50[x] for x in "Pao")
    s, b = 2, 16
    B = 3 * b
    first = P * (2 + s) + (a + o) * b
    last = 2 * P + (a + o) * b + 2 * o * B
    print("mem_0 = P(2 + s) + (a + o) b_0;  mem_last = 2P + (a + o) b_last + 2oB;  others 2P + (a + o) b_i")
    print(f"ResNet-50, 16 examples each: device 0 {first / MiB:.0f} MiB, the last device {last / MiB:.0f} MiB")
    check("with s >= 1 and small outputs device 0 is still the largest", first > last)


def _predict(model_fn, batch, k, gpus):
    X, y = torch.rand(batch // k, 1, 28, 28), torch.randint(0, 10, (batch // k,))
    flops_part, ops = cm.training_work(model_fn(), X, y)  # one device's share; FLOPs grow with the batch
    flops_one = flops_part * k
    gpu, link = cm.GPUS["V100, FP32"], gpus.device_link
    P = 4 * count_parameters(model_fn())
    phases = phases_per_step(P, k, batch * 28 * 28 * 4, batch * 10 * 4)
    on_link = sum(link.time(b) for _, b in phases["DataParallel"])   # its phases run in sequence
    return gpu.step_time(flops_one, ops), gpu.step_time(flops_part, ops) + on_link


def _time_on_gpus(model_fn, batch, k):
    X, y = torch.rand(batch, 1, 28, 28, device="cuda"), torch.randint(0, 10, (batch,), device="cuda")
    result = {}
    for name, net in (("one GPU", model_fn().cuda()),
                      ("DataParallel", nn.DataParallel(model_fn().cuda(), device_ids=list(range(k))))):
        for i in range(13):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            nn.functional.cross_entropy(net(X), y).backward()
        torch.cuda.synchronize()
        result[name] = (time.perf_counter() - t0) / 10
    return result["one GPU"], result["DataParallel"]


def exercise_3():
    """LeNet is too small: per-step copies through device 0 cost more than the compute saved.
    A (small) ResNet has enough compute per example for DataParallel to help."""
    k, batch = (min(4, gpu_count()) if gpu_count() >= 2 else 4), 256
    gpus = cm.with_devices(cm.MACHINES["4 GPUs, PCIe 3.0"], k)
    measured = gpu_count() >= 2
    print(f"{'measured on ' + str(k) + ' GPUs' if measured else 'no 2 GPUs here: predicted for ' + str(k) + ' V100s on PCIe 3.0'}")
    speedups = {}
    for name, fn in (("LeNet", lenet), ("small_resnet", small_resnet)):
        one, dp = (_time_on_gpus if measured else _predict)(fn, batch, k, *([] if measured else [gpus]))
        speedups[name] = one / dp
        print(f"{name:<13} one GPU {one * 1e3:7.3f} ms, DataParallel on {k}: {dp * 1e3:7.3f} ms "
              f"({speedups[name]:.2f}x)")
    if not measured:  # the prediction's claims; measured GPUs are allowed to disagree, and say so
        check("predicted: DataParallel slows LeNet down", speedups["LeNet"] < 1)
        check("predicted: DataParallel speeds small_resnet up", speedups["small_resnet"] > 1)
    print("DataParallel pays replicate + scatter + gather + reduce through device 0 on every step; it "
          "helps only when each device's compute is larger than that (and than the per-operator costs).")


TEMPLATE_EXTRA = '''
import argparse

import torch
from torch import nn

from d2lpar.infra.data import load_data
from d2lpar.infra.devices import add_device_args, describe, devices_from_args
from d2lpar.infra.models import lenet


def main(argv=None):
    parser = argparse.ArgumentParser(description="train on the GPUs you choose, or on the CPU")
    add_device_args(parser)                      # --devices 0,3   --cpu
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args(argv)
    devices = devices_from_args(args)
    print("running on", describe(devices))
    torch.manual_seed(args.seed)                 # the model and the data order follow --seed
    net = lenet(seed=args.seed).to(devices[0])
    if len(devices) > 1:
        net = nn.DataParallel(net, device_ids=[d.index for d in devices], output_device=devices[0])
    train_iter, test_iter = load_data("digits", batch_size=args.batch_size)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    for X, y in train_iter:
        X, y = X.to(devices[0]), y.to(devices[0])
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    with torch.no_grad():
        right = sum((net(X.to(devices[0])).argmax(1) == y.to(devices[0])).sum().item() for X, y in test_iter)
    accuracy = right / len(test_iter.dataset)
    print(f"one epoch, lr {args.lr}, seed {args.seed}: test accuracy {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    main()
'''


def exercise_4():
    """The template with --seed and --lr, training one epoch on the digits (run in this process)."""
    script = build_dir("scripts") / "choose_devices_train.py"
    script.write_text(TEMPLATE_EXTRA)
    main = runpy.run_path(str(script))["main"]
    argv = ["--cpu", "--seed", "0", "--lr", "0.05", "--batch-size", "16"]
    first, again = main(argv), main(argv)
    check("one epoch learns (test accuracy well above chance, 0.1)", first > 0.5, f"accuracy {first:.3f}")
    check_equal("the same --seed gives the same run", again, first)
    print(f"(written to {script.relative_to(build_dir()).as_posix()} in the build folder; "
          f"run it as: python {script.name} {' '.join(argv)})")
