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



def test_layout_counts_that_make_no_layout_are_refused_by_field():
    """A count of 0 or below, or an int where DeepSpeed takes a list, is refused when the layout is made, by field: it
    was a ZeroDivisionError (num_global_blocks=0), an endless loop (a local window of 0 blocks), a raw TypeError, or
    silently another layout (num_random_blocks=-1 took all but one block of each row; global index -1 none)."""
    bad = [(lambda: ops.FixedLayout(num_global_blocks=0), r"FixedLayout: num_global_blocks=0; it must be an int >= 1"),
           (lambda: ops.FixedLayout(num_local_blocks="4"), r"FixedLayout: num_local_blocks='4'; it must be an int >= 1"),
           (lambda: ops.VariableLayout(local_window_blocks=(0,)), r"VariableLayout: local_window_blocks=\[0\] holds 0"),
           (lambda: ops.VariableLayout(local_window_blocks=()), r"VariableLayout: local_window_blocks=\[\]; give at least"),
           (lambda: ops.VariableLayout(local_window_blocks=4), r"VariableLayout: local_window_blocks=4; it must be a list"),
           (lambda: ops.VariableLayout(num_random_blocks=-1), r"VariableLayout: num_random_blocks=-1; it must be an int >= 0"),
           (lambda: ops.BigBirdLayout(num_global_blocks=-1), r"BigBirdLayout: num_global_blocks=-1; it must be an int >= 0"),
           (lambda: ops.BSLongformerLayout(global_block_indices=(-1,)), r"global_block_indices=\[-1\] holds -1"),
           (lambda: ops.FixedLayout(different_layout_per_head="false"), r"different_layout_per_head='false'; it must be True")]
    for make, message in bad:
        with pytest.raises(ValueError, match=message):
            make()
    with pytest.raises(ValueError, match=r"from_deepspeed: sparse_attention: num_global_blocks=0; it must be an int >= 1"):
        fzero.config.from_deepspeed({"sparse_attention": {"mode": "fixed", "num_global_blocks": 0}})


def test_block_lists_given_as_a_range_or_numpy_ints_make_the_layout_of_the_list():
    """The list fields are taken as any sequence of ints, as DeepSpeed iterates them and as they were before the
    fields were checked: a range or numpy ints (a config built in Python) were refused as "must be a list of ints"."""
    np = pytest.importorskip("numpy")
    made = ops.VariableLayout(local_window_blocks=range(1, 3), global_block_indices=range(0, 4, 3),
                              global_block_end_indices=[np.int64(1), np.int64(4)])
    listed = ops.VariableLayout(local_window_blocks=[1, 2], global_block_indices=[0, 3], global_block_end_indices=[1, 4])
    assert made == listed and all(type(v) is int for v in made.global_block_end_indices)
    assert torch.equal(made.blocks(6), listed.blocks(6))
    assert ops.BSLongformerLayout(global_block_indices=range(2)) == ops.BSLongformerLayout(global_block_indices=[0, 1])


def test_sparse_attention_names_a_wrong_layout_or_mixed_dtypes():
    """Not a layout (a mode name, a config block, the class), q, k, v of different dtypes and a scale that is not a
    number: errors naming the value and the fix, not an AttributeError, einsum's "expected scalar type Float but found
    BFloat16" or "only integer tensors of a single element can be converted to an index"."""
    q = torch.randn(1, 2, 8, 4)
    for layout in ("fixed", {"mode": "fixed"}, ops.FixedLayout):
        with pytest.raises(TypeError, match=r"sparse_attention: layout=.*pass a layout such as fzero.ops.FixedLayout"):
            ops.sparse_attention(q, q, q, layout)
    with pytest.raises(ValueError, match=r"must share one floating dtype.*torch.float32, torch.bfloat16, torch.float32"):
        ops.sparse_attention(q, q.bfloat16(), q, ops.DenseLayout(block=4))
    with pytest.raises(ValueError, match=r"must share one floating dtype.*torch.int64"):
        ops.sparse_attention(q.long(), q.long(), q.long(), ops.DenseLayout(block=4))
    with pytest.raises(ValueError, match=r"sparse_attention: scale='1'; pass a finite number"):
        ops.sparse_attention(q, q, q, ops.DenseLayout(block=4), scale="1")

def test_a_frozen_layouts_blocks_are_made_and_checked_once_per_length_and_a_bad_one_is_refused_at_every_call(monkeypatch):
    """A model calls sparse_attention in every layer of every step with one layout: its blocks are made (Python loops)
    and checked once per length, on the host (checked on the device, reading the check waited for the GPU in every
    layer). A layout that fails the check is refused at every call, not only the first; an unhashable layout (not a
    frozen config) is made anew at each call, so a change to it is seen."""
    import dataclasses

    made = []
    real = ops.FixedLayout.blocks
    monkeypatch.setattr(ops.FixedLayout, "blocks", lambda self, n: made.append(n) or real(self, n))
    layout = ops.FixedLayout(block=4, num_local_blocks=2, num_heads=7)  # a layout no other test makes
    q = torch.randn(1, 2, 12, 4)
    first = ops.sparse_attention(q, q, q, layout)
    for _ in range(3):
        torch.testing.assert_close(ops.sparse_attention(q, q, q, layout), first, rtol=0, atol=0)
    ops.sparse_attention(torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4), layout)
    assert made == [3, 5]

    @dataclasses.dataclass(frozen=True)
    class NoDiagonal:
        block: int = 4

        def blocks(self, n):
            return torch.zeros(1, n, n, dtype=torch.bool)

    for _ in range(2):
        with pytest.raises(ValueError, match=r"NoDiagonal leaves out a diagonal block at 3 blocks"):
            ops.sparse_attention(q, q, q, NoDiagonal())

    class Mutable:  # not hashable: eq without hash
        block = 4

        def __init__(self):
            self.keep = True

        def __eq__(self, other):
            return self is other

        def blocks(self, n):
            return torch.ones(1, n, n, dtype=torch.bool) if self.keep else torch.eye(n, dtype=torch.bool)[None]

    mutable = Mutable()
    dense = ops.sparse_attention(q, q, q, mutable)
    mutable.keep = False
    own_block = torch.block_diag(*[torch.ones(4, 4, dtype=torch.bool)] * 3)  # each query its own block's keys alone
    torch.testing.assert_close(ops.sparse_attention(q, q, q, mutable), F.scaled_dot_product_attention(q, q, q, attn_mask=own_block))
    torch.testing.assert_close(dense, F.scaled_dot_product_attention(q, q, q))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch 2.11's inductor import
def test_a_frozen_layout_compiles_without_dynamo_s_lru_cache_warning():
    """Under ``torch.compile`` (a unit under ``jit=True``) the blocks are made as they are traced, not looked up in
    their cache: Dynamo does not call an ``lru_cache``, and warned "Dynamo detected a call to a
    functools.lru_cache-wrapped function" at every compile of the reference path (an error here, where warnings are)."""
    layout = ops.FixedLayout(block=4, num_local_blocks=2)
    q = torch.randn(1, 2, 12, 4)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ops.sparse_attention(x, x, x, layout, impl="torch"), backend="eager")
    torch.testing.assert_close(compiled(q), ops.sparse_attention(q, q, q, layout, impl="torch"), rtol=0, atol=0)


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
    # DeepSpeed reads a present block with its default mode, "fixed", and that mode's defaults: not dense attention
    assert fzero.config.from_deepspeed({"sparse_attention": {}}).sparse_attention == ops.FixedLayout()
    assert fzero.config.from_deepspeed({}).sparse_attention is None


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


def _padding(batch: int, seq: int, side: str) -> torch.Tensor:
    """A (batch, seq) bool padding mask: row 0 unpadded, the others padded on ``side`` by 3, 7, ... tokens."""
    keep = torch.ones(batch, seq, dtype=torch.bool)
    for r in range(1, batch):
        n = min(4 * r - 1, seq - 1)
        keep[r, seq - n:] = False if side == "right" else keep[r, seq - n:]
        keep[r, :n] = False if side == "left" else keep[r, :n]
    return keep


@pytest.mark.parametrize("form", ["keys", "hf-4d"])  # (batch, 1, 1, seq) key padding; Hugging Face's (batch, 1, seq, seq)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["fixed", "fixed-uni-4heads", "variable", "bigbird"])
def test_a_padding_mask_is_honoured_with_the_layout_forward_and_backward(name, causal, side, form):
    """A model's padding mask (``attn_mask``, as SDPA takes it) is ANDed with the layout: the result is SDPA's with the
    layout's mask AND the padding mask, forward and gradients, a query with no key left included (zeros, as SDPA).
    Without it a Hugging Face model's padded batch attended its pad tokens (left padding: about 1.0 off at the real
    tokens of a tiny GPT-2 / Llama)."""
    layout = LAYOUTS[name]
    seq = 21  # not a whole number of blocks
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 3, seq, 8, generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(3, 3, seq, 8, generator=gen)
    keys = _padding(3, seq, side)
    if form == "keys":
        mask = keys[:, None, None, :]
    else:  # what transformers' sdpa_mask hands an attention function: padding and, for a decoder, causality
        mask = keys[:, None, None, :] & (torch.ones(seq, seq, dtype=torch.bool).tril() if causal else True)
    out = ops.sparse_attention(q, k, v, layout, causal=causal, attn_mask=mask)
    mine = torch.autograd.grad(out, (q, k, v), grad)
    dense_mask = ops.token_mask(layout, seq, causal=causal) & mask
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    unmasked = ops.sparse_attention(q, k, v, layout, causal=causal)
    assert (unmasked - ref).abs().max() > 1e-2  # the mask changes the result: it is not silently dropped


def test_bad_attention_masks_are_named_and_v_may_have_another_head_dim():
    q = torch.randn(2, 2, 8, 4)
    with pytest.raises(ValueError, match=r"attn_mask must be a bool tensor.*torch.float32"):
        ops.sparse_attention(q, q, q, ops.FixedLayout(block=4), attn_mask=torch.zeros(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 1, 1, 8\) does not broadcast to"):
        ops.sparse_attention(q, q, q, ops.FixedLayout(block=4), attn_mask=torch.ones(3, 1, 1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"grouped-query attention repeat k and v"):
        ops.sparse_attention(q, q[:, :1], q[:, :1], ops.FixedLayout(block=4))
    v = torch.randn(2, 2, 7, 6)
    q7 = torch.randn(2, 2, 7, 4)
    out = ops.sparse_attention(q7, q7, v, ops.FixedLayout(block=4))  # v's head_dim need not be q's (as SDPA)
    ref = F.scaled_dot_product_attention(q7, q7, v, attn_mask=ops.token_mask(ops.FixedLayout(block=4), 7))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_per_head_layout_from_a_config_block_gives_each_head_its_pattern():
    """DeepSpeed's block has no head count (its sparse attention takes the model's), so the layout the config gives has
    num_heads=1; with different_layout_per_head, each of the model's heads still takes its own global pattern."""
    block = {"mode": "fixed", "block": 4, "different_layout_per_head": True, "num_local_blocks": 4,
             "num_global_blocks": 1, "num_different_global_patterns": 4}
    layout = fzero.config.from_deepspeed({"sparse_attention": block}).sparse_attention
    per_head = ops.FixedLayout(block=4, num_heads=4, different_layout_per_head=True, num_local_blocks=4,
                               num_different_global_patterns=4)
    assert torch.equal(ops.token_mask(layout, 32, heads=4), ops.token_mask(per_head, 32))
    assert not torch.equal(ops.token_mask(per_head, 32)[0], ops.token_mask(per_head, 32)[1])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ops.token_mask(per_head, 32))
    torch.testing.assert_close(ops.sparse_attention(q, k, v, layout), ref, rtol=1e-5, atol=1e-5)  # was 0.7 off


@pytest.mark.parametrize("kind", ["bert", "llama-gqa"])
def test_sparse_attention_in_a_hugging_face_model_honours_its_padding(kind):
    """A tiny random-init Hugging Face model with fzero's sparse attention in its attention (transformers'
    AttentionInterface, the mask made as for "sdpa"), on a left- and a right-padded batch: its output at the real tokens
    equals the same model's with SDPA under the layout's mask AND the padding mask."""
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    layout = ops.FixedLayout(block=4, num_local_blocks=2)

    def heads(query, key, value):
        n = query.shape[1] // key.shape[1]  # grouped-query attention: k and v repeated to the query heads
        return key.repeat_interleave(n, 1), value.repeat_interleave(n, 1)

    def sparse(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        key, value = heads(query, key, value)
        out = ops.sparse_attention(query, key, value, layout, causal=module.is_causal, scale=scaling, attn_mask=attention_mask)
        return out.transpose(1, 2), None

    def dense(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        key, value = heads(query, key, value)
        mask = ops.token_mask(layout, query.shape[2], causal=module.is_causal)
        mask = mask if attention_mask is None else mask & attention_mask
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2), None

    for name, fn in (("fzero_test_sparse", sparse), ("fzero_test_dense", dense)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)

    def model(impl):
        torch.manual_seed(0)
        if kind == "bert":
            cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                          vocab_size=100, attn_implementation=impl)
            return transformers.BertModel(cfg).eval()
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=100, attn_implementation=impl)
        return transformers.LlamaModel(cfg).eval()

    ids = torch.randint(1, 100, (3, 14), generator=torch.Generator().manual_seed(0))
    for side in ("right", "left"):
        keep = _padding(3, 14, side)
        with torch.no_grad():
            got = model("fzero_test_sparse")(input_ids=ids, attention_mask=keep.long()).last_hidden_state
            want = model("fzero_test_dense")(input_ids=ids, attention_mask=keep.long()).last_hidden_state
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


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


@_COMPILE_NOISE[0]
@_COMPILE_NOISE[1]
def test_the_flex_block_mask_with_a_padding_mask_equals_torchs_eager_one():
    """The CPU twin of the GPU path's mask with a caller's padding mask: per batch row, the layout AND the padding."""
    from torch.nn.attention.flex_attention import create_block_mask

    from fzero.ops import _sparse

    layout, seq_len = ops.FixedLayout(block=16, num_local_blocks=2, attention="unidirectional"), 100
    blocks = layout.blocks(-(-seq_len // layout.block))
    keep = _padding(2, seq_len, "left")
    keep[1, :40] = False
    pad = keep[:, None, None, :].expand(2, 1, seq_len, seq_len)
    got = _sparse._make_block_mask(blocks, layout.block, seq_len, True, torch.device("cpu"), attn_mask=pad)

    def mask_mod(b, h, qi, ki):
        return blocks[0, qi // layout.block, ki // layout.block] & (ki <= qi) & keep[b, ki]

    want = create_block_mask(mask_mod, B=2, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu")
    assert torch.equal(got.to_dense(), want.to_dense()) and torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(got.kv_indices, want.kv_indices) and torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU twin: the reference tests above)")
@_COMPILE_NOISE[0]
@_COMPILE_NOISE[1]
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flex_attention_equals_the_block_sparse_reference(causal, padded):
    layout = ops.FixedLayout(block=16, num_local_blocks=4, attention="unidirectional" if causal else "bidirectional")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", generator=gen, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 4, 200, 64, device="cuda", generator=gen)
    mask = _padding(2, 200, "right").cuda()[:, None, None, :] if padded else None
    out = ops.sparse_attention(q, k, v, layout, causal=causal, impl="flex", attn_mask=mask)
    ref = ops.sparse_attention(q, k, v, layout, causal=causal, impl="torch", attn_mask=mask)
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
