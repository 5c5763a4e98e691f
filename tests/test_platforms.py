"""Linux-only calls degrade elsewhere with one clear sentence, not an AttributeError (simulated here)."""

import ctypes
import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from d2lpar.processes import commands, rank
from d2lpar.processes import launch as launch_module


def test_commands_without_proc(monkeypatch):
    monkeypatch.setattr(commands, "HAVE_PROC", False)
    monkeypatch.setattr(commands, "_warned", set())
    monkeypatch.setattr(commands, "_started", {"some-tag"})
    with pytest.warns(RuntimeWarning, match="this platform has no /proc, so processes that a "
                                            "command started in a session of their own cannot be found"):
        assert commands.leftovers() == []
    assert commands.descendants() is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert commands.is_alive(os.getpid()) and not commands.is_alive(dead.pid)


def test_commands_without_process_groups(monkeypatch):
    monkeypatch.delattr(os, "killpg")  # Windows
    job = commands.run([sys.executable, "-c", "print('still stopped')"], timeout=30)
    assert job.lines == ["still stopped"] and job.returncode == 0


def test_no_parent_death_signal_off_linux(monkeypatch):
    def no_libc(*args, **kwargs):
        raise OSError("libc.so.6: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    rank._set_parent_death_signal()  # glibc missing: nothing to do, no error
    monkeypatch.setattr(sys, "platform", "darwin")
    rank._set_parent_death_signal()


def test_spawn_where_there_is_no_fork(monkeypatch):
    monkeypatch.setattr(launch_module, "_context", None)
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])
    assert launch_module._forkserver().get_start_method() == "spawn"
