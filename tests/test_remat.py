"""fzero.remat: the same values and gradients as the function it wraps, under torch.func.grad, torch.func.vjp
and plain autograd (bitwise: the recompute runs the same kernels on the same inputs), with far fewer live
activation bytes; captured tensors that need a gradient are refused.

Measured on the 12-block GPT below (d_model 128, 4 heads, seq 128, batch 8; 2-core CPU, torch 2.13): peak live
bytes during torch.func.grad of the loss 192.1 MB plain, 25.4 MB with every block remat'ed (0.13x);
``benchmarks/remat_memory.py`` prints the same with offload and times.
"""

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fzero
from fzero.autodiff._remat import remat
from fzero.memory import LiveBytes
from fzero.models import GPT, GPTConfig, gpt_loss
from fzero.testing import assert_trees_equal

OFFLOADS = [None, "cpu"]


def _sub(params, prefix):
    return {k[len(prefix) + 1:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def gpt_logits(model, params, idx, *, wrap=False, offload=None, dropout=0.0):
    """The repo GPT's forward from its submodules, each block run on explicit params (optionally remat'ed,
    optionally followed by dropout inside the remat'ed function).

    ``fzero.apply`` is ``torch.func.functional_call`` on a per-rank-thread clone of the module: on a multi-rank
    local mesh, functional_call on the shared module itself races (each thread swaps its params in)."""
    x = F.embedding(idx, params["tok_emb.weight"]) + F.embedding(torch.arange(idx.shape[1]), params["pos_emb.weight"])
    for i, block in enumerate(model.blocks):
        def run(p, x, block=block):
            y = fzero.apply(block, p, x)
            return F.dropout(y, dropout) if dropout else y
        x = (remat(run, offload=offload) if wrap else run)(_sub(params, f"blocks.{i}"), x)
    x = fzero.apply(model.ln_f, _sub(params, "ln_f"), x)
    return F.linear(x, params["tok_emb.weight"])


def gpt_problem(cfg, batch, seed=0):
    torch.manual_seed(seed)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return model, fzero.params_of(model), tokens[:, :-1], tokens[:, 1:]


def grads_by(mode, loss_fn, params):
    """(loss, grads) of ``loss_fn(params)`` by torch.func.grad, torch.func.vjp or loss.backward()."""
    if mode == "grad":
        grads, loss = torch.func.grad_and_value(loss_fn)(params)
        return loss, grads
    if mode == "vjp":
        loss, vjp = torch.func.vjp(loss_fn, params)
        return loss, vjp(torch.ones_like(loss))[0]
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    loss = loss_fn(leaves)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("mode", ["grad", "vjp", "backward"])
def test_gpt_blocks_give_bitwise_equal_grads(mode, offload):
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=3), batch=4)
    plain = grads_by(mode, lambda p: gpt_loss(gpt_logits(model, p, x), y), params)
    rematted = grads_by(mode, lambda p: gpt_loss(gpt_logits(model, p, x, wrap=True, offload=offload), y), params)
    assert_trees_equal(rematted, plain)
    # and the hand-written forward is the model's own
    assert_trees_equal(plain[0], gpt_loss(fzero.apply(model, params, x), y).detach())


@pytest.mark.parametrize("mode", ["grad", "vjp", "backward"])
def test_dropout_mask_is_replayed_and_rng_is_left_as_without_remat(mode):
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=2), batch=4)
    results = {}
    for wrap in (False, True):
        torch.manual_seed(123)
        loss, grads = grads_by(mode, lambda p: gpt_loss(gpt_logits(model, p, x, wrap=wrap, dropout=0.3), y), params)
        results[wrap] = (loss, grads, torch.rand(4))  # the RNG stream goes on from the same place
    assert_trees_equal(results[True], results[False])
    # dropout really acted: without it the loss differs
    assert not torch.equal(results[False][0], gpt_loss(gpt_logits(model, params, x), y).detach())


def _tree_fn(inputs, scale, *, tag, bias=None):
    w, (a, b) = inputs["w"], inputs["pair"]
    h = torch.tanh(a @ w) * scale + b.sum()
    if bias is not None:
        h = h + bias
    return {
        "h": [h, h.square()],
        "count": inputs["idx"].sum(),  # integer: not differentiable
        "const": torch.ones(2),  # does not depend on the inputs
        "tag": tag,
        "twice": (h.mean(), a),  # an input returned as is
    }


def _tree_loss(fn, idx):
    def loss(inputs, bias):
        out = fn({**inputs, "idx": idx}, 3.0, tag="t", bias=bias)
        assert out["tag"] == "t" and out["count"].dtype == torch.int64
        return out["h"][0].sum() + out["h"][1].mean() + out["twice"][0] * 2 + out["twice"][1].sum() * out["const"].sum()
    return loss


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("mode", ["grad", "backward"])
def test_pytrees_in_and_out_with_non_tensors_and_integer_tensors(mode, offload):
    torch.manual_seed(0)
    inputs = {"w": torch.randn(3, 4), "pair": (torch.randn(2, 3), torch.randn(5))}
    idx = torch.arange(4)
    bias = torch.randn(4)
    got, want = {}, {}
    for wrap, res in ((True, got), (False, want)):
        fn = remat(_tree_fn, offload=offload) if wrap else _tree_fn
        loss = _tree_loss(fn, idx)
        if mode == "grad":
            res["grads"] = torch.func.grad(loss, argnums=(0, 1))(inputs, bias)
        else:
            leaves = {"w": inputs["w"].clone().requires_grad_(), "pair": tuple(t.clone().requires_grad_() for t in inputs["pair"])}
            b = bias.clone()  # not differentiated: its grad is not asked for
            loss(leaves, b).backward()
            res["grads"] = (leaves["w"].grad, [t.grad for t in leaves["pair"]])
        res["out"] = fn({**inputs, "idx": idx}, 3.0, tag="t", bias=bias)
    assert_trees_equal(got, want)


def test_unused_input_gets_no_gradient_as_without_remat():
    torch.manual_seed(0)
    a, b = torch.randn(3), torch.randn(3)

    def fn(a, b):
        return a.exp()

    for wrap in (False, True):
        f = remat(fn) if wrap else fn
        ga, gb = torch.func.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1))(a, b)
        assert torch.equal(ga, a.exp()) and torch.equal(gb, torch.zeros(3))
        la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
        f(la, lb).sum().backward()
        assert torch.equal(la.grad, a.exp()) and lb.grad is None


def test_no_grad_calls_fn_directly():
    calls = []

    def fn(x):
        calls.append(x)
        return x * 2

    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        out = remat(fn)(x)
    assert torch.equal(out, x.detach() * 2) and not out.requires_grad and len(calls) == 1


def test_intermediate_activations_are_not_kept():
    """Plain autograd: what the graph of one remat'ed block keeps is its input, not its activations."""
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=1, d_model=64, seq_len=32), batch=8)
    h = torch.randn(8, 32, 64, requires_grad=True)
    p = _sub({k: v.requires_grad_() for k, v in params.items()}, "blocks.0")
    with LiveBytes() as plain:
        out = functional_call(model.blocks[0], p, (h,))
    del out
    with LiveBytes() as rem:
        out = remat(lambda p, h: functional_call(model.blocks[0], p, (h,)))(p, h)
        kept = rem.live - out.untyped_storage().nbytes()
    assert kept < 0.05 * plain.peak, (kept, plain.peak)  # the RNG state (5 kB) and little else


def test_gpt_12_blocks_peak_live_bytes_well_below_plain(record_property):
    """Every block remat'ed: peak live bytes during torch.func.grad of the loss < 0.5x the plain run."""
    model, params, x, y = gpt_problem(GPTConfig(n_layer=12, n_head=4, d_model=128, seq_len=128), batch=8)
    peaks, grads = {}, {}
    for wrap in (False, True):
        loss_fn = lambda p: gpt_loss(gpt_logits(model, p, x, wrap=wrap), y)  # noqa: E731
        with LiveBytes() as lb:
            grads[wrap] = torch.func.grad(loss_fn)(params)
        peaks[wrap] = lb.peak
    record_property("peak_live_bytes_plain", peaks[False])
    record_property("peak_live_bytes_remat", peaks[True])
    print(f"peak live bytes: plain {peaks[False] / 1e6:.1f} MB, remat {peaks[True] / 1e6:.1f} MB ({peaks[True] / peaks[False]:.2f}x)")
    assert peaks[True] < 0.5 * peaks[False], peaks
    assert_trees_equal(grads[True], grads[False])


@pytest.mark.parametrize("stages", [0, 1, 2])
def test_inside_a_compiled_step_at_stages_0_to_2_changes_nothing(stages):
    """loss_fn remats its blocks on the params it receives (a dict, or stage 2's ReplicatedParams read by name)."""
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=2), batch=4)
    final = {}
    for wrap in (False, True):
        def loss_fn(p, b):
            return gpt_loss(gpt_logits(model, p, b["x"], wrap=wrap), b["y"])
        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=stages, mesh=fzero.local_mesh(2) if stages else None)
        state = step.init(fzero.params_of(model))
        for _ in range(2):
            state, _ = step(state, {"x": x, "y": y})
        final[wrap] = step.gather(state)
    assert_trees_equal(final[True], final[False])


def test_stage_3_params_are_refused_with_the_reason():
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=2), batch=4)

    def loss_fn(p, b):
        return gpt_loss(remat(lambda p, x: fzero.apply(model, p, x))(p, b["x"]), b["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(2))
    with pytest.raises(TypeError, match=r"(?s)fzero\.remat: .* ShardedParams .* stage 3.* remat=True"):
        step(step.init(params), {"x": x, "y": y})


def test_autocast_state_is_replayed_when_backward_runs_outside_it():
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=2), batch=4)
    grads = {}
    for wrap in (False, True):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt_loss(gpt_logits(model, leaves, x, wrap=wrap), y)
        loss.backward()  # outside autocast: the recompute must run in bf16 as the forward did
        grads[wrap] = (loss.detach(), {k: v.grad for k, v in leaves.items()})
    assert_trees_equal(grads[True], grads[False])


def test_captured_tensor_that_needs_grad_is_refused():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=1))
    params = fzero.params_of(model)
    x = torch.randn(2, 16, 32)
    block = model.blocks[0]

    # the closure over the params of an outer torch.func.grad: the grad would silently be zero
    def closure_loss(params, x):
        return remat(lambda x: functional_call(block, _sub(params, "blocks.0"), (x,)))(x).sum()

    with pytest.raises(RuntimeError, match=r"fzero\.remat: .* requires grad but is not one of its arguments"):
        torch.func.grad(closure_loss)(params, x)
    # plain autograd: the module's own parameters are captured
    with pytest.raises(RuntimeError, match=r"not one of its arguments \(shape \(32,\), torch.float32, in torch.nn.functional.layer_norm\)"):
        remat(block)(x.requires_grad_())
    # explicit params: fine, and equal to the non-remat grads
    explicit = lambda p, x: remat(lambda p, x: functional_call(block, p, (x,)))(p, x).sum()  # noqa: E731
    reference = lambda p, x: functional_call(block, p, (x,)).sum()  # noqa: E731
    sub = _sub(params, "blocks.0")
    assert_trees_equal(torch.func.grad(explicit, argnums=(0, 1))(sub, x), torch.func.grad(reference, argnums=(0, 1))(sub, x))


def test_captured_tensors_without_grad_and_metadata_reads_are_fine():
    w = torch.randn(3, 3, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0])

    def fn(x):
        n = w.shape[0]  # metadata of a captured grad-requiring tensor: no gradient involved
        return (x * mask)[:n] + w.detach().sum()

    x = torch.randn(3, requires_grad=True)
    remat(fn)(x).sum().backward()
    assert torch.equal(x.grad, mask)


def test_double_backward_is_refused():
    x = torch.randn(3, requires_grad=True)
    (g,) = torch.autograd.grad(remat(torch.sin)(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="fzero.remat: double backward"):
        g.sum().backward()


def test_errors():
    with pytest.raises(ValueError, match=r"fzero\.remat: offload='gpu' is not supported; choose one of \(None, 'cpu'\)"):
        remat(torch.sin, offload="gpu")
    with pytest.raises(ValueError, match=r"fzero\.remat: offload=True"):
        remat(torch.sin, offload=True)
    with pytest.raises(TypeError, match=r"fzero\.remat: fn must be callable, got int"):
        remat(3)


def test_wraps_keeps_name_and_does_not_copy_module_state():
    def block_fn(x):
        return x

    assert remat(block_fn).__name__ == "block_fn" and remat(block_fn).__wrapped__ is block_fn
    lin = torch.nn.Linear(2, 2)
    assert "_parameters" not in vars(remat(lin))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", OFFLOADS)
def test_cuda_offload_equal_grads_and_dropout(offload):
    model, params, x, y = gpt_problem(GPTConfig.tiny(n_layer=3), batch=4)
    model, x, y = model.cuda(), x.cuda(), y.cuda()
    params = {k: v.cuda() for k, v in params.items()}

    def logits(p, wrap):
        h = F.embedding(x, p["tok_emb.weight"]) + F.embedding(torch.arange(x.shape[1], device="cuda"), p["pos_emb.weight"])
        for i, block in enumerate(model.blocks):
            def run(q, h, block=block):
                return F.dropout(functional_call(block, q, (h,)), 0.2)
            h = (remat(run, offload=offload) if wrap else run)(_sub(p, f"blocks.{i}"), h)
        return F.linear(functional_call(model.ln_f, _sub(p, "ln_f"), (h,)), p["tok_emb.weight"])

    res = {}
    for wrap in (False, True):
        torch.manual_seed(7)
        res[wrap] = torch.func.grad_and_value(lambda p: gpt_loss(logits(p, wrap), y))(params)
    torch.cuda.synchronize()
    assert_trees_equal(res[True], res[False])


def test_a_tensor_that_outlives_the_forward_besides_its_outputs_is_refused():
    """What fn computes from its differentiable arguments and keeps elsewhere (a list, an attribute) has no graph under
    remat, so a loss using it would get no gradient through it: refused. Kept detached, returned, or computed from
    what needs no gradient, it is fine; so is an in-place write into a tensor fn was given (a buffer's statistics)."""
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    kept = []

    def stores(w, x):
        h = torch.tanh(x @ w)
        kept.append(h)  # leaves fn without its graph
        return h.sum(-1)

    with pytest.raises(RuntimeError, match=r"(?s)fzero.remat: \S*stores made 1 tensor\(s\) from its differentiable "
                                           r"arguments that outlive its forward.*\(2, 4\) torch.float32"):
        remat(stores)(w, x)
    kept.clear()

    stats = torch.zeros(4)
    ids = torch.arange(4)

    def fine(w, x):
        h = torch.tanh(x @ w)
        kept.append(h.detach())  # no gradient wanted: detached
        kept.append(ids * 2)  # from what needs no gradient
        stats.mul_(0.9).add_(h.mean(0))  # written in place into a tensor fn was given by closure
        return h, h.view(-1)  # a view returned keeps its base alive
    out, flat = remat(fine)(w, x)
    (out.sum() + flat.sum()).backward()
    assert w.grad is not None and x.grad is not None


def test_what_only_a_frame_or_another_thread_held_for_a_moment_is_no_escape(monkeypatch):
    """A finished call's frame keeps its locals while something holds the frame: a sampling profiler's thread reading
    the main thread's stack (``sys._current_frames``), or a traceback kept on an exception. No loss can read a tensor
    held that way, but it was refused as an escape, at random (on a GPU, under ``benchmarks/offload_rss.py``'s sampler).
    Held by frames alone it is let be; held through a container by a thread that lets go within the waits, too. A
    tensor kept in a list is still refused after the waits. Each case against the same function without remat."""
    import sys
    import threading

    import fzero.autodiff._refusals as remat_mod

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    frames = []

    def inner(w, x):
        h = torch.tanh(x @ w)
        frames.append(sys._getframe())  # the frame outlives the call, and with it ``h``
        return h * 2

    def framed(w, x):
        return inner(w, x).sum(-1)

    got = torch.autograd.grad(remat(framed)(w, x).sum(), (w, x))
    assert frames and frames[0].f_locals["h"].shape == (2, 4)  # still held when the check ran
    frames.clear()
    torch.testing.assert_close(got, torch.autograd.grad(framed(w, x).sum(), (w, x)), rtol=0, atol=0)

    release, holders, waits = threading.Event(), [], []

    def held_by_a_thread(w, x):
        h = torch.tanh(x @ w)
        holders.append(threading.Thread(target=lambda held: release.wait(10), args=((h,),), daemon=True))  # (h,): a container
        holders[-1].start()
        return h.sum(-1)

    def let_go(seconds):  # the wait: the thread lets go of what it held
        waits.append(seconds)
        release.set()
        for t in holders:
            t.join(10)

    monkeypatch.setattr(remat_mod, "time", type("Clock", (), {"sleep": staticmethod(let_go)}))

    got = torch.autograd.grad(remat(held_by_a_thread)(w, x).sum(), (w, x))
    assert waits == [remat_mod._SETTLE[0]]  # found once, gone after the first wait
    torch.testing.assert_close(got, torch.autograd.grad(held_by_a_thread(w, x).sum(), (w, x)), rtol=0, atol=0)

    kept, waits[:] = [], []

    def stores(w, x):
        h = torch.tanh(x @ w)
        kept.append(h)
        return h.sum(-1)

    with pytest.raises(RuntimeError, match=r"outlive its forward"):
        remat(stores)(w, x)
    assert waits == list(remat_mod._SETTLE)


class _Parametrized(torch.nn.Module):
    """Two parametrized blocks (the units), each called once per forward."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        wrap = self.wrap(kind)
        self.inp = torch.nn.Linear(6, 12)
        self.blocks = torch.nn.ModuleList(wrap(torch.nn.Linear(12, 12)) for _ in range(2))
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        return self.out(h)

    @staticmethod
    def wrap(kind: str):
        from torch.nn.utils import parametrizations

        return {"orthogonal": parametrizations.orthogonal, "weight_norm": parametrizations.weight_norm}[kind]


def _trained_under_cached(ref: torch.nn.Module, batches) -> torch.nn.Module:
    """PyTorch's reference: ``ref`` trained by AdamW(1e-2) on ``batches``, each forward under a ``parametrize.cached()``
    of its own."""
    from torch.nn.utils import parametrize

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches:
        opt.zero_grad()
        with parametrize.cached():
            loss = F.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
    return ref


def _assert_trained_as(step, state, ref: torch.nn.Module) -> None:
    """The state's params equal the reference module's, name by name."""
    got = step.gather(state)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _assert_remat_trains_as_sgd(ref: torch.nn.Module, model: torch.nn.Module, **settings) -> None:
    """``ref`` trained by PyTorch's SGD(0.1) on two of ``_parametrized_batches``, ``model`` (built alike) by fzero with
    ``remat=True`` and ``settings``: their params compared (``_assert_trained_as``)."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in _parametrized_batches()[:2]:
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    step = fzero.compile(lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1]),
                         optimizer=fzero.optim.sgd(0.1), remat=True, **settings)
    state = step.init(fzero.params_of(model))
    for b in _parametrized_batches()[:2]:
        state, _ = step(state, b)
    _assert_trained_as(step, state, ref)


def _parametrized_batches():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)) for _ in range(4)]


@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm"])
@pytest.mark.parametrize("where", ["around_the_step", "in_loss_fn"])
def test_parametrize_cached_trains_under_remat_as_pytorch(kind, where):
    """``torch.nn.utils.parametrize.cached()`` around the step: the no_grad forward's weights (no graph) stayed in torch's
    cache and the recompute read them back, so the parametrization's originals got no gradient (100% off PyTorch after
    4 AdamW steps). Inside loss_fn: the recompute ran after the cache was off. Each remat'ed call now has a cache of its
    own, on as in its forward."""
    from torch.nn.utils import parametrize

    ref = _trained_under_cached(_Parametrized(kind), _parametrized_batches())
    model = _Parametrized(kind)

    def loss_fn(params, b):
        if where == "in_loss_fn":
            with parametrize.cached():
                return F.cross_entropy(fzero.apply(model, params, b[0]), b[1])
        return F.cross_entropy(fzero.apply(model, params, b[0]), b[1])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=3, remat=True)
    state = step.init(fzero.params_of(model))
    for b in _parametrized_batches():
        if where == "around_the_step":
            with parametrize.cached():
                state, _ = step(state, b)
        else:
            state, _ = step(state, b)
    _assert_trained_as(step, state, ref)


@pytest.mark.parametrize("stages", [0, 3])
def test_parametrize_cached_on_a_local_mesh_of_several_ranks_is_refused(stages):
    """torch keys its cache by the module the parametrization was registered on, in one dict of the process: the rank
    threads read each other's cached weights (10-200% off PyTorch with DDP's split after 4 AdamW steps)."""
    from torch.nn.utils import parametrize

    model = _Parametrized("weight_norm")
    step = fzero.compile(lambda p, b: F.cross_entropy(fzero.apply(model, p, b[0]), b[1]), optimizer=fzero.optim.adamw(1e-2),
                         stages=stages, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    batch = _parametrized_batches()[0]
    with parametrize.cached(), pytest.raises(ValueError, match=r"parametrize.cached\(\) is on while _Parametrized runs on a "
                                                               r"rank of a local_mesh of several ranks, and 'blocks.0'"):
        step(state, batch)
    state, _ = step(state, batch)  # without it: trains


class _CheckpointedStage(torch.nn.Module):
    """A unit of two blocks, each run through torch.utils.checkpoint (non-reentrant), as timm's
    ``set_grad_checkpointing()`` runs the blocks of a ConvNeXt or Swin stage (the unit)."""

    def __init__(self, d):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d))
                                            for _ in range(2)])

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return torch.tanh(x)


class _CheckpointedNet(torch.nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.stages = torch.nn.ModuleList([_CheckpointedStage(d), _CheckpointedStage(d)])
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_remat_unit_with_checkpoint_inside(stages, ranks):
    """compile(remat=True) over units that run torch.utils.checkpoint inside (timm's set_grad_checkpointing() on a
    ConvNeXt or Swin, whose units are stages of several blocks): the checkpoint calls its blocks again while remat's
    recompute takes its product. At stages 2-3 that found the unit's params meta again ("was given a unit's parameter
    ... outside that unit's call"), where PyTorch trains it; and the blocks' BatchNorm running stats must be updated
    again by that call, as PyTorch's checkpoint does (it had updated a copy at stages 0-1 with the first fix). Params and
    state_dict after 3 SGD steps against eager PyTorch with DDP's averaging."""
    torch.manual_seed(0)
    model = _CheckpointedNet()
    replicas = [_CheckpointedNet() for _ in range(ranks)]
    for rep in replicas:
        rep.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(3)]
    opt = torch.optim.SGD(replicas[0].parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        for rep in replicas[1:]:  # DDP: rank 0's params and buffers at every step
            rep.load_state_dict(replicas[0].state_dict())
        grads = []
        for rep, xs, ys in zip(replicas, x.chunk(ranks), y.chunk(ranks)):
            rep.zero_grad()
            F.cross_entropy(rep(xs), ys).backward()
            grads.append([p.grad for p in rep.parameters()])
        for p, gs in zip(replicas[0].parameters(), zip(*grads)):
            p.grad = sum(gs) / ranks
        opt.step()
    expected = replicas[0].state_dict()

    step = fzero.compile(lambda p, b: F.cross_entropy(fzero.apply(model, p, b[0]), b[1]),
                         optimizer=fzero.optim.sgd(0.1, momentum=0.9), stages=stages, mesh=fzero.local_mesh(ranks),
                         remat=True)
    state = step.init(fzero.params_of(model))
    for batch in batches:
        state, _ = step(state, batch)
    got = step.state_dict(state, model)
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_stage3_remat_lets_go_of_a_units_buffer_before_its_gradient_is_joined(autodiff, monkeypatch):
    """The recompute of a stage-3 unit keeps its params bound while remat's product runs (for a torch.utils.checkpoint
    inside the unit), but no longer than the unit's own backward: held until the product ended, each block's gathered
    buffer lived beside its gradient's join and reduce-scatter, one unit's bytes over the peak (a GPT's stage-3 remat
    step then peaked above the same step without remat)."""
    import dataclasses

    import fzero.zero._unit as unit_mod
    from fzero.memory import GatheredBytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, d_model=32, seq_len=8, vocab_size=32))
    block_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    x, y = torch.randint(0, 32, (1, 8)), torch.randint(0, 32, (1, 8))
    tally, at_join = GatheredBytes(), []
    join = unit_mod._usage.join

    def watched(*args, **kwargs):
        at_join.append(tally.live)
        return join(*args, **kwargs)

    monkeypatch.setattr(unit_mod._usage, "join", watched)
    mesh = dataclasses.replace(fzero.local_mesh(1), rank_context=lambda r: tally)
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b[0]), b[1]), stages=3, mesh=mesh, remat=True,
                         autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    step(state, (x, y))
    assert len(at_join) >= 3 and max(at_join) < block_bytes, (at_join, block_bytes)


def test_the_refusal_of_a_tensor_a_unit_keeps_names_the_attribute_holding_it():
    """RecurrentGemma's recurrent block keeps ``self.recurrent_states`` even without a cache: under ``remat=True`` the
    refusal gave the tensor's shape alone, and the user had to find which of the model's modules held it."""

    class Keeper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.kept = None

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            self.kept = h * 2  # a state kept on the module, read by nobody
            return h

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Keeper() for _ in range(2)])
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1), stages=3,
                         remat=True)
    with pytest.raises(RuntimeError, match=r"(?s)outlive its forward.*\(2, 4\) torch.float32 held as Keeper.kept"):
        step(step.init(fzero.params_of(model)), torch.randn(2, 4))


def test_an_argument_written_in_place_during_the_forward_is_refused():
    """The recompute starts from the saved arguments; one the forward wrote in place holds the written values, which
    autograd does not see (it checks saved tensors only from the moment they are saved, after the forward): the write
    was applied twice in backward (grad 64, 96 where PyTorch gives 16, 24, silently) or, for an argument that needs a
    gradient, torch's raw leaf error came in backward. Refused in the forward, naming the argument."""
    w = torch.tensor([2.0, 3.0], requires_grad=True)

    def doubles(x, w):
        x.mul_(2.0)
        return (x * w).pow(2).sum()

    with pytest.raises(RuntimeError, match=r"(?s)fzero.remat: \S*doubles wrote its tensor argument args\[0\] \(\(2,\) "
                                           r"torch.float32\) in place.*x = x.clone\(\)"):
        remat(doubles)(torch.ones(2), w)
    with pytest.raises(RuntimeError, match=r"wrote its tensor argument args\[0\]"):
        remat(doubles)(torch.ones(2, requires_grad=True) * 1, w)

    def fine(x, w):  # out of place, or a clone written: the same gradients as without remat
        x = x.clone()
        x.mul_(2.0)
        return (x * w).pow(2).sum()

    remat(fine)(torch.ones(2), w).backward()
    assert w.grad.tolist() == [16.0, 24.0]



@pytest.mark.parametrize("mode", ["grad", "backward"])
def test_an_output_that_is_a_view_may_be_written_in_place_as_checkpoints_may(mode):
    """A Linear on a 3-d input returns a view (its 2-d product reshaped). remat returned it as it was, and a write into
    it after the call (h = block(h); h.mul_(2), fine under torch.utils.checkpoint) raised torch's raw "Output 0 of
    _RematForward is a view and is being modified inplace"."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 3, 4)

    def loss_fn(params, wrap):
        run = lambda p, x: fzero.apply(lin, p, x)  # noqa: E731
        y = (remat(run) if wrap else run)(params, x)
        y.mul_(2)
        return torch.tanh(y).sum()

    params = fzero.params_of(lin)
    expected = grads_by(mode, lambda p: loss_fn(p, False), params)
    assert_trees_equal(grads_by(mode, lambda p: loss_fn(p, True), params), expected)



@pytest.mark.parametrize("mode", ["grad", "vjp", "backward"])
def test_an_argument_returned_as_it_is_is_that_very_tensor(mode):
    """A function that returns its argument as it is (a block that skips itself) hands back that very tensor, as
    without remat: a write into the output after the call reaches the caller's other references to it, with its
    gradient. remat returned a view made by its Function: under plain autograd torch refused to see it written
    ("Output 0 of _RematForward is a view"), and under torch.func the write reached the caller's tensor but not its
    graph (weight's gradient 0.495 off, silently)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def loss_fn(params, wrap):
        def run(p, h, skip):
            return h if skip else fzero.apply(lin, p, h)

        h = x * params["weight"].sum()
        same = (remat(run) if wrap else run)(params, h, True)
        same.mul_(2)  # writes h too
        return (h * fzero.apply(lin, params, x)).sum()

    params = fzero.params_of(lin)
    expected = grads_by(mode, lambda p: loss_fn(p, False), params)
    assert_trees_equal(grads_by(mode, lambda p: loss_fn(p, True), params), expected)

class _Twice(torch.nn.Module):
    """A Linear that returns its output twice (``return y, y``)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h):
        y = self.lin(h)
        return y, y


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("stages", [0, 3])
def test_a_units_output_that_is_a_view_may_be_written_in_place(stages, twice):
    """The same through compile(remat=True): units whose output is a Linear's on 3-d activations, each written in
    place after the unit, train as without remat; so do units that return their output twice, written through
    one name and read through the other."""
    class Written(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[_Twice() if twice else torch.nn.Linear(4, 4) for _ in range(3)])

        def forward(self, h):
            for block in self.blocks:
                y, other = block(h) if twice else (block(h),) * 2
                y.mul_(0.5)
                h = torch.tanh(h + other)
            return h

    torch.manual_seed(0)
    net = Written()
    runs = []
    for recompute in (False, True):
        step = fzero.compile(lambda p, b: fzero.apply(net, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                             stages=stages, mesh=fzero.local_mesh(2), remat=recompute)
        state = step.init(fzero.params_of(net))
        state, _ = step(state, torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(1)))
        runs.append(step.gather(state))
    assert_trees_equal(runs[1], runs[0])

@pytest.mark.parametrize("mode", ["grad", "backward"])
def test_an_output_that_is_a_view_of_another_output_sees_writes_into_it(mode):
    """An output that is a view of another output (``h, h[:, :2]``: a hidden state and its first features, as a pooler
    takes them). Returned detached, it shared the other output's memory but not its graph: a write into that output
    after the call changed the view's values and not its gradient (silently; before the detach it was torch's "Output 1
    of _RematForward is a view and its base ... has been modified inplace"). It is made again on that output outside
    the Function, a view of it as in PyTorch."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def run(p, x):
        h = fzero.apply(lin, p, x)
        return h, h[:, :2]

    def loss_fn(params, wrap):
        h, first = (remat(run) if wrap else run)(params, x)
        h.mul_(2)  # writes first too
        return torch.tanh(h).sum() + (first * first).sum()

    params = fzero.params_of(lin)
    expected = grads_by(mode, lambda p: loss_fn(p, False), params)
    assert_trees_equal(grads_by(mode, lambda p: loss_fn(p, True), params), expected)


@pytest.mark.parametrize("mode", ["grad", "backward"])
@pytest.mark.parametrize("written", [0, 1])
def test_one_tensor_returned_twice_may_be_written_through_either(mode, written):
    """``return h, h``: one tensor at two positions. The second was returned as a view made by the Function, which
    torch refuses to see written in place ("Output 1 of _RematForward is a view and its base or another view of its
    base has been modified inplace"), where without remat both names are one tensor. It is now made again outside the
    Function as an alias of the first: a write through either name reaches the other, and the gradient, as in PyTorch."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)

    def run(p, x):
        h = fzero.apply(lin, p, x) * 1.5
        return h, h

    def loss_fn(params, wrap):
        both = (remat(run) if wrap else run)(params, x)
        both[written].mul_(2)  # writes the other name too
        return torch.tanh(both[0]).sum() + (both[1] * both[1]).sum()

    params = fzero.params_of(lin)
    expected = grads_by(mode, lambda p: loss_fn(p, False), params)
    assert_trees_equal(grads_by(mode, lambda p: loss_fn(p, True), params), expected)


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_compiled_unit_writing_its_input_in_place_is_refused(stages):
    """compile(remat=True): a unit that adds into its input in place (the zoo's ShiftBlock; fine without remat) is
    refused by name, at every stage (it trained 4e-3 off PyTorch in one step when the input needed no gradient)."""
    import zoo

    class Model(torch.nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.body = zoo.Blocks(d, n=1, block=zoo.ShiftBlock)
            self.head = torch.nn.Linear(d, 4)

        def forward(self, x):
            return self.head(self.body(x))

    torch.manual_seed(0)
    model = Model()
    step = fzero.compile(lambda p, b: F.cross_entropy(fzero.apply(model, p, b[0].clone()), b[1]),
                         optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(1), remat=True)
    with pytest.raises(RuntimeError, match=r"unit 'body.blocks.0'.* wrote its tensor argument args\[1\] \(\(4, 16\)"):
        step(step.init(fzero.params_of(model)), (torch.randn(4, 16), torch.tensor([0, 1, 2, 3])))


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_a_forward_hook_on_a_remat_unit_under_torch_func_is_refused_by_name(stages):
    """Under torch.func remat's Function returns new tensors, so what a forward hook on the unit keeps (its output, fed
    to an auxiliary loss) carried no gradient: the aux term's gradient was dropped silently (emb.weight's gradient 6e-4
    off PyTorch in one SGD step, at every stage). Refused by name before any update; plain autograd trains as PyTorch."""
    from zoo import ZOO

    entry = ZOO["hook_aux"]
    model = entry.build()
    step = fzero.compile(lambda p, b: entry.loss(lambda *a, **k: fzero.apply(model, p, *a, **k), b), stages=stages,
                         mesh=fzero.local_mesh(2), autodiff="func", remat=True)
    state = step.init(fzero.params_of(model))
    before = step.gather(state)
    with pytest.raises(RuntimeError, match=r"(?s)unit 'body\.blocks\.0' \(Sequential\) has forward hooks \(_capture\).*"
                                           r"Fix: use the default autodiff"):
        step(state, entry.batches()[0])
    assert_trees_equal(step.gather(state), before)


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)) + x


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Residual() for _ in range(3)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _adversarial_loss(run, x, y):
    """FGSM adversarial training: the input's gradient first (``torch.autograd.grad(loss, x)``), then the loss on the
    perturbed input; only the second loss trains the params."""
    x = x.clone().requires_grad_(True)
    gx, = torch.autograd.grad((run(x) - y).pow(2).mean(), x)
    return (run((x + 0.1 * gx.sign()).detach()) - y).pow(2).mean()


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_an_inputs_gradient_taken_inside_loss_fn_trains_nothing_under_remat(stages, ranks):
    """Under ``remat=True`` the recompute differentiated with respect to every input of a unit, whatever the backward
    asked for: a ``torch.autograd.grad(loss, x)`` inside ``loss_fn`` (adversarial training's input gradient) ran, at
    stage 3, the unit's gather backward, which reduces the params' gradient into the step's, so the first loss trained
    the params too (2.5e-2 off PyTorch after 3 steps; stage 3 without remat, and stages 0-2, were right). The recompute
    now takes only the gradients the engine goes on to use."""
    torch.manual_seed(0)
    model = _Stack()
    reference = copy.deepcopy(model)
    xs, ys = torch.randn(3, 8, 8), torch.randn(3, 8, 1)
    step = fzero.compile(lambda p, b: _adversarial_loss(lambda x: fzero.apply(model, p, x), *b),
                         optimizer=fzero.optim.adamw(1e-2), stages=stages, remat=True,
                         mesh=fzero.local_mesh(ranks) if ranks > 1 else None)
    state = step.init(fzero.params_of(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in zip(xs, ys):
        state, _ = step(state, (x, y))
        opt.zero_grad()
        rows = len(x) // ranks  # DDP: the mean of the ranks' losses, each on its rows
        (sum(_adversarial_loss(reference, x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
             for r in range(ranks)) / ranks).backward()
        opt.step()
    got = step.gather(state)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-6)


class _PlainBlocks(torch.nn.Module):
    """Blocks kept as plain attributes: no ModuleList/Sequential index in any param's name, so no default unit."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block1, self.block2, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.block2(torch.tanh(self.block1(x)))))


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_remat_with_no_unit_to_recompute_is_refused_and_named_units_recompute(stages):
    """compile(remat=True) on a model with no default unit (its blocks plain attributes) recomputed nothing, without a
    word: every param was in the root unit, which runs once (block1's forward ran once per step, as without remat).
    Refused by name at every stage; at stages 2-3 the blocks named as units recompute (twice) and train as without."""
    model = _PlainBlocks()
    calls = []
    model.block1.register_forward_hook(lambda *a: calls.append(1))
    loss = lambda p, x: fzero.apply(model, p, x).pow(2).mean()  # noqa: E731
    mesh = fzero.local_mesh(2) if stages else None
    step = fzero.compile(loss, stages=stages, mesh=mesh, remat=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    match = (r"fzero\.Step\.init: remat=True recomputes each unit's forward in backward, but every param is in the root unit"
             if stages >= 2 else r"fzero\.compile\(remat=True\): at stages 0-1 the units recomputed in backward are "
             r"fzero\.units_of\(model\)'s .* and _PlainBlocks has none, so nothing would be recomputed")
    with pytest.raises(ValueError, match=match):
        step(step.init(fzero.params_of(model)), x)
    if stages < 2:
        return
    named = fzero.compile(loss, stages=stages, mesh=mesh, remat=True, units=("block1", "block2"))
    calls.clear()
    state, _ = named(named.init(fzero.params_of(model)), x)
    assert len(calls) == 2 * 2  # each of the 2 ranks: the forward and its recompute
    plain = fzero.compile(loss, stages=stages, mesh=mesh, units=("block1", "block2"))
    want, _ = plain(plain.init(fzero.params_of(model)), x)
    assert_trees_equal(named.gather(state), plain.gather(want))


class _HookNormed(_Parametrized):
    """Blocks under torch's deprecated ``torch.nn.utils.weight_norm`` / ``spectral_norm``: a forward pre-hook computes
    the weight and sets it on the Linear as a plain attribute at every call (spectral_norm also steps its power
    iteration's buffers), as older audio and GAN code does."""

    @staticmethod
    def wrap(kind: str):
        return {"weight_norm": torch.nn.utils.weight_norm, "spectral_norm": torch.nn.utils.spectral_norm}[kind]


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_the_deprecated_hook_norms_train_under_remat_as_pytorch(stages, kind):
    """The weight their pre-hook sets on the module outlives the remat forward, and was refused as an escaped tensor at
    stages 0-2 (a model plain PyTorch's checkpoint trains); the hook sets it anew at every call, so the recompute makes
    its graph, and the call returns it as one more output, set on its module after the call with a graph (a read
    outside the unit trains too: the next test)."""
    ref = _HookNormed(kind)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in _parametrized_batches():
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    model = _HookNormed(kind)
    step = fzero.compile(lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1]),
                         optimizer=fzero.optim.adamw(1e-2), stages=stages, remat=True)
    state = step.init(fzero.params_of(model))
    for b in _parametrized_batches():
        state, _ = step(state, b)
    _assert_trained_as(step, state, ref)
    sd = step.state_dict(state, model)
    for name, b in ref.named_buffers():  # spectral_norm's power-iteration vectors, stepped once per forward
        torch.testing.assert_close(sd[name], b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


class _NormInside(torch.nn.Module):
    """Blocks whose Linear (inside the unit, not the unit itself) is under a deprecated norm hook, and a forward that
    reads the first block's hook-set weight after the block's call, outside it (a tied or regularised weight)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        wrap = {"weight_norm": torch.nn.utils.weight_norm, "spectral_norm": torch.nn.utils.spectral_norm}[kind]
        self.inp = torch.nn.Linear(6, 12)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(wrap(torch.nn.Linear(12, 12)), torch.nn.Tanh()) for _ in range(2))
        self.out = torch.nn.Linear(12, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h) + h
        return self.out(h + self.blocks[0][0].weight.sum() * 0.1)


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
@pytest.mark.parametrize(("stages", "ranks", "autodiff"), [(0, None, "autograd"), (1, 2, "autograd"), (2, None, "autograd"),
                                                         (2, 2, "autograd"), (3, None, "autograd"), (3, 2, "autograd"),
                                                         (3, None, "func")])
def test_a_deprecated_norm_weight_read_outside_its_unit_under_remat_trains_as_pytorch(stages, kind, ranks, autodiff):
    """The weight the hook set in the remat forward (no_grad: no graph) read after the unit's call, outside it: that
    read trained without its gradient (0.62 off PyTorch after 2 SGD steps at stages 0-1; at stage 3 1.1e-2 with
    weight_norm, 2.6e-3 with spectral_norm, silently; at stage 2 refused). The call now returns each weight its forward
    set as one more output, with a graph through the recompute, and sets it on its module: as PyTorch at every stage."""
    _assert_remat_trains_as_sgd(_NormInside(kind), _NormInside(kind), stages=stages, autodiff=autodiff,
                                mesh=None if ranks is None else fzero.local_mesh(ranks))


def _stream_kinds() -> dict:
    """How a forward may draw a mask from a stream besides torch's global generator: (make the module's stream or None,
    draw n uniforms)."""
    import random

    import numpy as np

    return {
        "numpy_global": (None, lambda g, n: np.random.rand(n)),
        "python_global": (None, lambda g, n: [random.random() for _ in range(n)]),
        "numpy_held": (lambda: np.random.default_rng(3), lambda g, n: g.random(n)),
        "torch_held": (lambda: torch.Generator().manual_seed(3), lambda g, n: torch.rand(n, generator=g).tolist()),
        # held in a container attribute (a dict of lists): was not replayed, 3.8e-2 off PyTorch after 2 steps
        "torch_held_in_container": (lambda: {"gens": [torch.Generator().manual_seed(3)]},
                                    lambda g, n: torch.rand(n, generator=g["gens"][0]).tolist()),
    }


class _MaskedBlock(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        make, self.draw = _stream_kinds()[kind]
        self.gen = make() if make is not None else None

    def forward(self, x):
        keep = torch.as_tensor([float(u > 0.3) for u in self.draw(self.gen, x.shape[-1])], dtype=x.dtype)
        return torch.tanh(self.lin(x * keep))


class _MaskedNet(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_MaskedBlock(kind) for _ in range(2)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("kind", ["numpy_global", "python_global", "numpy_held", "torch_held", "torch_held_in_container"])
@pytest.mark.parametrize("stages", [1, 3])
def test_the_recompute_replays_numpy_python_and_module_held_streams(stages, kind):
    """A unit's forward drawing a mask from NumPy's or Python's global stream, or from a generator its module holds: the
    recompute under remat=True drew new numbers (only torch's generators were replayed), so its mask was not the
    forward's, 6.4e-3 to 7.6e-3 off PyTorch after one AdamW step at every stage, silently (a documented gap for a held
    torch.Generator). Now each such stream is replayed as torch's are: remat=True trains as remat=False, and the streams
    end each step where the forward left them."""
    import random

    import numpy as np

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    runs = []
    for rematted in (False, True):
        model = _MaskedNet(kind)
        step = fzero.compile(lambda p, x: fzero.apply(model, p, x).square().mean(), optimizer=fzero.optim.adamw(1e-2),
                             stages=stages, mesh=fzero.local_mesh(1), remat=rematted)
        state = step.init(fzero.params_of(model))
        random.seed(5)
        np.random.seed(5)
        for x in batches:
            state, _ = step(state, x)
        draw = _stream_kinds()[kind][1]
        runs.append((step.gather(state), list(draw(model.blocks[0].gen, 3))))
    (expected, expected_next), (got, got_next) = runs
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7)
    assert got_next == expected_next  # the recompute moved no stream on


class _Batch(dict):
    """A user's dict subclass that no pytree knows, carrying the hidden state from one unit to the next."""


class _Items(list):
    """A list subclass no pytree knows."""


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor


def _carry(kind: str, h: torch.Tensor):
    return {"dict": lambda: _Batch(h=h), "list": lambda: _Items([h]), "dataclass": lambda: _Hidden(h)}[kind]()


def _carried(kind: str, c) -> torch.Tensor:
    return {"dict": lambda: c["h"], "list": lambda: c[0], "dataclass": lambda: c.h}[kind]()


class _CarryBlock(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc = kind, torch.nn.Linear(8, 8)

    def forward(self, c):
        h = _carried(self.kind, c)
        return _carry(self.kind, torch.tanh(self.fc(h)) + h)


class _Carrying(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.inp, self.out = kind, torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.blocks = torch.nn.ModuleList(_CarryBlock(kind) for _ in range(2))

    def forward(self, x):
        c = _carry(self.kind, self.inp(x))
        for block in self.blocks:
            c = block(c)
        return self.out(_carried(self.kind, c))


@pytest.mark.parametrize("kind", ["dict", "list", "dataclass"])
@pytest.mark.parametrize("stages", [0, 3])
def test_a_unit_given_a_container_no_pytree_knows_trains_under_remat_as_pytorch(stages, kind):
    """A ``dict``/``list`` subclass no pytree knows (``class Batch(dict)``) or a dataclass, given to a unit under remat: a
    leaf to torch's pytree, so its tensors reached the unit without being its call's inputs, and remat refused the call
    ("read a tensor that requires grad but is not one of its arguments"), where PyTorch trains it. Walked now as stage 3
    walks it, it trains as PyTorch."""
    _assert_remat_trains_as_sgd(_Carrying(kind), _Carrying(kind), stages=stages)


@pytest.mark.parametrize("mode", ["grad", "backward"])
def test_remat_differentiates_through_a_dict_subclass_argument(mode):
    """The same through ``fzero.remat`` itself, under ``torch.func.grad`` and plain autograd: the gradient of a tensor
    inside a ``class Batch(dict)`` argument, bitwise as without remat; the function gets a copy with its attributes."""
    x, w0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.randn(4, 4)

    def f(b):
        assert type(b) is _Batch and b.note == "kept"
        return torch.tanh(x @ b["w"]).sum()

    def loss(w, wrap):
        b = _Batch(w=w)
        b.note = "kept"
        return (remat(f) if wrap else f)(b)

    if mode == "grad":
        want, got = (torch.func.grad(loss)(w0, wrap) for wrap in (False, True))
    else:
        want, got = (torch.autograd.grad(loss(w, wrap), w)[0] for wrap in (False, True) for w in [w0.clone().requires_grad_()])
    assert torch.equal(got, want)


class _Blocks(torch.nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointed, self.inp, self.out = checkpointed, torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = (torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False) if self.checkpointed else block(h)) + h
        return self.out(h)


@pytest.mark.parametrize(("stages", "remat_units", "autodiff"), [(0, True, "autograd"), (2, True, "autograd"), (3, True, "autograd"),
                                                               (3, False, "autograd"), (3, True, "func")])
def test_flop_counter_mode_around_a_step_counts_as_pytorch(stages, remat_units, autodiff):
    """``torch.utils.flop_counter.FlopCounterMode`` around a step (for MFU): under remat the step failed inside torch, "A
    leaf node was passed to _will_engine_execute_node but we are currently running autograd.grad()" (the mode's module
    tracker hooks each module's inputs, and the recompute's inputs were leaves of its torch.autograd.grad); under
    autodiff="func" it was refused for the tracker's forward hooks, which keep nothing. It now counts what PyTorch
    counts, with torch.utils.checkpoint's recompute under remat, and trains as PyTorch."""
    from torch.utils.flop_counter import FlopCounterMode

    ref = _Blocks(checkpointed=remat_units)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = _Blocks()
    step = fzero.compile(lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1]),
                         optimizer=fzero.optim.sgd(0.1), stages=stages, remat=remat_units, autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    for x, y in _parametrized_batches()[:2]:
        opt.zero_grad()
        with FlopCounterMode(display=False) as want:
            F.cross_entropy(ref(x), y).backward()
        opt.step()
        with FlopCounterMode(display=False) as got:
            state, _ = step(state, (x, y))
        assert got.get_total_flops() == want.get_total_flops() > 0
    _assert_trained_as(step, state, ref)


class _SpectralTwice(torch.nn.Module):
    """Blocks under ``torch.nn.utils.parametrizations.spectral_norm``, the first block run twice (one set of weights)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import parametrizations

        torch.manual_seed(0)
        self.inp, self.out = torch.nn.Linear(6, 12), torch.nn.Linear(12, 3)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(parametrizations.spectral_norm(torch.nn.Linear(12, 12)), torch.nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h = self.inp(x)
        for block in (*self.blocks, self.blocks[0]):
            h = block(h) + h
        return self.out(h)


@pytest.mark.parametrize("where", ["around_the_step", "in_loss_fn"])
@pytest.mark.parametrize("stages", [0, 3])
def test_a_spectral_norm_unit_called_twice_under_parametrize_cached_trains_as_pytorch(stages, where):
    """Under ``parametrize.cached()`` PyTorch computes a parametrized weight once: a unit called twice reads the first
    call's weight, and spectral_norm's power iteration runs once. With a cache of its own, each remat forward computed it
    again, so the iteration ran once per call (6.8e-4 off PyTorch's params, 1.2e-2 off its vectors after 4 AdamW steps,
    silently). The remat forwards in one cached() now share a cache, and the recompute of a call that read an earlier
    call's weight computes it again without stepping: params and vectors as PyTorch."""
    from torch.nn.utils import parametrize

    ref = _trained_under_cached(_SpectralTwice(), _parametrized_batches())
    model = _SpectralTwice()

    def loss_fn(params, b):
        with parametrize.cached() if where == "in_loss_fn" else contextlib.nullcontext():
            return F.cross_entropy(fzero.apply(model, params, b[0]), b[1])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=stages, remat=True)
    state = step.init(fzero.params_of(model))
    for b in _parametrized_batches():
        with parametrize.cached() if where == "around_the_step" else contextlib.nullcontext():
            state, _ = step(state, b)
    got, sd = step.gather(state), step.state_dict(state, model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    for name, b in ref.named_buffers():  # the power iteration's vectors: stepped once per cached()
        torch.testing.assert_close(sd[name], b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_flop_counter_mode_around_a_local_mesh_of_several_ranks_is_refused_and_counts_per_rank():
    """Around a step on local_mesh(2) the ranks run in threads of their own and the caller's dispatch mode is its thread's
    alone: a FlopCounterMode counted 0 flops, silently. Refused, naming the per-rank way, with which each rank counts its
    share as a torchrun process would (PyTorch with torch.utils.checkpoint on that rank's half of the batch)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _Blocks()
    loss_fn = lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1])  # noqa: E731
    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, remat=True, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    x, y = _parametrized_batches()[0]
    with pytest.raises(RuntimeError, match=r"(?s)fzero.local_mesh\(2\): a TorchDispatchMode \(torch.utils.flop_counter.FlopCounterMode\)"
                                           r".*rank_context=lambda r: modes.setdefault\(r, FlopCounterMode"):
        with FlopCounterMode(display=False):
            step(state, (x, y))
    modes: dict = {}
    mesh = dataclasses.replace(fzero.local_mesh(2), rank_context=lambda r: modes.setdefault(r, FlopCounterMode(display=False)))
    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, remat=True, mesh=mesh)
    step(step.init(fzero.params_of(model)), (x, y))
    with FlopCounterMode(display=False) as want:
        F.cross_entropy(_Blocks(checkpointed=True)(x[:4]), y[:4]).backward()
    assert [modes[r].get_total_flops() for r in (0, 1)] == [want.get_total_flops()] * 2


class _ReadOutside(torch.nn.Module):
    """A parametrized Linear in the first block, whose weight the model's forward also reads outside the block, before
    it ran or after."""

    def __init__(self, kind: str, after: bool) -> None:
        super().__init__()
        from torch.nn.utils import parametrizations

        torch.manual_seed(0)
        wrap = {"spectral_norm": parametrizations.spectral_norm, "weight_norm": parametrizations.weight_norm}[kind]
        self.after, self.inp, self.out = after, torch.nn.Linear(6, 12), torch.nn.Linear(12, 3)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(wrap(torch.nn.Linear(12, 12)), torch.nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h = self.inp(x) + (0 if self.after else 0.1 * self.blocks[0][0].weight.sum())
        for block in self.blocks:
            h = block(h) + h
        return self.out(h + (0.1 * self.blocks[0][0].weight.sum() if self.after else 0))


@pytest.mark.parametrize("after", [False, True], ids=["read_before", "read_after"])
@pytest.mark.parametrize("kind", ["spectral_norm", "weight_norm"])
def test_a_parametrized_weight_read_inside_and_outside_a_remat_unit_under_cached_trains_or_is_refused(kind, after):
    """Under parametrize.cached() PyTorch computes the weight once and both reads share it. Read outside the units too
    (before the block ran or after), remat computed it once outside and once in the unit: spectral_norm stepped its
    power iteration twice (4.9e-4 / 1.8e-3 off PyTorch's params, 4e-2 / 5.3e-2 off its vectors after 4 AdamW steps at
    stage 0, silently). A stateful parametrization read so is refused by name; a pure one (weight_norm), computed twice
    to the same value, trains as PyTorch."""
    from torch.nn.utils import parametrize

    ref = _trained_under_cached(_ReadOutside(kind, after), _parametrized_batches())
    model = _ReadOutside(kind, after)
    step = fzero.compile(lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1]),
                         optimizer=fzero.optim.adamw(1e-2), stages=0, remat=True)
    state = step.init(fzero.params_of(model))
    if kind == "spectral_norm":
        where = "inside a unit under remat" if after else "outside the remat'ed units"
        with pytest.raises(RuntimeError, match=rf"(?s)fzero.remat: ParametrizedLinear.weight is a parametrized tensor with state"
                                               rf".*parametrize.cached\(\) computed {where} earlier in this step"):
            with parametrize.cached():
                step(state, _parametrized_batches()[0])
        return
    for b in _parametrized_batches():
        with parametrize.cached():
            state, _ = step(state, b)
    _assert_trained_as(step, state, ref)


def test_parametrize_cached_around_several_remat_steps_computes_each_steps_weights():
    """The cache the remat forwards share starts afresh with each micro-batch's forward: kept across steps under one
    cached() around the loop, a later step would read weights of the params before its update (PyTorch refuses that
    loop: its second backward runs through the first one's freed graph). Each step trains as under a cached() of its own."""
    from torch.nn.utils import parametrize

    ref = _trained_under_cached(_SpectralTwice(), _parametrized_batches())
    model = _SpectralTwice()
    step = fzero.compile(lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1]),
                         optimizer=fzero.optim.adamw(1e-2), stages=0, remat=True)
    state = step.init(fzero.params_of(model))
    with parametrize.cached():
        for b in _parametrized_batches():
            state, _ = step(state, b)
    _assert_trained_as(step, state, ref)


@pytest.mark.parametrize("stages", [0, 3])
def test_steps_inside_one_parametrize_cached_each_compute_their_own_weights(stages):
    """Without remat, one ``parametrize.cached()`` around several steps handed the second step the weights the first
    computed from the params before its update: 2.9e-2 off PyTorch after a few AdamW steps, silently (PyTorch's own loop
    refuses: its second backward runs through the first one's freed graph). Each step now runs with a cache of its own,
    as under a ``cached()`` per step, and trains as PyTorch does so; a frozen teacher's weight the caller cached for the
    iteration is neither read by the step nor dropped from the caller's cache."""
    from torch.nn.utils import parametrize, parametrizations

    batches = _parametrized_batches()
    ref = _trained_under_cached(_SpectralTwice(), batches)
    teacher = parametrizations.weight_norm(torch.nn.Linear(6, 6)).requires_grad_(False)
    model = _SpectralTwice()
    step = fzero.compile(lambda params, b: F.cross_entropy(fzero.apply(model, params, b[0]), b[1]),
                         optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(1))
    state = step.init(fzero.params_of(model))
    with parametrize.cached():
        for x, y in batches:
            with torch.no_grad():
                x = x + 0 * teacher(x)  # the teacher's weight, cached for the iteration
            held = dict(parametrize._cache)
            state, _ = step(state, (x, y))
            assert parametrize._cache == held  # the caller's cache, as it was
    _assert_trained_as(step, state, ref)


class _ArgMaskedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, gen):
        scale = 1.0
        if isinstance(gen, dict):
            gen, scale = gen["gen"], gen["scale"]
        keep = (torch.rand(x.shape[-1], generator=gen) > 0.3).to(x.dtype)
        return torch.tanh(self.lin(x * keep * scale))


class _ArgMaskedNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_ArgMaskedBlock() for _ in range(2)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, gen):
        for block in self.blocks:
            x = x + block(x, gen)
        return self.head(x)


@pytest.mark.parametrize("stages", [1, 3])
def test_the_recompute_replays_a_generator_passed_to_the_unit(stages):
    """A ``torch.Generator`` in the batch, handed by the model to each block's forward: the recompute under remat=True
    drew new numbers from it (only the streams the unit's modules hold were replayed), 8.7e-2 off DDP after 3 SGD
    steps at stage 3 on local_mesh(2), silently, the stream moving on twice a step. Now a stream among the unit's
    arguments is replayed as a held one: remat=True trains as remat=False and the stream ends where the forward left it."""
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=data) for _ in range(2)]
    runs = []
    for rematted in (False, True):
        model = _ArgMaskedNet()
        gen = torch.Generator().manual_seed(7)
        step = fzero.compile(lambda p, b: fzero.apply(model, p, b["x"], b["gen"]).square().mean(),
                             optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(1), remat=rematted)
        state = step.init(fzero.params_of(model))
        for x in batches:
            state, _ = step(state, {"x": x, "gen": gen})
        runs.append((step.gather(state), torch.rand(3, generator=gen)))
    (expected, expected_next), (got, got_next) = runs
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_next, expected_next, rtol=0, atol=0)  # the recompute moved the stream on not at all


class _StreamBatch(dict):
    pass


def test_the_recompute_replays_a_generator_inside_a_dict_subclass_argument():
    """The same stream inside a ``dict`` subclass argument (``class Batch(dict)``, which remat walks as stage 3 does):
    not replayed before, 3.7e-2 off remat=False after 2 AdamW steps at stage 3, silently."""
    data = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=data) for _ in range(2)]
    runs = []
    for rematted in (False, True):
        model = _ArgMaskedNet()
        gen = torch.Generator().manual_seed(7)

        def loss_fn(p, x, model=model, gen=gen):
            return fzero.apply(model, p, x, _StreamBatch(gen=gen, scale=torch.tensor(1.5))).square().mean()

        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=3, mesh=fzero.local_mesh(1), remat=rematted)
        state = step.init(fzero.params_of(model))
        for x in batches:
            state, _ = step(state, x)
        runs.append(step.gather(state))
    for name in runs[0]:
        torch.testing.assert_close(runs[1][name], runs[0][name], rtol=1e-6, atol=1e-7)
