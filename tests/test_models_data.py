import gzip
import os

import numpy as np
import pytest
import torch

from d2lpar.infra import data, models


def test_digits_ship_with_the_course():
    train, test = data.load_digits()
    assert len(train) + len(test) == 1797
    X, y = train[0]
    assert X.shape == (1, 28, 28) and 0 <= X.min() and X.max() <= 1 and 0 <= y < 10
    again, _ = data.load_digits()
    assert torch.equal(again.tensors[1], train.tensors[1]), "the split is the same every time"


@pytest.mark.parametrize("build,shape", [(models.lenet, (2, 1, 28, 28)), (models.mlp, (2, 1, 28, 28)),
                                         (models.small_resnet, (2, 1, 28, 28))])
def test_models_run_and_are_seeded(build, shape):
    a, b = build(seed=3), build(seed=3)
    assert a(torch.zeros(shape)).shape == (2, 10)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert models.count_parameters(a) > 0


def _write_idx(path, array, magic):
    with gzip.open(path, "wb") if path.endswith(".gz") else open(path, "wb") as f:
        f.write(magic.to_bytes(4, "big"))
        for d in array.shape:
            f.write(int(d).to_bytes(4, "big"))
        f.write(array.astype(np.uint8).tobytes())


def test_fashion_mnist_reads_files_on_disk(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in [("train", 6), ("t10k", 4)]:
        _write_idx(str(raw / f"{split}-images-idx3-ubyte"), rng.integers(0, 255, (n, 28, 28)), 2051)
        _write_idx(str(raw / f"{split}-labels-idx1-ubyte"), rng.integers(0, 10, (n,)), 2049)
    train_iter, test_iter = data.load_data("fashion_mnist", batch_size=4, root=str(tmp_path))
    X, y = next(iter(train_iter))
    assert X.shape == (4, 1, 28, 28) and y.dtype == torch.int64
    assert len(test_iter.dataset) == 4


def test_fashion_mnist_missing_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="load_digits"):
        data.fashion_mnist(str(tmp_path))
    with pytest.raises(ValueError, match="unknown data set"):
        data.load_data("imagenet")
