"""nn.DataParallel's four steps by hand, its memory per device, and the module. prefix."""

import pytest
import torch
from torch import nn

from d2lpar.strategies.data import nn_dataparallel as ndp
from d2lpar.infra.check import check_changed, check_close
from d2lpar.strategies.data.data_parallel import balanced_sizes
from d2lpar.infra.devices import get_devices
from d2lpar.infra.models import lenet


def test_simulated_dataparallel_matches_the_plain_module_in_value_and_gradient():
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    plain, wrapped_net = lenet(seed=3), lenet(seed=3)
    wrapped = ndp.SimulatedDataParallel(wrapped_net, get_devices(3), gpu0_bsz=2)
    nn.functional.cross_entropy(plain(X), y).backward()
    out = wrapped(X)
    nn.functional.cross_entropy(out, y).backward()
    check_close("outputs", out, plain(X))
    check_changed("gradients are not zero", {k: p.grad for k, p in wrapped_net.named_parameters()},
                  {k: torch.zeros_like(p) for k, p in wrapped_net.named_parameters()})
    check_close("gradients", {k: p.grad for k, p in wrapped_net.named_parameters()},
                {k: p.grad for k, p in plain.named_parameters()}, rtol=1e-4, atol=1e-6)
    assert len(wrapped.trace) == 4 and "(2, 1, 28, 28)" in wrapped.trace[0]


def test_module_prefix_and_unwrap():
    net = lenet(seed=0)
    for wrapper in (nn.DataParallel(net), ndp.SimulatedDataParallel(net, get_devices(2))):
        keys = list(wrapper.state_dict())
        assert all(k.startswith("module.") for k in keys)
        assert ndp.strip_module_prefix(wrapper.state_dict()).keys() == net.state_dict().keys()
        assert ndp.unwrap(wrapper) is net
    fresh = lenet(seed=5)
    with pytest.raises(RuntimeError, match="module."):
        fresh.load_state_dict(nn.DataParallel(net).state_dict())
    fresh.load_state_dict(ndp.strip_module_prefix(nn.DataParallel(net).state_dict()))
    check_close("loaded", fresh, net)


def test_balanced_dataparallel_on_cpu_just_calls_the_module():
    net = lenet(seed=0)
    X = torch.rand(4, 1, 28, 28)
    wrapped = ndp.BalancedDataParallel(2, net, dim=0)
    if not torch.cuda.is_available():
        check_close("BalancedDataParallel on CPU", wrapped(X), net(X))
    with pytest.raises(ValueError, match="at least one"):
        ndp.BalancedDataParallel(0, net)


def test_device_zero_holds_most_and_balancing_helps():
    net, X = lenet(seed=0), torch.rand(2, 1, 28, 28)
    sizes = ndp.model_bytes(net, X)
    assert sizes["P"] == 4 * sum(p.numel() for p in net.parameters()) and sizes["o"] == 40
    assert sizes["a"] > 6 * 28 * 28 * 4  # at least the first convolution's output
    even = ndp.memory_per_device([8, 8, 8, 8], **sizes)
    assert even[0]["total"] > max(r["total"] for r in even[1:])
    assert even[0]["total"] - even[1]["total"] == sizes["P"] + 2 * 40 * 32
    g = ndp.best_gpu0_bsz(32, 4, **sizes)
    balanced = ndp.memory_per_device(balanced_sizes(32, 4, g), **sizes)
    assert g < 8 and max(r["total"] for r in balanced) < even[0]["total"]


def test_traffic_counts_both_directions_the_same_way():
    P, k, X, Y = 4_000_000, 4, 1_000_000, 10_000
    t = ndp.traffic_per_step(P, k, X, Y)
    ring = 2 * 3 * P // 4
    assert t["DDP"] == {"every device": (ring, ring + X // 4)}                # its own X/k too
    s = 3 * X // 4, 3 * Y // 4
    assert t["DataParallel"]["device 0"] == (P + s[0] + s[1], P + s[1] + X)   # NCCL: P each way
    assert t["DataParallel"]["another device"] == (2 * P + Y // 4, 2 * P + X // 4 + Y // 4)
    slow = ndp.traffic_per_step(P, k, X, Y, nccl=False)
    assert slow["DataParallel"]["device 0"] == (3 * P + s[0] + s[1], 3 * P + s[1] + X)
    host = ndp.traffic_per_step(P, k, X, Y, inputs_from_host=True)
    assert host["DataParallel"]["device 0"] == (P + s[1], P + s[1] + X // 4)
    assert ndp.busiest(t["DataParallel"]) == 2 * P + X // 4 + Y // 4   # a relay in the chain
    assert ndp.busiest(t["DDP"]) == ring + X // 4
    two = ndp.traffic_per_step(P, 2, X, Y)["DataParallel"]["another device"]
    assert two == (P + Y // 2, P + X // 2 + Y // 2)                           # end of the chain


def test_simulated_counts_match_the_no_nccl_formula():
    net = lenet(seed=0)
    devices = [torch.device("cpu", i) for i in range(4)]
    wrapped = ndp.SimulatedDataParallel(net, devices)
    X = torch.rand(16, 1, 28, 28)
    out = wrapped(X)
    P = 4 * sum(p.numel() for p in net.parameters())
    t = ndp.traffic_per_step(P, 4, X.numel() * 4, out.numel() * 4, nccl=False)
    assert wrapped.moved["replicate"] == 3 * P
    assert wrapped.moved["scatter"] == 3 * X.numel() * 4 // 4
    assert wrapped.moved["gather"] == 3 * out.numel() * 4 // 4
    sent = t["DataParallel"]["device 0"][0]
    assert sent == wrapped.moved["replicate"] + wrapped.moved["scatter"] + wrapped.moved["gather"]


def test_phases_add_for_dataparallel():
    P, k, X, Y = 4_000_000, 4, 1_000_000, 10_000
    ph = ndp.phases_per_step(P, k, X, Y)
    s_x, s_y = 3 * X // 4, 3 * Y // 4
    assert [b for _, b in ph["DataParallel"]] == [X, P + s_x, s_y, s_y, P]
    assert [b for _, b in ph["DDP"]] == [X // 4, 2 * 3 * P // 4]
    slow = ndp.phases_per_step(P, k, X, Y, nccl=False)["DataParallel"]
    assert [b for _, b in slow] == [X, 3 * P + s_x, s_y, s_y, 3 * P]
    host = ndp.phases_per_step(P, k, X, Y, inputs_from_host=True)["DataParallel"]
    assert [b for _, b in host] == [X // 4, P, s_y, s_y, P]


def test_simulated_splits_as_torch_does():
    assert ndp.torch_chunk_sizes(10, 4) == [3, 3, 3, 1]
    assert ndp.torch_chunk_sizes(5, 4) == [2, 2, 1]
    assert ndp.torch_chunk_sizes(12, 3) == [4, 4, 4]
    net = lenet(seed=0)
    wrapped = ndp.SimulatedDataParallel(net, get_devices(4))
    X = torch.rand(5, 1, 28, 28)
    check_close("5 examples on 4 simulated devices", wrapped(X), lenet(seed=0)(X))
    assert "(1 device(s) unused)" in wrapped.trace[0]


def test_simulated_counts_the_backward_bytes():
    net = lenet(seed=0)
    wrapped = ndp.SimulatedDataParallel(net, get_devices(4))
    out = wrapped(torch.rand(16, 1, 28, 28))
    assert wrapped.moved["reduce"] == wrapped.moved["output gradients"] == 0
    out.sum().backward()
    P = 4 * sum(p.numel() for p in net.parameters())
    assert wrapped.moved["reduce"] == 3 * P
    assert wrapped.moved["output gradients"] == wrapped.moved["gather"] == 3 * out.numel()


def test_balanced_scatter_is_the_classs_own():
    from unittest import mock
    from torch.nn.parallel._functions import Scatter
    wrapped = ndp.BalancedDataParallel(2, lenet(seed=0), dim=0)
    with mock.patch.object(Scatter, "apply", lambda ids, sizes, dim, x: x.split(list(sizes), dim)):
        inputs, kwargs = wrapped.scatter((torch.rand(12, 3), 7), {"a": 1}, [0, 1, 2])
    assert [len(a[0]) for a in inputs] == [2, 5, 5] and [a[1] for a in inputs] == [7] * 3
    assert kwargs == [{"a": 1}] * 3


def test_balanced_scatter_batch_smaller_than_devices():
    from unittest import mock
    from torch.nn.parallel._functions import Scatter
    wrapped = ndp.BalancedDataParallel(2, lenet(seed=0), dim=0)
    with mock.patch.object(Scatter, "apply", lambda ids, sizes, dim, x: x.split(list(sizes), dim)):
        inputs, kwargs = wrapped.scatter((torch.rand(2, 3),), {}, [0, 1, 2])
    assert [len(a[0]) for a in inputs] == [1, 1] and len(kwargs) == 2
