"""d2lpar/examples/fsdp_tp_torch.py: 4 ranks (dp x tp = 2 x 2) end with one process's weights.

The script is copied into an empty folder and run from there: once on 4 ranks started by the
course's launcher with the variables torchrun sets (a torchrun start of 4 ranks costs ~8 s here;
notebook 13 runs the script under torchrun itself), once in this process, with d2lpar blocked, as
one process.
Both checkpoints are read back with ``dcp.load(..., no_dist=True)``: every weight moved (by about
0.04 when written) and the two agree to atol 1e-5 (7e-7 when written). The rest runs in this process:
a resumed run equals a straight one, and bad input is one sentence.
"""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from d2lpar.processes.commands import REPO, leftovers
from tests.torch_only import LAUNCH_VARS, load_copy, run_in_ranks

SCRIPT = REPO / "d2lpar" / "examples" / "fsdp_tp_torch.py"
TOLERANCE = 1e-5


@pytest.fixture
def script(tmp_path, monkeypatch):
    """The script's names, from a copy in an empty folder, with every d2lpar module blocked."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    names = load_copy(SCRIPT, tmp_path, monkeypatch)
    yield names
    assert leftovers() == [], "a launcher or worker outlived its test"


def weights(names, folder):
    """The model's weights in a checkpoint folder, loaded whole into one process."""
    model = names["make_data_and_model"](0)[1]
    state = {"model": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state["model"]


def test_four_ranks_equal_one_process(script, tmp_path, capsys):
    run_in_ranks(tmp_path / SCRIPT.name, 4, ["--out", tmp_path / "four"], timeout=180)
    ranks = capsys.readouterr().out
    assert "rank 0 of 4 (dp 2 x tp 2, cpu): step 4" in ranks
    assert "_StridedShard" in ranks  # FSDP2's shard of a TP shard: the 2D placement
    script["main"](["--out", str(tmp_path / "one"), "--cpu"])
    four, one = weights(script, tmp_path / "four"), weights(script, tmp_path / "one")
    initial = script["make_data_and_model"](0)[1].state_dict()
    for name, value in one.items():
        assert (value - initial[name]).abs().max() > 1e-2, f"{name} did not move"
        torch.testing.assert_close(four[name], value, rtol=0, atol=TOLERANCE, msg=name)


def test_resume_continues_the_same_run(script, tmp_path):
    main = script["main"]
    main(["--out", str(tmp_path / "straight")])
    main(["--out", str(tmp_path / "resumed"), "--steps", "2"])
    half = weights(script, tmp_path / "resumed")
    main(["--out", str(tmp_path / "resumed")])
    straight, resumed = weights(script, tmp_path / "straight"), weights(script, tmp_path / "resumed")
    assert not torch.equal(half["0.0.weight"], straight["0.0.weight"])  # steps 3 and 4 ran
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name


def test_bad_input_is_one_sentence(script, tmp_path, monkeypatch):
    main, Usage = script["main"], script["Usage"]
    out = ["--out", str(tmp_path / "out")]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(Usage, match="^LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start with torchrun"):
        main(out)
    for name, value in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(Usage, match="^4 processes do not make a dp x tp mesh with --tp 3"):
        main([*out, "--tp", "3"])
    with pytest.raises(Usage, match="^--batch-size 31 is the global batch and does not divide over 2"):
        main([*out, "--batch-size", "31"])
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "a_file").write_text("in the way")
    with pytest.raises(Usage, match="^cannot write to --out .*a_file/ckpt"):
        main(["--out", str(tmp_path / "a_file" / "ckpt")])
