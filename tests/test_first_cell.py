"""Every notebook's first code cell: nothing where d2lpar imports, an install where it does not.

On Colab or Kaggle a notebook opened alone has no course package; its first code cell installs it
from the course's repository or from a wheel an instructor hands out (the variable ``COURSE``), with
torch in the course's range and d2l without its stale pins. Everywhere else (``make lab``, the
course's venv, an installed wheel) the cell must do nothing. The cell is the same text in every
notebook; here it runs with ``subprocess.run`` recorded instead of called (no network, < 1 s).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def first_code_cell(notebook: Path) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


def run_cell(source: str, monkeypatch, importable: bool) -> list[list[str]]:
    """Run the cell with d2lpar importable or not; the commands it would have run."""
    calls = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (real_find_spec(name, *a) if importable or name != "d2lpar"
                                          else None))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(list(cmd)))
    exec(compile(source, "<first cell>", "exec"), {})
    return calls


def test_the_same_first_cell_everywhere():
    assert len(NOTEBOOKS) >= 18
    cells = {nb.name: first_code_cell(nb) for nb in NOTEBOOKS}
    reference = cells[NOTEBOOKS[0].name]
    assert reference.startswith("# On Colab, Kaggle"), "the first code cell is not the install cell"
    differ = [name for name, cell in cells.items() if cell != reference]
    assert not differ, f"these notebooks' first code cell differs from 00's: {differ}"
    assert max(map(len, reference.splitlines())) <= 100


def test_it_does_nothing_where_the_course_is_installed(monkeypatch, capsys):
    assert run_cell(first_code_cell(NOTEBOOKS[0]), monkeypatch, importable=True) == []
    assert capsys.readouterr().out == ""


def test_it_installs_in_the_course_range_where_it_is_not(monkeypatch, capsys):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {re.match(r"[\w-]+", r).group(): r for r in project["dependencies"]}
    d2l = re.search(r"^D2L\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    calls = run_cell(first_code_cell(NOTEBOOKS[0]), monkeypatch, importable=False)
    assert len(calls) == 2, calls
    course, d2l_install = calls
    repository = "git+" + project["urls"]["Repository"] + ".git"
    assert course[1:4] == ["-m", "pip", "install"]
    assert wanted["torch"] in course and wanted["torchvision"] in course, course
    assert course[-1] == repository, f"{course[-1]} is not the repository in pyproject.toml"
    assert d2l_install[-2:] == ["--no-deps", d2l]
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("installing") and said[-1] == f"installed d2lpar from {repository}"


def test_the_check_can_fail(monkeypatch):
    # A cell that installs whatever happens would pass a test that only looks at the import branch.
    careless = first_code_cell(NOTEBOOKS[0]).replace(
        'if importlib.util.find_spec("d2lpar") is None:', "if True:")
    assert run_cell(careless, monkeypatch, importable=True) != []
