"""3D parallelism: by hand and with torch's APIs equal to one device (the first step's gradients
before the optimizer, then the weights); a planted gradient-scale bug fails that check; the planner's
memory equals the dry run; bad layouts are one sentence. Notebook 17 runs the 8-rank torch run and
the timing check."""

import sys

import pytest
import torch
import torch.distributed as dist

from d2lpar.cost import planner as PL
from d2lpar.examples import threed_torch
from d2lpar.infra.text import CharCorpus, batches, make_text
from d2lpar.processes.commands import REPO
from d2lpar.strategies.memory.dry_run import GPT, GPTConfig, dry_run
from d2lpar.strategies.threed.gpt import char_gpt, first_gradients, train_one_device
from d2lpar.strategies.threed.hand import check_3d, run_3d
from tests.torch_only import load_copy, run_in_ranks

CORPUS = CharCorpus(make_text(20_000))


def _moved_and_equal(state, reference, start):
    for k, v in reference.items():
        assert not torch.allclose(v, start[k], atol=1e-6), f"{k} did not move"
        torch.testing.assert_close(state[k], v, rtol=1e-3, atol=2e-4, msg=k)


def _grads_equal(grads, reference):
    assert grads.keys() == reference.keys()
    for k, g in reference.items():
        assert g.abs().max() > 0, f"{k}: a zero gradient would not test the scale"
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("dp,tp,pp", [(2, 2, 2), (2, 1, 2)])
def test_hand_built_3d_equals_one_device(dp, tp, pp):
    B = batches(CORPUS.ids, 8, 16, 3)
    model = char_gpt(CORPUS.vocab, 16, layers=2, d=32, heads=4)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    one = char_gpt(CORPUS.vocab, 16, layers=2, d=32, heads=4)
    grads = first_gradients(one, *B[0])
    losses = train_one_device(one, B)
    r = run_3d(model, B, dp=dp, tp=tp, pp=pp, microbatches=2)
    assert r.losses == pytest.approx(losses, abs=1e-5)
    _grads_equal(r.grads, grads)
    _moved_and_equal(r.state, one.state_dict(), start)
    assert r.copies_differ is not None and r.copies_differ <= 1e-6   # every rank's copy agrees
    assert torch.equal(model.state_dict()["0.tok.weight"], start["0.tok.weight"])   # caller's untouched


def summed_not_averaged(module, group):
    """The planted bug: the dp gradients summed, the division by the group's size forgotten."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
    return flat.numel() * flat.element_size()


def test_a_forgotten_dp_average_fails_the_gradient_check_by_two_and_barely_moves_weights():
    import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the ranks get the bug by value
    B = batches(CORPUS.ids, 8, 16, 2)
    one = char_gpt(CORPUS.vocab, 16, layers=2, d=32, heads=4)
    grads = first_gradients(one, *B[0])
    start = {k: v.clone() for k, v in one.state_dict().items()}
    train_one_device(one, B)
    r = run_3d(char_gpt(CORPUS.vocab, 16, layers=2, d=32, heads=4), B, dp=2, tp=2, pp=2,
               microbatches=2, average=summed_not_averaged)
    with pytest.raises(AssertionError):
        _grads_equal(r.grads, grads)
    torch.testing.assert_close(r.grads["1.mlp.fc1.weight"], 2 * grads["1.mlp.fc1.weight"],
                               rtol=1e-4, atol=1e-6)
    # AdamW hides most of the factor 2 (its update divides m by sqrt(v)): the weights move away
    # from one device's by a small part of what the steps moved them, taken over all weights (an
    # element-wise tolerance is not: elements whose gradient is near AdamW's eps move by up to
    # twice as much, and which elements those are depends on the CPU's kernels)
    off = sum(float((r.state[k] - v).float().norm() ** 2) for k, v in one.state_dict().items())
    moved = sum(float((v - start[k]).float().norm() ** 2) for k, v in one.state_dict().items())
    assert moved > 0 and (off / moved) ** 0.5 < 0.1, (off / moved) ** 0.5


TORCH_ARGV = ["--layers", "2", "--d", "32", "--heads", "4", "--seq", "16", "--batch-size", "8",
              "--steps", "3"]


def _torch_ranks(tmp_path, monkeypatch, plant: tuple[str, str] | None = None):
    """The script's one-process run, and its run on 4 ranks (dp 2 x pp 2) of a copy in which
    ``plant`` (old text, new text) may plant a bug."""
    script = REPO / "d2lpar" / "examples" / "threed_torch.py"
    copy = load_copy(script, tmp_path, monkeypatch)
    one = copy["main"](TORCH_ARGV)
    if plant:
        text = (tmp_path / script.name).read_text()
        assert plant[0] in text
        (tmp_path / script.name).write_text(text.replace(*plant))
    ranks = run_in_ranks(tmp_path / script.name, 4, TORCH_ARGV + ["--dp", "2", "--pp", "2"])
    state, grads = {}, {}
    for r in ranks:
        state.update(r["state"])
        grads.update(r["grads"])
    return copy, one, ranks, state, grads


def test_torch_3d_script_on_4_ranks_equals_its_one_process_run(tmp_path, monkeypatch):
    copy, one, ranks, state, grads = _torch_ranks(tmp_path, monkeypatch)
    torch.manual_seed(0)
    start = copy["gpt"](one["state"]["0.tok.weight"].shape[0], 16, 2, 32, 4).state_dict()
    assert next(r["losses"] for r in ranks if r["losses"]) == pytest.approx(one["losses"], abs=1e-5)
    _grads_equal(grads, one["grads"])
    _moved_and_equal(state, one["state"], start)


def test_summed_micro_batch_losses_fail_the_torch_scripts_gradient_check(tmp_path, monkeypatch):
    # the planted bug: the pipeline sums the micro-batches' losses instead of averaging them
    plant = ("Schedule1F1B(pipe, a.microbatches, loss_fn=loss_fn)",
             "Schedule1F1B(pipe, a.microbatches, loss_fn=loss_fn, scale_grads=False)")
    _, one, ranks, state, grads = _torch_ranks(tmp_path, monkeypatch, plant)
    assert next(r["losses"] for r in ranks if r["losses"]) == pytest.approx(one["losses"], abs=1e-5)
    with pytest.raises(AssertionError):
        _grads_equal(grads, one["grads"])
    torch.testing.assert_close(grads["1.mlp.fc1.weight"], 2 * one["grads"]["1.mlp.fc1.weight"],
                               rtol=1e-4, atol=1e-6)


STATE_ARGV = ["--layers", "1", "--heads", "2", "--microbatches", "1", "--batch-size", "3"]


def _state_file(copy, path, rows: list[int]):
    """A --state file: a 1-layer GPT (vocabulary 11, 8 positions, width 16) and batches of ``rows``."""
    torch.manual_seed(0)
    model = copy["gpt"](11, 8, 1, 16, 2)
    g = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, 11, (r, 9), generator=g) for r in rows]
    torch.save({"model": model.state_dict(), "batches": [(w[:, :-1], w[:, 1:]) for w in windows]},
               path)
    return ["--state", str(path)]


def _plain_training(copy, path, lr=3e-3):
    """The single-process baseline in plain torch: AdamW on each batch's mean loss, whole."""
    saved = torch.load(path)
    model = copy["gpt"](11, 8, 1, 16, 2)
    model.load_state_dict(saved["model"])
    opt, losses = torch.optim.AdamW(model.parameters(), lr=lr), []
    for X, Y in saved["batches"]:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X).flatten(0, 1), Y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_torch_3d_script_weighs_each_state_batch_by_its_own_rows(tmp_path, monkeypatch):
    # batches of 6, 12 and 9 rows on dp=3: each dp group takes a third of each batch (a third of
    # the first batch, 2 rows, silently dropped half of the second and a third of the third)
    script = REPO / "d2lpar" / "examples" / "threed_torch.py"
    copy = load_copy(script, tmp_path, monkeypatch)
    argv = STATE_ARGV + _state_file(copy, tmp_path / "state.pt", [6, 12, 9])
    losses, state = _plain_training(copy, tmp_path / "state.pt")
    ranks = run_in_ranks(tmp_path / script.name, 3, argv + ["--dp", "3"])
    assert ranks[0]["losses"] == pytest.approx(losses, abs=1e-5)
    for name, value in state.items():   # the tolerance of _moved_and_equal: the key bias's
        # exact gradient is 0 (softmax ignores a constant added to a row of scores), and AdamW
        # turns its float noise into steps of up to lr
        torch.testing.assert_close(ranks[0]["state"][name], value, rtol=1e-3, atol=2e-4, msg=name)


def test_torch_3d_script_refuses_what_it_cannot_serve_before_training(tmp_path, monkeypatch):
    copy = load_copy(REPO / "d2lpar" / "examples" / "threed_torch.py", tmp_path, monkeypatch)
    main, Usage = copy["main"], copy["Usage"]
    (tmp_path / "a_file").write_text("in the way")
    with pytest.raises(Usage, match=r"^cannot write to --out .*a_file/run \(Not a directory\): "):
        main(STATE_ARGV + ["--out", str(tmp_path / "a_file" / "run")])
    with pytest.raises(Usage, match=r"^cannot read --state .*nothing\.pt \(No such file"):
        main(STATE_ARGV + ["--state", str(tmp_path / "nothing.pt")])
    state = _state_file(copy, tmp_path / "seven.pt", [9, 7])
    with pytest.raises(Usage, match=r"^--state's batch 1 has 7 rows, not a multiple of --dp 3"):
        copy["check_batches"](torch.load(state[1])["batches"], 3, 1, 1)
    with pytest.raises(Usage, match=r"^--state's batch 1 is \(6, 8\) where batch 0 is \(4, 8\)"):
        copy["check_batches"]([(torch.zeros(4, 8), torch.zeros(4, 8)),
                               (torch.zeros(6, 8), torch.zeros(6, 8))], 1, 2, 2)


@pytest.mark.parametrize("shape,how", [((4,), "fsdp"), ((2, 2), "fsdp+tp")])
def test_planner_memory_equals_the_dry_run(shape, how):
    cfg = GPTConfig(layers=2, d=32, heads=4, hidden=128, vocab=256)
    dp, tp = shape[0], (shape[1] if len(shape) > 1 else 1)
    got = dry_run(lambda: GPT(cfg), shape, how, batch=2, seq=32).measured()
    want = PL.memory(PL.Model("m", 2, 32, 4, 32, 256, 2 * dp, 128, "fp32"), PL.Layout(dp, tp, 1, zero=3))
    for a, b in [("parameters", "sharded_param"), ("gradients", "sharded_grad"), ("activations", "act")]:
        assert want[a] == pytest.approx(got[b], rel=1e-4), a
    assert want["optimizer"] == pytest.approx(got["opt"], rel=2e-3)   # + AdamW's step counters


def test_bad_layouts_are_one_sentence():
    model = char_gpt(CORPUS.vocab, 16, layers=2, d=32, heads=4)
    with pytest.raises(ValueError, match="tensor degree 3 does not divide heads=4"):
        check_3d(model, (1, 1, 3), 8, 1)
    with pytest.raises(ValueError, match="pipeline degree 5 is more than the model's 4 layers"):
        check_3d(model, (1, 5, 1), 8, 1)
    with pytest.raises(ValueError, match="a batch of 6 rows gives dp=4 ranks fewer than 2 micro"):
        check_3d(model, (4, 1, 1), 6, 2)
    with pytest.raises(threed_torch.Usage, match=r"--dp 2 x --tp 1 x --pp 1 = 2, but 1 process"):
        threed_torch.main(["--dp", "2"])
    with pytest.raises(ValueError, match="characters \\['#'\\] are not in the corpus"):
        CORPUS.encode("a#")


def test_the_planner_never_returns_a_layout_that_does_not_fit():
    model = PL.Model("13B-like", 40, 5120, 40, 2048, 50257, 512)
    for cluster in (PL.CLUSTERS["64 H100"], PL._cluster(32, 8, 40, 312e12, 230e9, 25e9, "32 A100-40GB")):
        for p in PL.plan(model, cluster, top=20):
            assert p.fits and p.peak_memory <= cluster.memory_gb * 1e9
            PL.check_layout(model, cluster, p.layout)
        for p in PL.by_degrees(model, cluster).values():
            assert p.fits == (p.peak_memory <= cluster.memory_gb * 1e9)


def test_the_text_is_the_same_everywhere():
    assert make_text(500) == make_text(500) != make_text(500, seed=1)
    X, Y = batches(CORPUS.ids, 4, 16, 1)[0]
    assert X.shape == Y.shape == (4, 16) and torch.equal(X[:, 1:], Y[:, :-1])
    assert CORPUS.decode(CORPUS.encode("the miller")) == "the miller"


def test_the_simulated_devices_flops_are_the_planners():
    from d2lpar.cost.tp_cost import layer_flops
    from d2lpar.strategies.threed.hand import forward_flops
    layer = char_gpt(CORPUS.vocab, 16, layers=1, d=32, heads=4)[1]
    assert forward_flops(layer, 2, torch.zeros(3, 16, 32)) == layer_flops(3, 16, 32, 128) / 2


# A DataLoader's batches differ in size. Each batch is cut by its own rows (not the first batch's)
# and each dp rank's mean is weighted by its rows, so that every step equals one device: a later
# batch of 12 on dp=3 loses no rows, a batch of 7 splits 3, 2, 2; with pp=3 a shorter batch's
# activations travel in buffers of its own size. Two 3-rank runs, about 2 s.
@pytest.mark.parametrize("dp,pp,rows", [(3, 1, (9, 12, 7)), (1, 3, (8, 5))])
def test_batches_of_other_sizes_equal_one_device(dp, pp, rows):
    B = [b for n in rows for b in batches(CORPUS.ids, n, 8, 1, seed=n)]
    model = char_gpt(CORPUS.vocab, 8, layers=1, d=16, heads=2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    one = char_gpt(CORPUS.vocab, 8, layers=1, d=16, heads=2)
    losses = train_one_device(one, B)
    r = run_3d(model, B, dp=dp, tp=1, pp=pp, microbatches=2)
    assert r.losses == pytest.approx(losses, abs=1e-5)
    _moved_and_equal(r.state, one.state_dict(), start)


@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if run_3d starts any rank: bad batches must be caught in the caller."""
    import d2lpar.strategies.threed.hand as hand

    def refuse(*a, **k):
        raise AssertionError("a rank was launched: the error should come before any rank starts")
    monkeypatch.setattr(hand, "launch", refuse)


def test_every_batch_is_checked_before_any_rank_starts(no_launch):
    model = char_gpt(CORPUS.vocab, 8, layers=1, d=16, heads=2)
    good = batches(CORPUS.ids, 6, 8, 1)
    with pytest.raises(ValueError, match=r"batch 1: a batch of 5 rows gives dp=3 ranks fewer than "
                                         r"2 micro-batches each: use batches of at least 6 rows"):
        run_3d(model, good + batches(CORPUS.ids, 5, 8, 1), dp=3, tp=1, pp=1, microbatches=2)
    with pytest.raises(ValueError, match=r"batch 1: .*a sequence of 9 tokens is longer than"):
        run_3d(model, good + batches(CORPUS.ids, 6, 9, 1), dp=1, tp=1, pp=3, microbatches=2)
    X, Y = good[0]
    with pytest.raises(ValueError, match=r"batch 0 has inputs of shape \(6, 8\) and targets of "
                                         r"shape \(5, 8\)"):
        run_3d(model, [(X, Y[:5])], dp=3, tp=1, pp=1, microbatches=2)
