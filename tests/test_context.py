"""Ring attention (causal or not, zig-zag or not) and Ulysses equal scaled_dot_product_attention on
one device, in output and gradients, on 2, 3 and 4 ranks and sizes notebook 15 does not use; bytes
sent equal the formulas; bad input is one sentence."""

import pytest
import torch

from d2lpar.bench.context import check_run
from d2lpar.processes.launch import RankFailed, launch
from d2lpar.strategies.context import ring as R
from d2lpar.strategies.context.ulysses import ulysses_attention


def _all_ring_cases(n):
    """Every ring case on this many ranks, in one launch (sizes: b 1, 3 heads, 12n tokens, d_h 4)."""
    from d2lpar.bench.context import _worker
    import torch.distributed as dist
    out = {}
    for causal in (False, True):
        for zigzag in (False, True):
            g = torch.Generator().manual_seed(1)
            q, k, v, W = (torch.randn(1, 3, 12 * n, 4, generator=g) for _ in range(4))
            out[causal, zigzag] = _worker(q, k, v, W, "ring", causal, zigzag)
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_attention_equals_one_device(n):
    res = launch(_all_ring_cases, n, n, timeout=60)
    for (causal, zigzag), _ in res[0].items():
        g = torch.Generator().manual_seed(1)
        q, k, v, W = (torch.randn(1, 3, 12 * n, 4, generator=g) for _ in range(4))
        out = R.merge_sequence([r[causal, zigzag][0] for r in res], zigzag)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = R.reference_attention(qq, kk, vv, causal)
        (ref * W).sum().backward()
        other = R.reference_attention(q, k, v, not causal)
        assert (other - ref).abs().max() > 1e-2                       # the mask matters ...
        torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-5)   # ... and is honoured
        for i, t in enumerate((qq, kk, vv)):
            grad = R.merge_sequence([r[causal, zigzag][1][i] for r in res], zigzag)
            torch.testing.assert_close(grad, t.grad, rtol=1e-5, atol=1e-5)
        assert res[0][causal, zigzag][2] == 2 * (n - 1) * 2 * 1 * 12 * 3 * 4 * 4   # fwd + bwd bytes


def test_ulysses_equals_one_device_and_sends_the_formula():
    for n in (2, 3):
        ratio, diff = check_run("ulysses", n, b=1, heads=6, S=18, dh=4, causal=True)
        assert ratio == 1.0 and diff < 1e-5


def test_zigzag_balances_the_causal_work():
    for n in (2, 3, 5):
        naive, zig = R.work_per_rank(n, True, False), R.work_per_rank(n, True, True)
        assert naive == [r + 0.5 for r in range(n)]   # rank r: r full blocks and a triangle
        assert len(set(zig)) == 1                      # every rank the same
        assert sum(naive) * 4 == sum(zig)   # 2N chunks: blocks a quarter the size, four times as many


def _heads_do_not_divide():
    ulysses_attention(*(torch.randn(1, 3, 4, 2) for _ in range(3)))


def test_bad_input_is_one_sentence():
    with pytest.raises(ValueError, match="a sequence of 10 tokens does not cut into 4 equal chunks"):
        R.split_sequence(torch.randn(1, 1, 10, 2), 2, zigzag=True)
    with pytest.raises(RankFailed, match="the heads must divide evenly; use a number of ranks that divides 3"):
        launch(_heads_do_not_divide, 2, timeout=30)


def test_the_torch_script_says_what_it_needs_on_a_cpu(tmp_path, monkeypatch):
    from d2lpar.processes.commands import REPO
    from tests.torch_only import load_copy
    names = load_copy(REPO / "d2lpar" / "examples" / "context_parallel_torch.py", tmp_path, monkeypatch)
    if torch.cuda.is_available():
        assert names["main"](["--seq", "256"]) < 0.05
    else:
        with pytest.raises(names["Usage"], match="context_parallel needs CUDA GPUs in torch 2.14"):
            names["main"]([])


def test_the_torch_script_names_the_launcher_variables_it_lacks(tmp_path, monkeypatch):
    from d2lpar.processes.commands import REPO
    from tests.torch_only import LAUNCH_VARS, load_copy
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    names = load_copy(REPO / "d2lpar" / "examples" / "context_parallel_torch.py", tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # as on GPUs: past that check
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(names["Usage"], match="^LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: start "
                                             "with torchrun"):
        names["main"](["--seq", "256"])


@pytest.mark.cuda
def test_context_parallel_equals_one_gpu(tmp_path, monkeypatch):
    from d2lpar.processes.commands import REPO
    from tests.torch_only import load_copy
    names = load_copy(REPO / "d2lpar" / "examples" / "context_parallel_torch.py", tmp_path, monkeypatch)
    assert names["main"](["--seq", "1024"]) < 0.05


def _ring_blocks_kept():
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(2)
    parts = [R.split_sequence(torch.randn(1, 2, 8 * n, 4, generator=g), n, False)[r].requires_grad_()
             for _ in range(3)]
    blocks, kept = [], set()

    def pack(t):
        kept.add(t.untyped_storage().data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = R.ring_attention(*parts, blocks=blocks)
    out.sum().backward()
    return len(blocks), sum(b.untyped_storage().data_ptr() in kept for b in blocks)


def test_an_autograd_ring_keeps_every_key_value_block_it_received():
    for n in (2, 4):
        assert launch(_ring_blocks_kept, n, timeout=60) == [(n, n)] * n


def test_the_overlap_timeline_draws_each_transfer_from_post_to_wait():
    from d2lpar.strategies.context.timing import ring_overlap
    t = launch(ring_overlap, 4, 1, 4, 4, 64, 0.002, 2, timeout=60)[0]
    spans = [sp for sp in t["spans"] if sp[0].startswith("rank 0")]
    assert {sp[0].split()[1] for sp in t["spans"]} == {"0", "1", "2", "3"}   # every rank drawn
    blocks = [(s, e) for lane, label, s, e in spans if label == "block compute"]
    inflight = [(s, e) for lane, label, s, e in spans if label.startswith("transfer: post")]
    alone = [(s, e) for lane, label, s, e in spans if label.startswith("one transfer alone")]
    assert len(blocks) == 4 and len(inflight) == 3 and len(alone) == 3
    for (bs, be), (s, e), (a_s, a_e) in zip(blocks, inflight, alone):
        assert s <= bs and e >= be   # posted before the block, waited for after it
        assert a_s == s and a_e - a_s == pytest.approx(t["transfer"] / 3)
    ends = [r["end"] - r["start"] for r in t["per_rank"]]
    assert t["overlapped"] == pytest.approx(max(ends))   # the drawn run is the one timed


def test_the_overlap_check_fails_when_a_rank_waited_for_its_transfers_on_a_quiet_machine(
        monkeypatch):
    from d2lpar.infra.check import CheckFailed
    from d2lpar.strategies.context import timing as T
    monkeypatch.setattr(T, "busy_clause", lambda: "")
    ranks = lambda *idle: [{"idle": i} for i in idle]
    T.overlap_check({"transfer": 0.08, "per_rank": ranks(0.0002, 0.01)})   # hid: OK
    with pytest.raises(CheckFailed):   # a rank waited for most of the transfers: nothing hid
        T.overlap_check({"transfer": 0.08, "per_rank": ranks(0.0002, 0.07)})
    monkeypatch.setattr(T, "busy_clause", lambda: "\n  (a busy machine)")
    T.overlap_check({"transfer": 0.08, "per_rank": ranks(0.0002, 0.07)})   # prints, no raise


def _ulysses_gqa_and_bad_heads(S):
    """Grouped-query attention (12 query heads, 6 key/value heads: 4 and 2 per rank), then k/v
    heads that do not fit, each error caught on every rank (each raises before any message)."""
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, S, 4, generator=g) for h in (12, 6, 6))
    part = [R.split_sequence(t, n, False)[rank].requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*part, causal=True)
    out.square().sum().backward()
    errors = []
    for hq, hk, hv in ((12, 4, 4), (6, 4, 4), (6, 3, 6)):
        try:
            ulysses_attention(*(torch.randn(1, h, S // n, 4) for h in (hq, hk, hv)))
        except ValueError as e:
            errors.append(str(e))
    return out.detach(), [t.grad for t in part], errors


def test_ulysses_with_grouped_query_attention_equals_one_device_and_checks_the_kv_heads():
    """One 3-rank launch, about 0.3 s."""
    S, n = 9, 3
    res = launch(_ulysses_gqa_and_bad_heads, n, S, timeout=30)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, S, 4, generator=g).requires_grad_() for h in (12, 6, 6))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    ref.square().sum().backward()
    torch.testing.assert_close(R.merge_sequence([r[0] for r in res], False), ref.detach(),
                               rtol=1e-5, atol=1e-5)
    for i, t in enumerate((q, k, v)):
        torch.testing.assert_close(R.merge_sequence([r[1][i] for r in res], False), t.grad,
                                   rtol=1e-5, atol=1e-5)
    assert res[0][2] == [
        "Ulysses splits the 4 key/value heads over 3 ranks: they must divide evenly; use a number "
        "of ranks that divides 4 (or repeat the key/value heads, or ring attention)",
        "q has 6 heads and k/v 4: grouped-query attention needs the query heads to be a multiple "
        "of the key/value heads",
        "k has 3 heads and v 6: give k and v the same heads"]
