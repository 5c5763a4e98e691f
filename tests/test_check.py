import math

import pytest
import torch

from d2lpar.infra.check import CheckFailed, check, check_changed, check_close, check_equal


def test_check_prints_one_line(capsys):
    check("two is even", 2 % 2 == 0)
    assert capsys.readouterr().out == "OK  two is even\n"


def test_check_raises():
    with pytest.raises(CheckFailed, match="FAILED  three is even: odd"):
        check("three is even", False, "odd")


def test_check_close_structures(capsys):
    a = {"w": torch.ones(3), "b": [torch.zeros(2), 1.0]}
    check_close("same", a, {"w": torch.ones(3) + 1e-8, "b": [torch.zeros(2), 1.0]})
    assert capsys.readouterr().out.startswith("OK  same (rtol=1e-05, atol=1e-06)")
    with pytest.raises(CheckFailed, match="at 'w'"):
        check_close("differs", a, {"w": torch.ones(3) * 2, "b": [torch.zeros(2), 1.0]})
    with pytest.raises(CheckFailed, match="structures differ"):
        check_close("keys", a, {"w": torch.ones(3)})


def test_check_close_modules_and_nan():
    m = torch.nn.Linear(2, 2)
    check_close("module equals its state dict", m, m.state_dict())
    with pytest.raises(CheckFailed):
        check_close("nan never passes", torch.tensor([math.nan]), torch.tensor([0.0]))


def test_check_equal():
    check_equal("lists", [1, 2], [1, 2])
    with pytest.raises(CheckFailed, match="got 3, expected 4"):
        check_equal("ints", 3, 4)


def test_check_changed_names_what_did_not_move(capsys):
    start = {"w": torch.zeros(3), "b": torch.zeros(2)}
    check_changed("moved", {"w": torch.ones(3), "b": torch.ones(2)}, start)
    assert capsys.readouterr().out.startswith("OK  moved")
    with pytest.raises(CheckFailed, match="unchanged: b"):
        check_changed("moved", {"w": torch.ones(3), "b": torch.zeros(2) + 1e-9}, start)
