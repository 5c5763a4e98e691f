"""d2lpar/examples/pipeline_torch.py: 2 pipeline ranks end with one process's weights.

The script is copied into an empty folder and run from there: once on 2 ranks with ``Schedule1F1B``,
started by the course's launcher with the variables torchrun sets (a torchrun start costs 5-9 s
here; notebook 11 runs the script under torchrun itself, with ``ScheduleGPipe``), once in this
process, with d2lpar blocked, as one process on the whole batch. The stages' saved weights must have moved from the
start and agree with the one process's; the printed losses must agree. Notebook 11 runs it under
torchrun with ``ScheduleGPipe``. Bad input is one sentence, checked in this process.
"""

import re

import pytest
import torch

from d2lpar.processes.commands import REPO, leftovers
from tests.torch_only import LAUNCH_VARS, load_copy, run_in_ranks

SCRIPT = REPO / "d2lpar" / "examples" / "pipeline_torch.py"


@pytest.fixture
def script(tmp_path, monkeypatch):
    """The script's names, from a copy in an empty folder, with every d2lpar module blocked."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    names = load_copy(SCRIPT, tmp_path, monkeypatch)
    yield names
    assert leftovers() == [], "a launcher or worker outlived its test"


def losses(text: str) -> list[str]:
    return re.findall(r"step \d+, loss (\d+\.\d+)", text)


def test_two_ranks_equal_one_process(script, tmp_path, capsys):
    run_in_ranks(tmp_path / SCRIPT.name, 2, ["--schedule", "1F1B", "--out", tmp_path / "two"])
    ranks = capsys.readouterr().out
    assert "rank 1 of 2 (1F1B, cpu): step 3, loss" in ranks
    one = script["main"](["--out", str(tmp_path / "one")])
    printed = capsys.readouterr().out
    assert "rank 0 of 1 (no pipeline, cpu): step 3" in printed
    assert losses(ranks) == losses(printed) and len(losses(printed)) == 3
    two = {k: v for r in range(2) for k, v in torch.load(tmp_path / "two" / f"stage{r}.pt").items()}
    initial = script["make_data_and_model"](8, 64)[2].state_dict()
    assert sorted(two) == sorted(one) == sorted(initial)
    for name, value in one.items():
        assert not torch.equal(value, initial[name]), f"{name} did not move"
        torch.testing.assert_close(two[name], value, rtol=0, atol=1e-6, msg=name)


def test_bad_input_is_one_sentence(script, tmp_path, monkeypatch):
    main, Usage = script["main"], script["Usage"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Usage, match="^LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start with torchrun"):
        main([])
    for name, value in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(Usage, match="^--layers 8 does not split evenly over 3 ranks: use a multiple of 3"):
        main([])
    with pytest.raises(Usage, match="^--microbatches 2 is fewer than the 3 stages"):
        main(["--layers", "9", "--microbatches", "2"])
    with pytest.raises(Usage, match="^--batch-size 10 does not cut into 4 equal micro-batches"):
        main(["--layers", "9", "--batch-size", "10"])
    (tmp_path / "a_file").write_text("in the way")
    with pytest.raises(Usage, match="^cannot write to --out .*a_file/run"):
        main(["--layers", "9", "--out", str(tmp_path / "a_file" / "run")])
