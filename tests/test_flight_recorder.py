"""The flight-recorder reader: it names the collective and rank torch's analyzer names, on world
sizes the notebook does not use; dumps it cannot compare are refused in one sentence."""

import json
import re
import shutil
import uuid

import pytest

from d2lpar.comm import faults
from d2lpar.comm import flight_recorder as FR
from d2lpar.infra.paths import build_dir
from d2lpar.processes.launch import launch


@pytest.fixture(scope="module")
def three_ranks():
    folder = build_dir("test_flight_recorder") / "three"
    shutil.rmtree(folder, ignore_errors=True)
    launch(faults.skip_collective, 3, "recorded", str(folder), uuid.uuid4().hex, 2,
           init_process_group=False, timeout=30, quiet=True, env={"TORCH_FR_BUFFER_SIZE": "100"})
    return folder


def test_the_reader_agrees_with_torchs_analyzer(three_ranks):
    found = FR.first_disagreement(FR.read_dumps(three_ranks))
    report = FR.torch_analysis(three_ranks, first=0)
    assert found["seq"] == 4 and found["culprits"] == [1]
    assert f"Collective sequence number: {found['seq']} has errors" in report and "Culprit rank 1" in report
    assert "collective #3 was called from different lines" in found["text"]


def test_torchs_analyzer_takes_the_first_dump_as_its_reference(three_ranks):
    # rank 1 skipped; with its dump read first, the analyzer blames the two ranks that did not
    named = re.findall(r"Culprit rank (\d+)", FR.torch_analysis(three_ranks, first=1))
    assert sorted(map(int, named)) == [0, 2]


def test_dumps_that_agree_have_no_disagreement(three_ranks):
    dumps = FR.read_dumps(three_ranks)
    assert FR.first_disagreement({r: e[:2] for r, e in dumps.items()}) is None   # collectives 1 and 2


def test_dumps_it_cannot_compare_are_named(three_ranks, tmp_path):
    with pytest.raises(FR.FlightRecorderError, match="holds no flight-recorder dumps"):
        FR.read_dumps(tmp_path)
    for f in three_ranks.glob("fr_*.json"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "fr_2.json").unlink()
    with pytest.raises(FR.FlightRecorderError, match=r"has no dump from rank\(s\) \[2\] of 3"):
        FR.read_dumps(tmp_path)
    other = json.loads((three_ranks / "fr_2.json").read_text())
    other["run"] = "another run"
    (tmp_path / "fr_2.json").write_text(json.dumps(other))
    with pytest.raises(FR.FlightRecorderError, match="mixes dumps of 2 runs"):
        FR.read_dumps(tmp_path)


def test_the_torch_only_script_dumps_what_torchs_analyzer_reads(tmp_path, monkeypatch):
    from tests.torch_only import LAUNCH_VARS, load_copy, run_in_ranks
    from d2lpar.processes.commands import REPO
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    script = REPO / "d2lpar" / "examples" / "debug_torch.py"
    names = load_copy(script, tmp_path, monkeypatch)
    with pytest.raises(names["Usage"], match="start with torchrun"):
        names["main"]([])
    said = run_in_ranks(tmp_path / script.name, 2, ["--skip-on", "1", "--timeout", "2", "--dump", tmp_path / "fr"])
    assert all("flight recorder in" in s for s in said)
    assert "Culprit rank 1" in FR.torch_analysis(tmp_path / "fr")
    checked = run_in_ranks(tmp_path / script.name, 2, ["--skip-on", "1", "--timeout", "2", "--check"])
    assert "Rank 1 failed to pass monitoredBarrier" in checked[0]


def test_a_tie_names_no_culprit_and_a_majority_does():
    def entry(seq, op, line):
        return {"seq": seq, "op": op, "sizes": [], "dtypes": [], "state": "", "where": f"x.py line {line}"}
    ok = [entry(1, "gloo:all_reduce", 1)]
    two = {0: ok + [entry(2, "gloo:barrier", 3)], 1: ok + [entry(2, "gloo:all_reduce", 2)]}
    found = FR.first_disagreement(two)
    assert found["seq"] == 2 and found["culprits"] == [] and "No majority" in found["text"]
    three = {**two, 2: ok + [entry(2, "gloo:all_reduce", 2)]}
    assert FR.first_disagreement(three)["culprits"] == [0]
