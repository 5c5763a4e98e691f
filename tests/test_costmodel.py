"""The cost model: the alpha-beta formulas, the fit to measurements, the described machines."""

import math

import pytest

from d2lpar.cost import costmodel as cm
from d2lpar.comm.collectives import ring_rank_formula
from d2lpar.comm.param_server import ps_server_formula

PCIE = cm.MACHINES["4 GPUs, PCIe 3.0"]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bandwidth_terms_follow_the_byte_formulas(n):
    K = 256e6
    m = cm.Machine("no latency", n, cm.Link(10e9, 0.0), reduce_bandwidth=math.inf)
    assert cm.allreduce_time("one_device", K, n, m) == pytest.approx(ps_server_formula(K, n) / 10e9)
    assert cm.allreduce_time("ring", K, n, m) == pytest.approx(ring_rank_formula(K, n) / 10e9)
    assert cm.allreduce_time("sharded", K, n, m) == cm.allreduce_time("ring", K, n, m)


def test_latency_counts_once_per_round():
    m = cm.Machine("latency only", 4, cm.Link(math.inf, 1e-5), reduce_bandwidth=math.inf)
    assert cm.allreduce_time("ring", 1e6, 4, m) == pytest.approx(6e-5)
    assert cm.allreduce_time("one_device", 1e6, 4, m) == pytest.approx(6e-5)


def test_ring_wins_for_large_messages_and_many_devices():
    for machine in cm.MACHINES.values():
        n = machine.devices
        big = 64 << 20
        t = {s: cm.allreduce_time(s, big, n, machine) for s in cm.STRATEGIES}
        assert t["ring"] < t["one_device"] and t["ring"] < t["through_cpu"], machine.name
    nvlink, pcie = cm.MACHINES["8 GPUs, NVSwitch"], cm.MACHINES["8 GPUs, PCIe 4.0"]
    assert cm.allreduce_time("ring", 1 << 26, 8, nvlink) < cm.allreduce_time("ring", 1 << 26, 8, pcie)


def test_one_device_grows_linearly_with_n_and_ring_does_not():
    times = [cm.allreduce_time("one_device", 1 << 28, n, PCIE) for n in (2, 4, 8)]
    assert times[2] / times[0] > 6
    ring = [cm.allreduce_time("ring", 1 << 28, n, PCIE) for n in (2, 4, 8)]
    assert ring[2] / ring[0] < 2


def test_fit_link_recovers_alpha_and_beta():
    alpha, beta = 50e-6, 2e9
    sizes = [1 << k for k in range(10, 25, 2)]
    link = cm.fit_link(sizes, [alpha + s / beta for s in sizes])
    assert link.bandwidth == pytest.approx(beta, rel=1e-6)
    assert link.latency == pytest.approx(alpha, rel=1e-6)
    with pytest.raises(ValueError, match="larger messages"):
        cm.fit_link([1, 2], [1.0, 0.5])


def test_shared_cores_slow_concurrent_messages():
    here = cm.this_machine(cm.Link(1e9, 0.0), reduce_bandwidth=math.inf)
    assert here.host_link is None and cm.allreduce_time("through_cpu", 1e6, 2, here) is None
    two = cm.Machine("2 cores", 4, cm.Link(1e9, 0.0), math.inf, cores=2)
    gpus = cm.Machine("gpus", 4, cm.Link(1e9, 0.0), math.inf)
    ring = cm.allreduce_time("ring", 1e8, 4, gpus)
    assert cm.allreduce_time("ring", 1e8, 4, two) == pytest.approx(4 * ring)


def test_predict_rows_and_errors():
    rows = cm.predict(PCIE, [1 << 20, 1 << 24], [2, 4])
    assert len(rows) == 4 and set(cm.STRATEGIES) <= set(rows[0])
    assert cm.allreduce_time("ring", 1e6, 1, PCIE) == 0.0
    with pytest.raises(ValueError, match="strategy"):
        cm.allreduce_time("tree", 1e6, 4, PCIE)
    assert cm.measure_reduce_bandwidth(1 << 20, repeats=2) > 1e7
    assert cm.with_devices(PCIE, 8).devices == 8


def test_gpu_compute_counts_operators_and_flops_and_scales_with_the_batch():
    import torch
    from torch import nn

    from d2lpar.infra.models import lenet
    net = nn.Linear(100, 10, bias=False)  # one matrix product: 2*B*100*10 forward, the same backward
    X, y = torch.rand(8, 100), torch.randint(0, 10, (8,))
    assert net.weight.grad is None
    flops, ops = cm.training_work(net, X, y)
    assert flops == 2 * (2 * 8 * 100 * 10) and net.weight.grad is not None  # no input grad needed
    full, n_full = cm.training_work(lenet(), torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,)))
    quarter, n_quarter = cm.training_work(lenet(), torch.rand(16, 1, 28, 28), torch.randint(0, 10, (16,)))
    assert full == pytest.approx(4 * quarter) and n_full == n_quarter > 20  # operators do not shrink
    gpu = cm.Gpu("test", rate=1e12, launch=1e-5)
    assert gpu.time(2e12, 3) == pytest.approx(2 + 3e-5)
    assert cm.GPUS["V100, FP32"].time(0, 10) == pytest.approx(10 * cm.GPUS["V100, FP32"].launch)
    assert gpu.step_time(2e12, 3) == pytest.approx(2)          # the FLOPs hide the launches
    assert gpu.step_time(1e6, 3) == pytest.approx(3e-5)        # the launches starve the GPU
    assert gpu.step_time(2e12, 3) < gpu.time(2e12, 3)
