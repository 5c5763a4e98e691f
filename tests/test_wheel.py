"""The course installed from its wheel, outside the repository, as a second user of the machine.

What a student without the repository gets: the wheel (``pip wheel --no-deps``, built from a copy of
the package so that the build writes nothing into the checkout) installed into a fresh virtual
environment that does not see the checkout. That environment is made with ``venv --without-pip``
and a ``.pth`` file naming this environment's site-packages (torch, nbval, jupyter), which puts
that folder on ``sys.path`` without running its ``.pth`` files, so the checkout's editable install
is not active there; the wheel goes in with ``pip install --no-deps --target``. Notebooks 00 and 07
are copied alone into an empty folder and run there under nbval with the course's sanitizing rules,
``HOME`` in this test's temporary folder and ``D2LPAR_BUILD_DIR`` unset: as user ``nobody`` when
this test runs as root (a second student on a shared server), else as this user.

Checks: d2lpar imports from the new environment, not from the checkout; every checked cell prints
what the committed notebook says; the torchrun command notebook 07 prints can be typed in that
folder (the module form, and an ``--out`` folder that is real there and holds the run's
``last.pt``); the runs wrote into the user's cache folder (``~/.cache/d2lpar``), nothing into the
checkout (as ``nobody``: no file of that user anywhere in the checkout) and nothing beside the
notebooks.

Cost: about 50 s on the course's 2-core machine (wheel 3 s, environment 2 s, notebook 00 15 s,
notebook 07 25 s, checks 3 s).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("nbval", reason="the notebooks run under nbval (pip install -e '.[dev]')")
if sys.platform == "win32":
    pytest.skip("a POSIX virtual environment (bin/python) is built here", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_setup.ipynb", "07_ddp.ipynb"]
NOBODY = 65534
SECOND_USER = NOBODY if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("setpriv") \
    else None
WHY_NOT = "this test runs as a user who cannot switch users (root with setpriv is needed)"

# Loaded into the nbval run with -p: keeps each cell's printed text, for the checks below.
RECORDER = '''
import json, os

def pytest_runtest_teardown(item):
    outputs = getattr(item, "test_outputs", None) or []
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    with open(os.environ["D2LPAR_TEST_OUTPUTS"], "a") as f:
        f.write(json.dumps({"notebook": item.fspath.basename, "text": text}) + "\\n")
'''


def as_user(uid: int | None) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid else []


def base_python(uid: int | None) -> str:
    """A Python of this one's version that ``uid`` can run (this one's own may sit under a home
    folder that user cannot enter)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    probe = "import subprocess, sys; subprocess.run([sys.executable, '-c', ''], check=True)"
    for python in (getattr(sys, "_base_executable", sys.executable), f"/usr/bin/python{version}",
                   f"/usr/local/bin/python{version}"):
        if os.path.exists(python) and subprocess.run(
                [*as_user(uid), python, "-c",
                 f"import sys; assert sys.version.startswith('{version}'); {probe}"],
                capture_output=True, timeout=60).returncode == 0:
            return python
    pytest.skip(f"no Python {version} that user {uid} can run")


def typed_command_problems(printed: str, folder: Path, home: Path) -> list[str]:
    """What is wrong with the first ``$ torchrun ...`` command in ``printed`` when typed in
    ``folder``: a script path instead of the module form, an ``--out`` that is not a real folder
    there with the run's ``last.pt``. [] when it can be typed as it is."""
    found = re.search(r"^\$ (torchrun .*?)(?<!\\)$", printed, re.M | re.S)
    if not found:
        return ["no `$ torchrun ...` line was printed"]
    words = shlex.split(found[1].replace("\\\n", " "))
    problems = []
    module = words[words.index("-m") + 1] if "-m" in words[:-1] else None
    if module != "d2lpar.examples.ddp_torch":
        problems.append(f"not the module form (-m d2lpar.examples.ddp_torch): {found[1]!r}")
    out = words[words.index("--out") + 1] if "--out" in words else None
    if out is None:
        return problems + ["no --out"]
    path = home / out[2:] if out.startswith("~/") else folder / out
    if not (path / "last.pt").is_file():
        problems.append(f"--out {out} is not a folder with last.pt where the command is typed")
    return problems


def test_a_command_typed_elsewhere_is_caught(tmp_path):
    """The check above fails on the command 07 printed when it ran from the checkout."""
    (tmp_path / "home" / ".cache" / "d2lpar" / "07_ddp" / "x").mkdir(parents=True)
    (tmp_path / "home" / ".cache" / "d2lpar" / "07_ddp" / "x" / "last.pt").write_bytes(b"")
    old = ("$ torchrun --standalone --nproc-per-node=2 d2lpar/examples/ddp_torch.py --examples \\\n"
           "    512 --epochs 2 --batch-size 32 --out build/07_ddp/x\n    rank 0 of 2: ...\n")
    assert len(typed_command_problems(old, tmp_path, tmp_path / "home")) == 2
    new = ("$ torchrun --standalone --nproc-per-node=2 -m d2lpar.examples.ddp_torch --examples \\\n"
           "    512 --out ~/.cache/d2lpar/07_ddp/x\n")
    assert typed_command_problems(new, tmp_path, tmp_path / "home") == []


def can_read_this_environment(uid: int | None) -> bool:
    """Whether ``uid`` can read this environment's packages (a checkout inside a home folder of
    mode 700 hides them from every other user): if not, the test runs as this user."""
    torch_init = Path(sysconfig.get_paths()["purelib"]) / "torch" / "__init__.py"
    return uid is None or subprocess.run([*as_user(uid), "test", "-r", str(torch_init)],
                                         timeout=30).returncode == 0


def test_the_wheel_runs_notebooks_from_an_empty_folder():
    place = Path(tempfile.mkdtemp(prefix="d2lpar-wheel-"))  # not pytest's tmp_path: mode 700
    checkout_run = ROOT / "build" / "07_ddp" / "torchrun_2" / "last.pt"
    before = checkout_run.stat().st_mtime_ns if checkout_run.exists() else None
    uid = SECOND_USER if can_read_this_environment(SECOND_USER) else None
    try:
        _wheel_in_a_fresh_environment_from_an_empty_folder(place, uid)
    finally:
        shutil.rmtree(place, ignore_errors=True)
    if uid is None:  # as a second user, no file of theirs in the checkout says more
        after = checkout_run.stat().st_mtime_ns if checkout_run.exists() else None
        assert after == before, "07 run from the empty folder wrote into the checkout's build/"


def test_the_second_user_cannot_write_into_the_checkout():
    """What makes 'nothing in the checkout' above a fact for the second user, not luck."""
    if SECOND_USER is None or not can_read_this_environment(SECOND_USER):
        pytest.skip(f"the wheel test ran as this user, not as a second one: {WHY_NOT}, and "
                    "one who can read this environment's packages")
    trace = ROOT / ".second_user_was_here"
    touch = subprocess.run([*as_user(SECOND_USER), "touch", str(trace)], capture_output=True,
                           text=True, timeout=30)
    trace.unlink(missing_ok=True)
    assert touch.returncode != 0 and "Permission denied" in touch.stderr


def _wheel_in_a_fresh_environment_from_an_empty_folder(place: Path, uid: int | None) -> None:
    src, wheels, student, home = (place / name for name in ("src", "wheel", "student", "home"))
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "d2lpar", src / "d2lpar", ignore=shutil.ignore_patterns("__pycache__"))
    quiet = {"capture_output": True, "text": True}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(wheels), str(src)],
                           timeout=180, **quiet)
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next(wheels.glob("d2lpar-*.whl"))

    venv = place / "venv"
    subprocess.run([base_python(uid), "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([python, "-c", purelib], check=True, timeout=60,
                               **quiet).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "course_environment.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                "--target", str(site), str(wheel)], timeout=180, **quiet)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    student.mkdir()
    home.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, student / name)
    (place / "plugin").mkdir()
    (place / "plugin" / "record_outputs.py").write_text(RECORDER)
    shutil.copy(ROOT / "tests" / "nbval_sanitize.cfg", place / "nbval_sanitize.cfg")
    outputs = place / "outputs.jsonl"
    if uid:
        subprocess.run(["chown", "-R", f"{uid}:{uid}", str(place)], check=True, timeout=60)
        os.chmod(place, 0o755)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": str(place / "plugin"),
           "D2LPAR_TEST_OUTPUTS": str(outputs),
           "PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__ in this environment's site-packages
    where = subprocess.run([*as_user(uid), python, "-c", "import d2lpar; print(d2lpar.__file__)"],
                           cwd=student, env=env, timeout=60, **quiet)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    assert not Path(where.stdout.strip()).is_relative_to(ROOT)

    run = subprocess.run([*as_user(uid), python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "record_outputs", "--nbval-lax", "--nbval-current-env",
                          f"--nbval-sanitize-with={place / 'nbval_sanitize.cfg'}",  # one word:
                          # pytest takes a separate one for a path, and reads the checkout's ini
                          "--nbval-cell-timeout=300", *NOTEBOOKS],
                         cwd=student, env=env, timeout=420, **quiet)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

    printed = [json.loads(line) for line in outputs.read_text().splitlines()]
    ddp = "".join(cell["text"] for cell in printed if cell["notebook"] == "07_ddp.ipynb")
    assert typed_command_problems(ddp, student, home) == []
    assert not re.search(r"(^|\s)build/", ddp), "07 printed a build/ folder that is not there"
    cache = home / ".cache" / "d2lpar"
    written = cache / "07_ddp" / "torchrun_2" / "last.pt"
    assert written.is_file(), f"the run's checkpoint is not in the cache folder {cache}"
    assert sorted(p.name for p in student.iterdir()) == NOTEBOOKS  # nothing beside the notebooks
    if uid:
        assert written.stat().st_uid == uid
        mine = subprocess.run(["find", str(ROOT), "-path", str(ROOT / ".venv"), "-prune", "-o",
                               "-user", str(uid), "-print"], timeout=120, **quiet).stdout
        assert mine == "", f"user {uid} wrote into the checkout:\n{mine}"
