"""Checked cells print the same on every CPU: no decimal numbers in their committed outputs.

nbval compares the output of every cell marked ``# NBVAL_CHECK_OUTPUT`` with the committed one, so
such a cell may print only what every correct run prints identically: check lines, integers, exact
values. A decimal number there (a loss, a ratio, a MiB figure) is one a run on another CPU could
print differently: other matmul kernels round an fp16 loss of 1.31026 to 1.3102 where the committed
notebook says 1.3103. The rule is strict and simple, read from the committed outputs (stream text
and the text/plain of results and displays, after nbval's own sanitizing, which turns timings into
TIME): no decimal numbers. Not numbers in this sense: version strings with two dots (2.14.1), digits
inside identifiers and paths (layers.0.weight), and the tolerance a check line states (rtol=0.0001).
The one exception is a cell whose source has a line ``# NBVAL_EXACT: <why>`` saying why its decimals
are the same on every CPU: pure arithmetic on integers or Python floats from a formula or a literal,
never a tensor's value, anything from a matmul or in low precision, or a timing. Measured numbers go
to an unchecked cell after the checked one.

Cost: about 0.2 s (reads the notebooks' JSON; runs nothing).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHECKED = "# NBVAL_CHECK_OUTPUT"
EXACT = re.compile(r"^\s*# NBVAL_EXACT:(.*)$", re.M)
# nbval reads its sanitize file with this regex (nbval.plugin.get_sanitize_patterns); importing
# nbval here would cost a second
SANITIZE = re.findall(r"^regex: (.*)$\n^replace: (.*)$",
                      (Path(__file__).parent / "nbval_sanitize.cfg").read_text(), flags=re.M)
NOT_NUMBERS = [re.compile(r"\b[ra]tol=\S+"),            # a check's stated tolerance
               re.compile(r"\d+(?:\.\d+){2,}")]         # version strings: 2.14.1
# 1.5, .5, 1.5e-03, 8e-04; not inside identifiers or paths (x1.5, layers.0.weight, python3.12)
DECIMAL = re.compile(r"(?<![\w.])(?:\d*\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)")
FIX = ("print it in an unchecked cell after this one, or as an integer or exact value; or, if it "
       "is arithmetic on integers or Python floats only, say why in a line '# NBVAL_EXACT: <why>'")


def sanitized(text: str) -> str:
    """``text`` as nbval compares it."""
    for regex, replace in SANITIZE:
        text = re.sub(regex, replace, text)
    return text


def decimals(line: str) -> list[str]:
    """The decimal numbers in one line of sanitized output."""
    for pattern in NOT_NUMBERS:
        line = pattern.sub(" ", line)
    return DECIMAL.findall(line)


def checked(cell: dict) -> bool:
    """nbval's rule (nbval.plugin.find_comment_markers): a comment line that is the marker, or the
    cell's tag."""
    return (any(line.strip().lstrip("#").strip() == "NBVAL_CHECK_OUTPUT"
                for line in "".join(cell["source"]).splitlines() if line.strip().startswith("#"))
            or "nbval-check-output" in cell.get("metadata", {}).get("tags", []))


def output_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append("".join(out["text"]))
        elif out["output_type"] in ("execute_result", "display_data"):
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def offences(nb: dict, name: str) -> list[str]:
    """One line per checked cell of notebook ``nb`` that shows a decimal, or misuses NBVAL_EXACT."""
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        why = EXACT.findall(source)
        where = f"{name}, cell {index} (0-based)"
        if why and not checked(cell):
            found.append(f"{where}: '# NBVAL_EXACT:' on a cell that is not checked: remove it")
        if not checked(cell):
            continue
        if why and len(why[0].strip()) < 10:
            found.append(f"{where}: '# NBVAL_EXACT:' without its reason: say why the decimals are "
                         "the same on every CPU")
        lines = sanitized(output_text(cell)).splitlines()
        for line in lines:
            shown = decimals(line)
            if shown and not why:
                found.append(f"{where} is checked and prints {', '.join(shown)} in "
                             f"{line.strip()!r}: {FIX}")
        if why and not any(decimals(line) for line in lines):
            found.append(f"{where}: '# NBVAL_EXACT:' but no decimal in its output: remove the line")
    return found


def test_no_checked_cell_prints_a_decimal():
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert paths, f"no notebooks under {NOTEBOOKS}"
    found = []
    for path in paths:
        found += offences(json.loads(path.read_text()), f"notebooks/{path.name}")
    assert not found, "\n".join(found)


def _notebook(source: str, text: str) -> dict:
    return {"cells": [{"cell_type": "code", "source": source.splitlines(keepends=True),
                       "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]}]}


# what notebook 14 printed in a checked cell, and a fresh clone on another CPU printed with 1.3102
GRADSCALER = ("step  scale   skipped  fp16 loss  fp32 loss\n"
              "  10    1024    False     1.0434     1.0433\n"
              "  11    1024    False     1.3103     1.3100\n")


def test_the_rule_catches_notebook_14s_fp16_loss():
    found = offences(_notebook(f"{CHECKED}\nprint(history)\n", GRADSCALER), "14_memory.ipynb")
    assert len(found) == 2 and "cell 0 (0-based)" in found[0]
    assert "1.3103, 1.3100" in found[1] and "14_memory.ipynb" in found[1]
    assert offences(_notebook("print(history)\n", GRADSCALER), "14") == []   # unchecked: fine
    tagged = _notebook("print(history)\n", GRADSCALER)                     # nbval's tag checks too
    tagged["cells"][0]["metadata"] = {"tags": ["nbval-check-output"]}
    assert len(offences(tagged, "14")) == 2


def test_nbval_exact_exempts_a_cell_that_says_why():
    source = f"{CHECKED}\n# NBVAL_EXACT: halves of integers, exact in binary\nprint(work)\n"
    assert offences(_notebook(source, "work per rank [0.5, 1.5, 2.5, 3.5]\n"), "15") == []
    no_reason = source.replace("halves of integers, exact in binary", "")
    assert "without its reason" in offences(_notebook(no_reason, "[0.5]\n"), "15")[0]
    assert "no decimal" in offences(_notebook(source, "work per rank [1, 3, 5, 7]\n"), "15")[0]
    unchecked = source.replace(CHECKED, "")
    assert "not checked" in offences(_notebook(unchecked, "[0.5]\n"), "15")[0]


def test_what_counts_as_a_decimal():
    assert decimals("a parameter 8e-04 away, 2.5x, 6.1% of it, -0.5, .25 MiB") == [
        "8e-04", "2.5", "6.1", "0.5", ".25"]
    assert decimals("OK  step 1 == one device (rtol=0.0001, atol=1e-06), beyond rtol=1e-05") == []
    assert decimals("torch 2.14.1, /usr/lib/python3.12, layers.0.weight, cuda:1, 1F1B, x1.5") == []
    assert decimals(sanitized("OK  the step took 0.1234 sec")) == []   # nbval's sanitizing: TIME
    assert decimals("10,020,874 parameters, 593,920 bytes, step 2 of 3.") == []
