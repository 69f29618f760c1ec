"""Block-sparse attention (fzero.ops.sparse_attention) with DeepSpeed's sparsity layouts: each layout's blocks by
DeepSpeed's rules, the block-sparse reference against dense attention with the same mask (forward and gradients),
and a GPT trained with it at every stage against the same GPT with dense masked attention."""

import pytest
import torch
import torch.nn.functional as F

import fzero
import fzero.ops as ops
from fzero.models import GPT, GPTConfig, gpt_loss

LAYOUTS = {
    "dense": ops.DenseLayout(block=4),
    "fixed": ops.FixedLayout(block=4, num_local_blocks=2),
    "fixed-uni-4heads": ops.FixedLayout(block=4, num_heads=3, num_local_blocks=2, attention="unidirectional",
                                        different_layout_per_head=True, num_different_global_patterns=2),
    "variable": ops.VariableLayout(block=4, num_random_blocks=1, local_window_blocks=(1, 2), global_block_indices=(0, 3)),
    "bigbird": ops.BigBirdLayout(block=4, num_random_blocks=1),
    "bslongformer": ops.BSLongformerLayout(block=4, global_block_indices=(0, 2), global_block_end_indices=(1, 4)),
}


def _grid(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in r] for r in rows])


# -- the layouts, by DeepSpeed's rules (sparsity_config.py of its retired sparse attention) --------------------------


def test_fixed_layout_local_windows_and_their_last_block_as_global():
    bi = ops.FixedLayout(num_local_blocks=4).blocks(8)[0]
    assert torch.equal(bi, _grid(["xxxx...x", "xxxx...x", "xxxx...x", "xxxx...x",
                                  "...xxxxx", "...xxxxx", "...xxxxx", "...xxxxx"]))
    uni = ops.FixedLayout(num_local_blocks=4, attention="unidirectional").blocks(8)[0]
    assert torch.equal(uni, _grid(["x.......", "xx......", "xxx.....", "xxxx....",
                                   "...xx...", "...xxx..", "...xxxx.", "...xxxxx"]))
    horizontal = ops.FixedLayout(num_local_blocks=4, horizontal_global_attention=True).blocks(8)[0]
    assert horizontal[3].all() and horizontal[7].all() and torch.equal(horizontal[:, 3], torch.ones(8, dtype=torch.bool))
    short = ops.FixedLayout(num_local_blocks=4).blocks(6)[0]  # a short last window: its global block is its last
    assert torch.equal(short, _grid(["xxxx.x", "xxxx.x", "xxxx.x", "xxxx.x", "...xxx", "...xxx"]))
    heads = ops.FixedLayout(num_heads=4, num_local_blocks=4, different_layout_per_head=True,
                            num_different_global_patterns=4).blocks(4)  # head h: the window's (h+1)-th block from the end
    for h in range(4):
        assert heads[h][:, 3 - h].all()


def test_bigbird_and_bslongformer_layouts():
    bird = ops.BigBirdLayout(num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1).blocks(8)[0]
    band = torch.ones(8, 8, dtype=torch.bool).triu(-1) & torch.ones(8, 8, dtype=torch.bool).tril(1)
    assert (bird >= band).all() and bird[0].all() and bird[:, 0].all()
    assert (bird[1:].sum(1) <= band[1:].sum(1) + 2).all()  # the global column and one random block a row (row 0 is global)
    uni = ops.BigBirdLayout(attention="unidirectional").blocks(8)[0]
    assert not uni.triu(1).any() and uni[:, 0].all()
    longformer = ops.BSLongformerLayout(num_sliding_window_blocks=3, global_block_indices=(2,)).blocks(6)[0]
    assert torch.equal(longformer, _grid(["xxx...", "xxx...", "xxxxxx", "..xxx.", "..xxxx", "..x.xx"]))
    ranged = ops.BSLongformerLayout(global_block_indices=(0,), global_block_end_indices=(2,)).blocks(5)[0]
    assert ranged[:2].all() and ranged[:, :2].all()


def test_variable_layout_windows_globals_and_random_blocks():
    v = ops.VariableLayout(local_window_blocks=(1, 2), global_block_indices=(4,)).blocks(7)[0]
    # windows [0], [1-2], then the last size again: [3-4], [5-6]; block 4 global (columns, all rows)
    assert torch.equal(v, _grid(["x...x..", ".xx.x..", ".xx.x..", "...xx..", "...xx..", "....xxx", "....xxx"]))
    r = ops.VariableLayout(num_random_blocks=2, local_window_blocks=(1,), global_block_indices=()).blocks(6)[0]
    assert (r.sum(1) >= 2).all() and (r.sum(1) <= 3).all()  # its own block and two random ones (maybe the same)
    assert torch.equal(r, ops.VariableLayout(num_random_blocks=2, local_window_blocks=(1,), global_block_indices=()).blocks(6)[0])


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match=r"FixedLayout: num_local_blocks=4 is not a multiple of num_global_blocks=3"):
        ops.FixedLayout(num_local_blocks=4, num_global_blocks=3)
    with pytest.raises(ValueError, match=r"horizontal_global_attention needs attention='bidirectional'"):
        ops.FixedLayout(attention="unidirectional", horizontal_global_attention=True)
    with pytest.raises(ValueError, match=r"attention='causal'; use 'bidirectional' or 'unidirectional'"):
        ops.BigBirdLayout(attention="causal")
    with pytest.raises(ValueError, match=r"num_sliding_window_blocks=3 is more than the 2 blocks"):
        ops.BigBirdLayout(block=8).blocks(2)
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"the layout has 3 head layouts for 2 heads"):
        ops.sparse_attention(q, q, q, ops.FixedLayout(block=4, num_heads=3, different_layout_per_head=True))


def test_the_deepspeed_config_block_gives_the_layout():
    block = {"mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4,
             "num_global_blocks": 1, "attention": "bidirectional", "horizontal_global_attention": False,
             "num_different_global_patterns": 4}
    settings = fzero.config.from_deepspeed({"sparse_attention": block})
    assert settings.sparse_attention == ops.FixedLayout(block=16, different_layout_per_head=True, num_local_blocks=4,
                                                        num_global_blocks=1, num_different_global_patterns=4)
    assert "sparse_attention" in str(settings)
    with pytest.raises(ValueError, match=r"sparse_attention: unknown keys \['num_local_blocks'\] for mode 'bigbird'"):
        fzero.config.from_deepspeed({"sparse_attention": {"mode": "bigbird", "num_local_blocks": 4}})
    with pytest.raises(ValueError, match=r"sparse_attention: mode='sparse'; DeepSpeed's modes are"):
        fzero.config.from_deepspeed({"sparse_attention": {"mode": "sparse"}})


# -- the computation against dense attention with the same mask -------------------------------------------------------


@pytest.mark.parametrize("seq", [16, 21])  # a whole number of blocks, and not
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_block_sparse_equals_dense_masked_attention_forward_and_backward(name, causal, seq):
    layout = LAYOUTS[name]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, seq, 8, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, seq, 8, generator=gen)
    out = ops.sparse_attention(q, k, v, layout, causal=causal)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    mask = ops.token_mask(layout, seq, causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    # fp32: the two sum the same terms in another order
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # bf16: both against the fp32 result, the block-sparse one within the error dense bf16 attention makes itself
    low = [t.detach().bfloat16() for t in (q, k, v)]
    err_sparse = (ops.sparse_attention(*low, layout, causal=causal).float() - ref.detach()).abs().max()
    err_dense = (F.scaled_dot_product_attention(*low, attn_mask=mask).float() - ref.detach()).abs().max()
    assert err_sparse <= 2 * err_dense + 1e-3


def test_a_gpt_with_sparse_attention_trains_at_every_stage_as_with_dense_masked_attention(monkeypatch):
    layout = ops.FixedLayout(block=4, num_local_blocks=2, attention="unidirectional")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 17), generator=gen) for _ in range(3)]

    def run(stages):
        torch.manual_seed(0)
        model = GPT(GPTConfig.tiny(sparse_attention=layout))
        step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b[:, :-1]), b[:, 1:]),
                             optimizer=fzero.optim.sgd(0.5), stages=stages, mesh=fzero.local_mesh(2))  # SGD: no amplified rounding
        state = step.init(fzero.params_of(model))
        for b in batches:
            state, _ = step(state, b)
        return step.gather(state)

    sparse = {s: run(s) for s in (0, 1, 2, 3)}
    dense_masked = lambda q, k, v, lay, causal: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=ops.token_mask(lay, q.shape[2], causal=causal))
    monkeypatch.setattr(ops, "sparse_attention", dense_masked)
    dense = run(0)
    for s, got in sparse.items():
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)  # fp32 rounding of two orders of the sums
    moved = any((dense[n] - GPT(GPTConfig.tiny()).state_dict()[n]).abs().max() > 1e-3 for n in dense)
    assert moved


# torch's own warnings from compiling: inductor imports torch.utils.mkldnn, which uses torch.jit.script_method, and
# dynamo, tracing create_block_mask, instantiates an autograd Function
_COMPILE_NOISE = [pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
                  pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")]


@_COMPILE_NOISE[0]
@_COMPILE_NOISE[1]
@pytest.mark.parametrize("layout, seq_len, causal", [
    (ops.FixedLayout(block=16, num_local_blocks=2, num_global_blocks=1, attention="unidirectional"), 200, True),
    (ops.BigBirdLayout(block=16), 160, False),
])
def test_the_flex_block_mask_is_made_compiled_and_equals_torchs_eager_one(layout, seq_len, causal):
    """The CPU twin of the GPU path's mask: ``create_block_mask`` compiled (uncompiled it evaluates every query-key pair
    at once: 25.6 GB at 32k tokens on an H200) gives the same block mask as torch's eager one, blocks and counts."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fzero.ops import _sparse

    blocks = layout.blocks(-(-seq_len // layout.block))
    got = _sparse._make_block_mask(blocks, layout.block, seq_len, causal, torch.device("cpu"))
    heads = blocks.shape[0]

    def mask_mod(b, h, qi, ki):
        keep = blocks[h if heads > 1 else 0, qi // layout.block, ki // layout.block]
        return keep & (ki <= qi) if causal else keep

    want = create_block_mask(mask_mod, B=None, H=heads if heads > 1 else None, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu")
    assert torch.equal(got.to_dense(), want.to_dense()) and torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(got.kv_indices, want.kv_indices) and torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU twin: the reference tests above)")
@_COMPILE_NOISE[0]
@_COMPILE_NOISE[1]
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flex_attention_equals_the_block_sparse_reference(causal):
    layout = ops.FixedLayout(block=16, num_local_blocks=4, attention="unidirectional" if causal else "bidirectional")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 200, 64, device="cuda", generator=gen)
    out = ops.sparse_attention(q, k, v, layout, causal=causal, impl="flex")
    ref = ops.sparse_attention(q, k, v, layout, causal=causal, impl="torch")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # two kernels' fp32 orders of summation
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_the_benchmark_runs_on_cpu(tmp_path):
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "sparse_attention.py")
    spec = importlib.util.spec_from_file_location("sparse_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(["--device", "cpu", "--lengths", "64,70", "--heads", "2", "--block", "16", "--repeats", "1",
                       "--json-out", str(out)])
    assert [r["tokens"] for r in rows] == [64, 70] and all(r["sparse"]["ms"] > 0 and r["dense"]["ms"] > 0 for r in rows)
    assert json.loads(out.read_text())["device"] == "cpu"
