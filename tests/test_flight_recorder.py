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


def test_the_debug_scripts_bad_input_is_one_sentence_before_any_group(tmp_path, monkeypatch):
    from tests.torch_only import LAUNCH_VARS, load_copy
    from d2lpar.processes.commands import REPO, free_port
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    names = load_copy(REPO / "d2lpar" / "examples" / "debug_torch.py", tmp_path, monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(names["Usage"], match="^MASTER_ADDR, MASTER_PORT not set: start with torchrun"):
        names["main"]([])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port("127.0.0.1")))
    (tmp_path / "a_file").write_text("in the way")
    with pytest.raises(names["Usage"], match=r"^cannot write to --dump .*a_file/fr \(Not a directory\): "):
        names["main"](["--dump", str(tmp_path / "a_file" / "fr")])   # checked before training


def test_a_tie_names_no_culprit_and_a_majority_does():
    def entry(seq, op, line):
        return {"seq": seq, "op": op, "sizes": [], "dtypes": [], "state": "", "where": f"x.py line {line}"}
    ok = [entry(1, "gloo:all_reduce", 1)]
    two = {0: ok + [entry(2, "gloo:barrier", 3)], 1: ok + [entry(2, "gloo:all_reduce", 2)]}
    found = FR.first_disagreement(two)
    assert found["seq"] == 2 and found["culprits"] == [] and "No majority" in found["text"]
    three = {**two, 2: ok + [entry(2, "gloo:all_reduce", 2)]}
    assert FR.first_disagreement(three)["culprits"] == [0]


def _copy(three_ranks, folder) -> dict:
    """The three real dumps copied into ``folder``; returns rank -> its dump (as written)."""
    folder.mkdir(exist_ok=True)
    dumps = {}
    for f in sorted(three_ranks.glob("fr_*.json")):
        shutil.copy(f, folder / f.name)
        d = json.loads(f.read_text())
        dumps[d["rank"]] = d
    return dumps


def _write(path, dump, age_s: float = 0.0):
    path.write_text(json.dumps(dump))
    if age_s:
        import os
        import time
        os.utime(path, (time.time() - age_s, time.time() - age_s))


def test_a_folder_reused_by_a_larger_run_names_the_stale_dump(three_ranks, tmp_path):
    # yesterday's run on 4 ranks under the same run name left fr_3.json; today's ran on 3
    dumps = _copy(three_ranks, tmp_path)
    assert FR.first_disagreement(FR.read_dumps(tmp_path)) is not None
    stale = dict(dumps[2], rank=3, world=4)
    stale["entries"] = dumps[0]["entries"]
    _write(tmp_path / "fr_3.json", stale, age_s=3600)
    with pytest.raises(FR.FlightRecorderError, match=r"fr_3\.json .*older.*earlier run") as e:
        FR.read_dumps(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case,said", [
    ("world 5 on rank 2", r"disagree on the world size.*fr_2\.json says 5"),
    ("world 2 on rank 0", r"disagree on the world size.*fr_0\.json says 2"),
    ("rank 7 of 3", r"fr_7\.json holds rank 7, but its world of 3 has ranks 0-2"),
    ("rank 1 twice", r"fr_1\.json and fr_1b\.json both hold rank 1"),
])
def test_a_file_set_of_mixed_worlds_or_ranks_is_refused(three_ranks, tmp_path, case, said):
    dumps = _copy(three_ranks, tmp_path)
    if case == "world 5 on rank 2":
        _write(tmp_path / "fr_2.json", dict(dumps[2], world=5))
    elif case == "world 2 on rank 0":
        _write(tmp_path / "fr_0.json", dict(dumps[0], world=2))
    elif case == "rank 7 of 3":
        _write(tmp_path / "fr_7.json", dict(dumps[2], rank=7))
    else:
        _write(tmp_path / "fr_1b.json", dumps[1])
    with pytest.raises(FR.FlightRecorderError, match=said) as e:
        FR.read_dumps(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("damage", ["empty", "cut", "binary", "a list", "no rank", "rank '1'",
                                    "entries not a list", "seq null", "entry without op"])
def test_a_damaged_dump_is_one_sentence_naming_the_file(three_ranks, tmp_path, damage):
    dumps = _copy(three_ranks, tmp_path)
    path, text = tmp_path / "fr_1.json", (tmp_path / "fr_1.json").read_text()
    one = dumps[1]
    if damage == "empty":
        path.write_text("")
    elif damage == "cut":
        path.write_text(text[: len(text) // 2])
    elif damage == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    elif damage == "a list":
        _write(path, [one])
    elif damage == "no rank":
        _write(path, {k: v for k, v in one.items() if k != "rank"})
    elif damage == "rank '1'":
        _write(path, dict(one, rank="1"))
    elif damage == "entries not a list":
        _write(path, dict(one, entries={"seq": 1}))
    elif damage == "seq null":
        _write(path, dict(one, entries=[dict(one["entries"][0], seq=None)] + one["entries"][1:]))
    else:
        _write(path, dict(one, entries=[{k: v for k, v in e.items() if k != "op"}
                                        for e in one["entries"]]))
    with pytest.raises(FR.FlightRecorderError, match=r"fr_1\.json") as e:
        FR.read_dumps(tmp_path)
    assert "\n" not in str(e.value) and str(e.value).count(": ") <= 3, str(e.value)
    assert "dump" in str(e.value)
