"""The course's CUDA paths, run by ``make gpu`` on a machine with a GPU (skipped without one), and
``make gpu`` itself, whose report is checked here with stand-in parts."""

import sys

import pytest
import torch

from d2lpar import gpu_report
from d2lpar.infra.check import check_close
from d2lpar.infra.timing import Timer


def test_make_gpu_without_cuda_says_so_and_succeeds(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_report.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out


def test_make_gpu_prints_a_line_per_part_and_writes_the_report(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("D2LPAR_BUILD_DIR", str(tmp_path))
    monkeypatch.setattr(gpu_report, "PARTS", {
        "fine": [sys.executable, "-c", "print('3 passed')"],
        "broken": [sys.executable, "-c", "import sys; print('1 failed'); sys.exit(1)"]})
    assert gpu_report.main([]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("fine") and "passed" in out[0] and out[0].endswith("3 passed")
    assert out[1].startswith("broken") and "FAILED (exit 1)" in out[1]
    report = (tmp_path / "gpu" / "report.md").read_text()
    assert "## fine: passed" in report and "## broken: FAILED (exit 1)" in report


@pytest.mark.cuda
def test_a_cuda_timer_waits_for_the_queue():
    x = torch.randn(4096, 4096, device="cuda")
    t = Timer("cuda")
    for _ in range(10):
        x = x @ x / 64
    assert t.stop() > 1e-4   # the matmuls ran inside the timed span, not after it


@pytest.mark.cuda
def test_the_launcher_picks_nccl_with_a_gpu_per_rank():
    from d2lpar.processes.launch import choose_backend, launch
    assert choose_backend(1)[0] == "nccl"

    def worker():
        import torch.distributed as dist
        t = torch.ones(3, device="cuda")
        dist.all_reduce(t)
        return t.cpu()

    check_close("an NCCL all-reduce on one rank", launch(worker, 1)[0], torch.ones(3))


@pytest.mark.cuda
def test_a_model_gives_the_same_output_on_the_gpu():
    from d2lpar.infra.models import lenet
    net, X = lenet(seed=0), torch.rand(8, 1, 28, 28)
    check_close("LeNet on cuda", net.to("cuda")(X.to("cuda")).cpu(), lenet(seed=0)(X),
                rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_dataparallel_on_the_gpus_gives_one_device_s_output():
    from torch import nn
    from d2lpar.infra.models import lenet
    X = torch.rand(8, 1, 28, 28)
    wrapped = nn.DataParallel(lenet(seed=0).to("cuda"))
    check_close("nn.DataParallel on every visible GPU", wrapped(X.to("cuda")).cpu(), lenet(seed=0)(X),
                rtol=1e-4, atol=1e-5)
