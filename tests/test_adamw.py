"""AdamW written out equals torch.optim.AdamW, and on a shard equals the shard of the full update."""

import pytest
import torch

from d2lpar.infra.adamw import AdamW


def _run(opt_cls, params, grads):
    opt = opt_cls(params, lr=0.05, weight_decay=0.1)
    for g in grads:
        for p, gp in zip(params, g):
            p.grad = None if gp is None else gp.clone()
        opt.step()
    return opt


def test_equals_torch_adamw_and_works_on_shards():
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(7)]
    grads = [[torch.randn(5, 3), torch.randn(7) if k else None] for k in range(4)]
    ours = [s.clone().requires_grad_() for s in start]
    theirs = [s.clone().requires_grad_() for s in start]
    opt = _run(AdamW, ours, grads)
    _run(torch.optim.AdamW, theirs, grads)
    assert not torch.allclose(ours[0], start[0])  # differ before ...
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)  # ... equal after
    assert opt.state_bytes() == 2 * 4 * (15 + 7)
    # the slice of a full update equals the update of the slice
    shard = [start[0].view(-1)[4:11].clone().requires_grad_()]
    _run(AdamW, shard, [[g[0].view(-1)[4:11]] for g in grads])
    torch.testing.assert_close(shard[0], ours[0].detach().view(-1)[4:11], rtol=0, atol=0)


def test_bad_hyperparameters_are_named():
    with pytest.raises(ValueError, match="betas"):
        AdamW([torch.zeros(1)], betas=(0.9, 1.0))
    for bad in ({"lr": float("nan")}, {"lr": float("inf")}, {"eps": -1e-8}, {"weight_decay": float("nan")},
                {"betas": (0.9,)}, {"lr": "0.1"}):
        with pytest.raises(ValueError, match="AdamW needs finite lr >= 0"):
            AdamW([torch.zeros(1)], **bad)
