import argparse

import pytest
import torch

from d2lpar.infra import devices
from d2lpar.infra.devices import DeviceError


@pytest.fixture
def no_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_simulated_devices_when_there_are_too_few_gpus(no_gpus, capsys, monkeypatch):
    monkeypatch.setattr(devices, "_announced", set())  # other tests may have had the notice said
    devs = devices.get_devices(3)
    assert devs == [torch.device("cpu", i) for i in range(3)]
    assert all(devices.is_simulated(d) for d in devs)
    assert "simulating 3 devices on the CPU" in capsys.readouterr().out
    devices.get_devices(3)
    assert capsys.readouterr().out == "", "the simulation notice is said once"
    devices.get_devices(1)
    assert "Asked for a device, found 0 GPU(s): simulating a device on the CPU (cpu:0)" in capsys.readouterr().out


def test_simulated_device_holds_tensors(no_gpus):
    d = devices.get_devices(2)[1]
    x = torch.ones(3, device=d) * 2
    assert x.sum().item() == 6


def test_real_gpus_first(two_gpus):
    assert devices.get_devices(2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert devices.get_devices() == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert devices.try_gpu(1) == torch.device("cuda", 1)
    assert devices.try_gpu(2) == torch.device("cpu")


def test_no_simulation_asked(no_gpus):
    with pytest.raises(DeviceError, match="has 0"):
        devices.get_devices(2, simulate=False)
    assert devices.get_devices() == [torch.device("cpu")]


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_counts(no_gpus, bad):
    with pytest.raises(DeviceError, match="whole number"):
        devices.get_devices(bad)


def test_cuda_visible_devices_naming_no_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA stopped at the bad entry
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,7")
    with pytest.raises(DeviceError, match="names 2 device.*nvidia-smi"):
        devices.gpu_count()


def test_cuda_visible_devices_that_hide_every_gpu_are_fine(no_gpus, monkeypatch):
    for spec in ["", "-1"]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
        assert devices.gpu_count() == 0


@pytest.mark.parametrize("spec,message", [
    ("gpu0", "not a device"), ("cuda:2", "does not exist"), ("cuda:x", "not a device")])
def test_bad_device_strings(two_gpus, spec, message):
    with pytest.raises(DeviceError, match=message):
        devices.parse_device(spec)


def test_device_strings(two_gpus):
    assert devices.parse_device("cuda:1") == torch.device("cuda", 1)
    assert devices.parse_device(0) == torch.device("cuda", 0)
    assert devices.parse_device(" CPU ") == torch.device("cpu")


def test_cuda_asked_on_a_cpu_machine(no_gpus):
    with pytest.raises(DeviceError, match="has none"):
        devices.parse_device("cuda")


def test_device_flags(two_gpus):
    parser = devices.add_device_args(argparse.ArgumentParser())
    pick = lambda *a: devices.devices_from_args(parser.parse_args(list(a)))
    assert pick() == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert pick("--devices", "1") == [torch.device("cuda", 1)]
    assert pick("--cpu") == [torch.device("cpu")]
    with pytest.raises(DeviceError, match="does not exist"):
        pick("--devices", "0,3")
    with pytest.raises(DeviceError, match="indices separated by commas"):
        pick("--devices", "zero")


def test_describe(no_gpus):
    assert devices.describe(devices.get_devices(2)) == "2 simulated device(s) on the CPU: cpu:0, cpu:1"


def test_the_simulation_notice_fits_in_100_columns_and_nbval_drops_it(no_gpus, capsys, monkeypatch):
    import re
    from pathlib import Path

    from nbval.plugin import get_sanitize_patterns

    monkeypatch.setattr(devices, "_announced", set())
    devices.get_devices(4)
    notice = capsys.readouterr().out
    assert notice.count("\n") == 2 and max(len(line) for line in notice.splitlines()) < 100
    text = notice + "OK  a check\n"
    for regex, replace in get_sanitize_patterns((Path(__file__).parent / "nbval_sanitize.cfg").read_text()):
        text = re.sub(regex, replace, text)
    assert text == "OK  a check\n"


def test_one_gpu_as_on_colab_or_kaggle(monkeypatch, capsys):
    """One GPU (Colab, Kaggle): one device asked for is the GPU; more are simulated on the CPU; one
    rank gets NCCL, several share the CPU through gloo (as the README's Colab section says)."""
    from d2lpar.processes.launch import choose_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_announced", set())
    assert devices.get_devices() == [torch.device("cuda", 0)]
    assert devices.get_devices(1) == [torch.device("cuda", 0)]
    assert devices.get_devices(2) == [torch.device("cpu", 0), torch.device("cpu", 1)]
    assert "found 1 GPU(s): simulating 2 devices on the CPU" in capsys.readouterr().out
    assert choose_backend(1)[0] == "nccl"
    backend, reason = choose_backend(2)
    assert backend == "gloo" and "2 ranks but 1 GPU(s)" in reason
