"""The fake-tensor dry run: rank 0's bytes equal the formulas for model and world sizes notebook 14
does not use (it dry-runs the 8B model); bad input is one sentence, before anything is built."""

import pytest
import torch

from d2lpar.cost.memory_levers import dry_run_formula, sharded_bytes, split_parameters
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


def test_each_category_is_read_where_it_is_whole_not_at_the_peak():
    """The total may peak inside AdamW.step (its temporaries filed as 'opt') or at the end of the
    backward (no all-gather buffer alive): a 13B-like model on (2, 8) and (4, 4) meshes does. The
    peak's figures are planted here; measured() must not read them. No run, under 0.01 s."""
    from d2lpar.strategies.memory.dry_run import DryRun
    whole = {"sharded_param": 10, "unsharded_param": 7, "sharded_grad": 0, "opt": 20, "act": 30,
             "all_gather": 0}
    r = DryRun(4, (4,), 40, peak={**whole, "sharded_grad": 10, "opt": 29, "all_gather": 0},
               after_forward=whole, after_backward={**whole, "sharded_grad": 10, "act": 0},
               seconds=0.0, rss_bytes=0, parameter_tensors=4, in_layer={**whole, "all_gather": 5})
    assert r.measured() == {"sharded_param": 10, "sharded_grad": 10, "opt": 20,
                            "unsharded_param": 7, "all_gather": 5, "act": 30}


def test_the_formula_counts_fsdp2s_padding_when_the_ranks_do_not_divide_a_tensor():
    """FSDP2 pads each tensor's dim 0 to a multiple of N: on a (5, 3) mesh the MLP's 14 rows per
    tensor-parallel rank and the 97-word vocabulary do not divide by 5. One dry run, about 1 s."""
    cfg = GPTConfig(1, 30, 3, 42, 97)
    r = dry_run(lambda: GPT(cfg), (5, 3), "fsdp+tp", batch=1, seq=4)
    want = dry_run_formula(cfg.layers, cfg.d, cfg.heads, cfg.hidden, cfg.vocab, (5, 3), 1, 4)
    assert r.measured() == pytest.approx(want, rel=1e-9)
    P_split, P_rest, _, _ = split_parameters(cfg.layers, cfg.d, cfg.heads, cfg.hidden, cfg.vocab)
    assert r.measured()["sharded_param"] > 1.01 * sharded_bytes(P_split, P_rest, 5, 3)   # padded


def test_a_model_that_is_not_the_dry_runs_gpt_and_an_empty_batch_are_one_sentence():
    with pytest.raises(TypeError, match=r"model_fn built a Linear: the dry run shards and trains "
                                        r"dry_run.GPT"):
        dry_run(lambda: torch.nn.Linear(4, 4), (2,), "fsdp")
    with pytest.raises(ValueError, match=r"batch=0, seq=8: give at least one sequence of one "
                                         r"token"):
        dry_run(lambda: GPT(CONFIGS[0]), (2,), "fsdp", batch=0, seq=8)
