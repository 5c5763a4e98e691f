"""The nbval sanitize file: every rule is read by nbval, and the CPU and GPU outputs of a checked cell
compare equal while a changed claim does not."""

import re
import os
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


def test_plain_pytest_gets_the_course_settings(monkeypatch):
    """An instructor's `pytest --nbval-lax notebooks/` reads the settings from the root conftest.py."""
    import types

    import conftest
    option = types.SimpleNamespace(nbval_sanitize_with=None, nbval_current_env=False,
                                   nbval_cell_timeout=2000)
    registered = []
    manager = types.SimpleNamespace(is_registered=lambda p: False,
                                    register=lambda p, name: registered.append(name))
    conftest.pytest_configure(types.SimpleNamespace(option=option, pluginmanager=manager))
    assert option.nbval_sanitize_with == str(Path(__file__).parent / "nbval_sanitize.cfg")
    assert option.nbval_current_env is True and option.nbval_cell_timeout == 600
    assert registered == ["nbval_durations"]
    assert os.environ["D2LPAR_BUILD_DIR"]  # set for the kernels and ranks the run starts
    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    assert "NBVAL_OPTS := --nbval-lax\n" in makefile, "make test must run what an instructor runs"
