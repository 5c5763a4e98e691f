"""The nbval sanitize file: every rule is read by nbval, and the CPU and GPU outputs of a checked cell
compare equal while a changed claim does not."""

import re
from pathlib import Path

from nbval.plugin import get_sanitize_patterns

CFG = (Path(__file__).parent / "nbval_sanitize.cfg").read_text()


def _sanitize(text: str) -> str:
    for regex, replace in get_sanitize_patterns(CFG):
        text = re.sub(regex, replace, text)
    return text


def test_every_rule_is_read_by_nbval():
    sections = re.findall(r"^\[.+\]$", CFG, re.M)
    assert len(get_sanitize_patterns(CFG)) == len(sections)


def test_cpu_and_gpu_outputs_compare_equal():
    cpu = ("Asked for 2 devices, found 0 GPU(s): simulating 2 devices on the CPU (cpu:0 .. cpu:1). "
           "Results are exact; timings are not those of 2 GPUs.\n"
           "2 simulated device(s) on the CPU: cpu:0, cpu:1\nOK  step took 0.1234 sec\n")
    gpu = "2 device(s): cuda:0, cuda:1\nOK  step took 1.5 ms\n"
    assert _sanitize(cpu) == _sanitize(gpu)
    assert _sanitize("OK  a claim\n") != _sanitize("OK  another claim\n")
