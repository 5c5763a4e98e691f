"""The all-reduce benchmark runs, checks its methods and prints the closing ratio line."""

from d2lpar.bench import allreduce as bench


def test_report_states_the_ratio_at_16_and_64_mb():
    rows = [(2, 16 << 20, {"all_reduce": 0.010, "ring": 0.011, "ps": 0.02}),
            (4, 64 << 20, {"all_reduce": 0.100, "ring": 0.130, "ps": 0.3})]
    lines = bench.report(rows)
    assert "16 MB" in lines[3] and lines[-1].endswith("1.30 (misses the target <= 1.2)")
    busbw = float(lines[4].split("|")[2].split()[2])
    assert abs(busbw - (64 << 20) / 0.130 / 1e9 * 1.5) < 1e-3


def test_small_run(capsys):
    assert bench.main(["--ranks", "2", "--min-size", "1K", "--max-size", "4K", "--rounds", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len([l for l in out if "KB" in l and "|" in l]) == 2
    assert out[-1].startswith("largest ring / all_reduce time ratio at 16 MB and 64 MB: not measured")
