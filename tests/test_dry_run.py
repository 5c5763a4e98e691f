"""The fake-tensor dry run: rank 0's bytes equal the formulas for model and world sizes notebook 14
does not use (it dry-runs the 8B model); bad input is one sentence, before anything is built."""

import pytest
import torch

from d2lpar.cost.memory_levers import dry_run_formula
from d2lpar.strategies.memory.dry_run import GPT, GPTConfig, dry_run

# Notebook 14 checks every category of the 8B model on 8 and 64 ranks; one small shape here keeps
# the module honest without repeating that run.
CONFIGS = [GPTConfig(2, 32, 2, 64, 96), GPTConfig(3, 48, 4, 96, 200), GPTConfig(1, 64, 8, 128, 64)]


@pytest.mark.parametrize("cfg", CONFIGS[2:], ids=["1x64"])
def test_every_category_equals_its_formula(cfg):
    for shape, plan in (((2,), "fsdp"), ((4,), "fsdp"), ((8,), "fsdp"), ((2, 2), "fsdp+tp")):
        r = dry_run(lambda: GPT(cfg), shape, plan, batch=2, seq=8)
        assert r.parameters == cfg.parameters()
        want = dry_run_formula(cfg.layers, cfg.d, cfg.heads, cfg.hidden, cfg.vocab, shape, 2, 8)
        assert r.measured() == pytest.approx(want, rel=1e-9), (shape, plan)


def test_bad_input_is_one_sentence():
    cfg = CONFIGS[0]
    with pytest.raises(ValueError, match=r"the mesh \(4, 2\) holds 8 ranks, not the world of 6"):
        dry_run(lambda: GPT(cfg), (4, 2), "fsdp+tp", world=6)
    with pytest.raises(ValueError, match="heads=2 does not divide over tensor-parallel degree 4"):
        dry_run(lambda: GPT(cfg), (1, 4), "fsdp+tp")
    with pytest.raises(ValueError, match="plan='zero'"):
        dry_run(lambda: GPT(cfg), (2,), "zero")


def test_a_bf16_policy_halves_the_gathered_parameters_and_activations_only():
    cfg = CONFIGS[0]
    r = dry_run(lambda: GPT(cfg), (2,), "fsdp", batch=2, seq=8, param_dtype=torch.bfloat16,
                log=lambda text: None)
    want = dry_run_formula(cfg.layers, cfg.d, cfg.heads, cfg.hidden, cfg.vocab, (2,), 2, 8)
    got = r.measured()
    for k in ("sharded_param", "sharded_grad", "opt"):
        assert got[k] == pytest.approx(want[k], rel=1e-9), k
    for k in ("unsharded_param", "all_gather"):
        assert got[k] == pytest.approx(want[k] / 2, rel=1e-9), k
    assert r.peak["total"] > 0
