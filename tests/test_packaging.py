"""The set-up the README promises: environment.yml agrees with pyproject.toml, CI runs the README's
test command, and the command-line faces work."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}


def _name_and_spec(req: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", req)
    return CONDA_NAMES.get(m.group(1).lower(), m.group(1).lower()), m.group(2).replace(" ", "")


def _environment_yml() -> tuple[dict, dict]:
    conda, pip, in_pip = {}, {}, False
    text = (ROOT / "environment.yml").read_text()
    for line in text[re.search(r"^dependencies:", text, re.M).start():].splitlines():
        if re.match(r"^\s*-\s*pip:\s*$", line):
            in_pip = True
            continue
        m = re.match(r"^(\s*)-\s*(\S.*)$", line)
        if not m:
            continue
        if in_pip and len(m.group(1)) > 4:
            name, spec = _name_and_spec(m.group(2))
            pip[name] = spec
        else:
            in_pip = False
            req = m.group(2)
            if re.match(r"^[\w\-]+=[^=]", req):  # conda's "python=3.11" is pip's "python==3.11"
                req = req.replace("=", "==", 1)
            name, spec = _name_and_spec(req)
            conda[name] = spec
    return conda, pip


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = dict(_name_and_spec(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"])
    conda, pip = _environment_yml()
    conda.pop("python"), conda.pop("pip")
    assert set(conda) | set(pip) == set(wanted), "environment.yml and pyproject.toml list different packages"
    for name, spec in conda.items():
        assert spec == wanted[name], f"{name}: {spec!r} in environment.yml, {wanted[name]!r} in pyproject"


def test_torch_pins_agree():
    makefile = (ROOT / "Makefile").read_text()
    _, pip = _environment_yml()
    for name in ["torch", "torchvision"]:
        pinned = re.search(rf"\b{name}==([\d.]+)", makefile).group(1)
        assert pip[name] == f"=={pinned}", f"{name}: Makefile pins {pinned}, environment.yml {pip[name]}"
    project = (ROOT / "pyproject.toml").read_text()
    assert "torch>=2.14,<=2.14.1" in project, "never require a torch newer than the one CI installs"
    d2l = re.search(r"D2L\s*:=\s*(\S+)", makefile).group(1)
    assert d2l in (ROOT / "environment.yml").read_text() and d2l in (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^make test$", ci, re.M)
    assert "make lab" in readme


def test_every_notebook_is_in_the_course_map():
    readme = (ROOT / "README.md").read_text()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert nb.name in readme, f"{nb.name} is missing from the README's course map"


def test_info_command():
    out = subprocess.run([sys.executable, "-m", "d2lpar", "info"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "CPU cores" in out and "torch.distributed backends" in out


def test_launch_benchmark_prints_its_ratio():
    out = subprocess.run([sys.executable, "-m", "d2lpar", "bench", "launch", "--ranks", "2",
                          "--repeats", "1", "--tail", "5"], capture_output=True, text=True,
                         timeout=240, check=True).stdout
    assert re.search(r"5 warm launches of 4 ranks: median \d\.\d{3} s, 95th percentile \d\.\d{3} s, "
                     r"maximum \d\.\d{3} s", out)
    assert re.search(r"ratio d2lpar.processes.launch / mp.spawn for N = 2: \d+\.\d+$", out.strip())
