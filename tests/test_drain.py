"""Letting gloo let go: ``let_go`` returns once nothing but their Python objects holds the tensors,
and says so when something still does at its timeout. No process starts (about 0.5 s)."""

import threading
import time

import torch

from d2lpar.comm.drain import drain, held_elsewhere, let_go


def test_let_go_waits_for_another_holder_and_says_when_it_never_lets_go():
    bucket = torch.zeros(8)
    assert not held_elsewhere(bucket) and let_go([bucket], timeout=0.0)
    held = [bucket[:4]]                   # a view holds the tensor, as a gloo thread's work does
    assert held_elsewhere(bucket)
    threading.Timer(0.2, held.clear).start()
    t0 = time.perf_counter()
    assert let_go([bucket], timeout=5.0)
    assert 0.15 < time.perf_counter() - t0 < 5.0
    kept = bucket[2:]                     # never let go: False at the timeout, not a hang
    t0 = time.perf_counter()
    assert not let_go([torch.ones(2), bucket], timeout=0.2)
    assert time.perf_counter() - t0 >= 0.2 and kept.numel() == 6


class _Work:
    """Stands for a collective's work: holds a view of its tensor until dropped."""

    def __init__(self, tensor, waited: list):
        self.tensor, self.waited = tensor[:], waited

    def wait(self):
        self.waited.append(self.tensor.data_ptr())


def test_drain_waits_for_every_work_and_drops_them_all():
    buckets, waited = [torch.zeros(4), torch.zeros(4)], []
    works = [_Work(b, waited) for b in buckets]
    assert all(map(held_elsewhere, buckets))
    assert drain(works, buckets, timeout=1.0)   # no loop variable keeps the last work alive
    assert works == [] and waited == [b.data_ptr() for b in buckets]
    assert not any(map(held_elsewhere, buckets))
    kept = [_Work(buckets[0], waited)]
    assert not drain([kept[0]], buckets, timeout=0.1)   # a work still held elsewhere: False
