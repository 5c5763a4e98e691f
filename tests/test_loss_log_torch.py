"""d2lpar/examples/loss_log_torch.py (torch only): its logs of two layouts compared in one command.

Notebook 18 runs it on 2 ranks (DDP, fully_shard and parallelize_module against one process, within
the band; the planted per-rank mean outside it); here, a copy with d2lpar blocked runs on 3 ranks,
started by the course's launcher with torchrun's variables (a torchrun start costs 5-9 s here): DDP
and tensor parallelism over 3 ranks (DTensor and plain gradients in one norm) within the band of one
process, the planted per-rank mean outside it from step 1, and every bad input one sentence. Cost
here (2 cores, a load of 7-9): 4-5 s.
"""

import json

import pytest

from d2lpar.processes.commands import REPO, leftovers
from tests.torch_only import LAUNCH_VARS, load_copy, run_in_ranks

SCRIPT = REPO / "d2lpar" / "examples" / "loss_log_torch.py"
SMALL = ["--steps", "6", "--batch-size", "9", "--seq", "8", "--d", "24"]   # 4 d: 3 tensor ranks


@pytest.fixture(autouse=True)
def nothing_left_behind(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    assert leftovers() == [], "a launcher or worker outlived its test"


def test_three_ranks_within_the_band_and_the_planted_mean_outside(tmp_path, monkeypatch, capsys):
    script = load_copy(SCRIPT, tmp_path, monkeypatch)
    main = script["main"]
    one, other = tmp_path / "one.jsonl", tmp_path / "other.jsonl"
    main(["train", "--out", one, *SMALL])
    main(["train", "--out", other, "--accumulate", "3", *SMALL])
    ddp, bug, tp = tmp_path / "ddp.jsonl", tmp_path / "bug.jsonl", tmp_path / "tp.jsonl"
    copy = tmp_path / SCRIPT.name
    run_in_ranks(copy, 3, ["train", "--layout", "ddp", "--out", ddp, *SMALL])
    run_in_ranks(copy, 3, ["train", "--layout", "ddp", "--bug", "rank-mean", "--out", bug, *SMALL])
    run_in_ranks(copy, 3, ["train", "--layout", "tp", "--out", tp, *SMALL])
    records = [json.loads(line) for line in ddp.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[0]["tokens"] == json.loads(one.read_text().splitlines()[0])["tokens"]
    noise = ["--noise", one, other]
    assert main(["compare", ddp, one, *noise]) == "within the band (6 steps)"
    assert main(["compare", tp, one, *noise]) == "within the band (6 steps)"
    assert json.loads(tp.read_text().splitlines()[0])["tokens"] == records[0]["tokens"]
    assert main(["compare", bug, one, *noise]) == "outside the band from step 1 (grad_norm)"
    assert "bug.jsonl against one.jsonl: outside the band from step 1" in capsys.readouterr().out
    # the band is not wide open: the noise runs differ, and a 1e-3 shift of one loss leaves it
    shifted = tmp_path / "shifted.jsonl"
    lines = [json.loads(line) for line in one.read_text().splitlines()]
    lines[3]["loss"] += 1e-3
    shifted.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["compare", shifted, one, *noise]) == "outside the band from step 4 (loss)"


def test_bad_input_is_one_sentence(tmp_path, monkeypatch):
    script = load_copy(SCRIPT, tmp_path, monkeypatch)
    main, Usage = script["main"], script["Usage"]
    log = tmp_path / "log.jsonl"
    main(["train", "--out", log, "--steps", "2"])
    with pytest.raises(Usage, match="cannot read .*missing.jsonl .*give a log written by LossLog"):
        main(["compare", log, tmp_path / "missing.jsonl", "--noise", log, log])
    (tmp_path / "text.jsonl").write_text("not json\n")
    with pytest.raises(Usage, match="is not a log of JSON lines"):
        main(["compare", log, tmp_path / "text.jsonl", "--noise", log, log])
    with pytest.raises(Usage, match="--factor 0.0: give a positive number"):
        main(["compare", log, log, "--noise", log, log, "--factor", "0"])
    with pytest.raises(Usage, match="--steps 0: give at least 1"):
        main(["train", "--out", log, "--steps", "0"])
    with pytest.raises(Usage, match="--layout ddp needs ranks: start it with torchrun"):
        main(["train", "--out", log, "--layout", "ddp"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(Usage, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start with"):
        main(["train", "--out", log, "--layout", "ddp"])
    for name, value in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(Usage, match="--batch-size 8 does not give each of 3 data-parallel rank"):
        main(["train", "--out", log, "--layout", "ddp"])
    with pytest.raises(Usage, match="--layout single runs in one process, not 3"):
        main(["train", "--out", log])
    with pytest.raises(Usage, match="--layout tp cuts the 128 hidden features over 3 ranks"):
        main(["train", "--out", log, "--layout", "tp"])
