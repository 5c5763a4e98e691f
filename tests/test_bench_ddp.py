"""``python -m d2lpar bench ddp`` refuses bad arguments before starting any rank.

(The benchmark itself prints figures and is run by hand or by ``make bench``; notebook 09 runs the
same workers under nbval.)"""

from __future__ import annotations

import pytest

from d2lpar.bench.ddp import main


@pytest.mark.parametrize("argv", [["--cap-mb", "0"], ["--ranks", "1"], ["--repeats", "0"],
                                  ["--compute-over-comm", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "need --ranks >= 2, --cap-mb > 0, --repeats >= 1 and --compute-over-comm > 0" in \
        capsys.readouterr().err
