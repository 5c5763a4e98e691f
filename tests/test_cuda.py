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


NCCL_TIMEOUT = r'''
import os, datetime, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=2))
t = torch.ones(1, device="cuda")
torch.cuda._sleep(int(1e11))   # the stream stays busy far past the group's 2 s timeout
dist.all_reduce(t)              # queued behind it: it cannot finish in time
torch.cuda.synchronize()
'''


@pytest.mark.cuda
def test_a_planted_nccl_timeout_is_caught_by_the_watchdog():
    """Notebook 16: with one GPU no peer can hang, so the collective is held back by a long kernel
    on its stream; NCCL's watchdog reports the timed-out all-reduce and ends the process."""
    import subprocess
    env = {**__import__("os").environ, "NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    job = subprocess.run([sys.executable, "-c", NCCL_TIMEOUT], capture_output=True, text=True,
                         timeout=120, env=env)
    text = job.stdout + job.stderr
    print(text[-3000:])
    assert job.returncode != 0
    assert "Watchdog caught collective operation timeout" in text and "ALLREDUCE" in text
    assert "NCCL INFO" in text   # NCCL_DEBUG=INFO's set-up lines


@pytest.mark.cuda
def test_checkpointing_and_bf16_lower_the_peak_on_a_gpu():
    """Notebook 14 on a GPU: the peak allocated memory of a block stack's step falls with
    checkpointing and with bf16 autocast, by about the saved bytes of the formulas."""
    from d2lpar.cost import memory_levers as ML
    from d2lpar.strategies.memory.checkpointing import CheckpointedStack
    from d2lpar.strategies.tensor.blocks import TransformerLayer
    L, b, s, d, heads, hidden = 8, 8, 256, 512, 8, 2048
    peaks = {}
    for mode, dtype in (("none", None), ("full", None), ("none", torch.bfloat16)):
        torch.manual_seed(0)
        stack = CheckpointedStack([TransformerLayer(d, heads, hidden) for _ in range(L)], mode).cuda()
        x = torch.randn(b, s, d, device="cuda", requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = stack(x)
        peaks[mode, dtype] = torch.cuda.max_memory_allocated() - base
        out.float().sum().backward()
    saved = ML.saved_bytes("none", L, b, s, d, heads, hidden) - ML.saved_bytes("full", L, b, s, d, heads, hidden)
    drop = peaks["none", None] - peaks["full", None]
    print(f"peaks {peaks}; checkpointing saves {drop / 2**20:.0f} MiB, formula {saved / 2**20:.0f} MiB")
    assert 0.8 * saved < drop < 1.2 * saved
    assert peaks["none", torch.bfloat16] < 0.75 * peaks["none", None]


@pytest.mark.cuda
def test_fp8_and_bf16_matmul_speed_on_a_gpu():
    """Notebook 14: a large square product in bf16 and in fp8 (needs a GPU with fp8 units)."""
    from d2lpar.strategies.memory import fp8
    n = 8192
    a, w = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    ab, wb = a.bfloat16(), w.bfloat16()
    times = {}
    for name, fn in (("bf16", lambda: ab @ wb), ("fp8", lambda: fp8.fp8_matmul(a, w))):
        fn()
        timer = Timer(torch.device("cuda"))
        timer.start()
        for _ in range(10):
            fn()
        times[name] = timer.stop() / 10
    print(f"bf16 {times['bf16'] * 1e3:.2f} ms, fp8 (with quantising) {times['fp8'] * 1e3:.2f} ms, "
          f"ratio {times['fp8'] / times['bf16']:.2f}")
    assert times["fp8"] > 0 and times["bf16"] > 0
