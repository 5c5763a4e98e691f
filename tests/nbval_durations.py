"""A pytest plugin for the nbval run: print how long each notebook took, in reading order."""

from __future__ import annotations

from collections import defaultdict

_durations: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb"):
        _durations[path] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _durations:
        return
    terminalreporter.section("notebook durations")
    for path in sorted(_durations):
        terminalreporter.write_line(f"{_durations[path]:8.1f} s  {path}")
    terminalreporter.write_line(f"{sum(_durations.values()):8.1f} s  in all")
