"""`python -m d2lpar bench zero` runs, prints 1.000 for every measured / formula pair, and ends with the worst."""

from d2lpar.bench import zero as bench


def test_bench_prints_every_ratio_and_the_worst(capsys):
    assert bench.main(["--ranks", "3", "--width", "8", "--layers", "2", "--rounds", "1",
                       "--steps", "1", "--batch", "4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line for line in lines if line.startswith(" 3 ")]
    assert len(rows) == 3 and all(line.count(" 1.000") == 4 for line in rows)
    assert lines[-1].startswith("worst measured / formula: 1.000; stage 3 step time d2lpar / FSDP2: ")
