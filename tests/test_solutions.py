"""Every notebook's exercises have worked solutions, and the solutions run.

A notebook's exercises are the numbered items under its "Exercises" heading. Their solutions live
in ``d2lpar/solutions/<notebook stem>.py`` (shipped with the package) as functions ``exercise_1``, ``exercise_2``, ...; each
computes its answer, prints it, and asserts what the answer claims, so a solution that stops being
true fails here. An exercise that needs a GPU says so and its solution runs a CPU variant without one.
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOLUTIONS = ROOT / "d2lpar" / "solutions"


def exercises_section(notebook: Path) -> str:
    """The markdown under the notebook's "Exercises" heading, up to the next heading ('' if none)."""
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    found = re.search(r"^#+\s*Exercises\s*$(.*?)(?=^#+\s|\Z)", text, re.M | re.S)
    return found.group(1) if found else ""


def exercise_count(notebook: Path) -> int:
    """Numbered items in the markdown after the notebook's "Exercises" heading (0 if none)."""
    return len(re.findall(r"^\d+\.\s", exercises_section(notebook), re.M))


def _cases():
    for nb in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        for k in range(1, exercise_count(nb) + 1):
            yield pytest.param(nb.stem, k, id=f"{nb.stem}-{k}")


@pytest.mark.parametrize("notebook", sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_every_notebook_has_exercises_and_a_solution_for_each(notebook):
    count = exercise_count(NOTEBOOKS / f"{notebook}.ipynb")
    assert count >= 1, f"{notebook}: no numbered items under an 'Exercises' heading"
    path = SOLUTIONS / f"{notebook}.py"
    assert path.exists(), f"{notebook}: write its solutions in {path.relative_to(ROOT)}"
    names = sorted(n for n in runpy.run_path(str(path)) if re.fullmatch(r"exercise_\d+", n))
    assert names == sorted(f"exercise_{k}" for k in range(1, count + 1)), \
        f"{notebook}: {count} exercises in the notebook, solutions define {names}"


@pytest.mark.parametrize("notebook", sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")))
def test_every_exercises_section_links_its_solutions_file(notebook):
    link = f"(../d2lpar/solutions/{notebook}.py)"  # relative to notebooks/, as the link is
    assert link in exercises_section(NOTEBOOKS / f"{notebook}.ipynb"), \
        f"{notebook}: its Exercises section should link its worked solutions, as [...]{link}"


def test_solution_command_prints_the_shipped_file(capsys):
    from d2lpar.__main__ import main
    assert main(["solution", "7"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"# {SOLUTIONS / '07_ddp.py'}"
    assert out.split("\n", 1)[1] == (SOLUTIONS / "07_ddp.py").read_text()


LAST = sorted(SOLUTIONS.glob("[0-9][0-9]_*.py"))[-1].name[:2]   # the last notebook with solutions


@pytest.mark.parametrize("number", [f"{int(LAST) + 1:02d}", "x", "1x"])
def test_solution_command_names_the_numbers_it_knows(capsys, number):
    from d2lpar.__main__ import main
    assert main(["solution", number]) == 2
    err = capsys.readouterr().err
    assert err == (f"python -m d2lpar solution: no solutions for notebook {number!r}: "
                   f"give a number from 00 to {LAST}, e.g. 14\n")
    assert len(err.rstrip()) <= 100


_loaded: dict[str, dict] = {}


@pytest.mark.parametrize("notebook,k", list(_cases()))
def test_solution_runs_and_holds(notebook, k):
    if notebook not in _loaded:
        _loaded[notebook] = runpy.run_path(str(SOLUTIONS / f"{notebook}.py"), run_name="solutions")
    _loaded[notebook][f"exercise_{k}"]()
