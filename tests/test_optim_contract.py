"""One contract over a registry of optimizers, and how layer-wise LAMB and element-wise Lion meet ZeRO's flat buffers.

Every optimizer in ``REGISTRY`` must keep a state of stable structure, dtypes and shapes; init on meta tensors;
converge on a least-squares problem; and give the same params at every ZeRO stage (``fzero.compile`` at stages
0-3 on ``local_mesh(2)``), equal to the optimizer run on the params pytree itself.

LAMB's trust ratio is per parameter, so on a flat buffer (many parameters, and at stages 1-3 one rank's shard)
it needs ``fzero.optim.use_segments``: the tests here build a test-only ``Segments`` that knows where each
parameter lies in a flat leaf and sums partial norms over simulated ranks (threads, as ``local_mesh`` runs).
"""

from __future__ import annotations

import threading

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import fzero
import fzero.optim as fo
from fzero.models import MLP
from fzero.testing import assert_trees_close, assert_trees_equal

REGISTRY = {
    "adamw": lambda lr: fo.adamw(lr),
    "adam": lambda lr: fo.adam(lr),
    "sgd_momentum": lambda lr: fo.sgd(lr, momentum=0.9),
    "lion": lambda lr: fo.lion(lr, weight_decay=0.1),
    "lamb": lambda lr: fo.lamb(lr, weight_decay=0.01),
    # parameter groups: the MLP's weights and biases in different groups, whose elements interleave in a flat unit
    "adamw_decay_mask": lambda lr: fo.adamw(lr, weight_decay=0.1, mask=fo.decay_mask),
    "multi_adamw_lamb": lambda lr: fo.multi_transform(
        {"w": fo.lamb(lr, weight_decay=0.01), "b": fo.adamw(lr / 2)}, lambda p: {k: "w" if v.ndim > 1 else "b" for k, v in p.items()}),
    # groups within a group: a decay mask inside one of multi_transform's transforms
    "multi_nested": lambda lr: fo.multi_transform(
        {"first": fo.adamw(lr, weight_decay=0.5, mask=lambda p: {k: k.endswith("weight") for k in p}), "rest": fo.sgd(lr, momentum=0.9)},
        lambda p: {k: "first" if k.startswith(("layers.0", "layers.2.weight", "a", "x", "w")) else "rest" for k in p}),
}
# Lion's fixed-size sign steps hover about the optimum at a constant lr (and its decay pulls off it): decay the lr.
CONVERGENCE_LR = {"adamw": 0.05, "adam": 0.05, "sgd_momentum": 0.01, "lion": fo.cosine_decay_schedule(0.05, 300), "lamb": 0.05,
                  "adamw_decay_mask": 0.05, "multi_adamw_lamb": 0.05, "multi_nested": 0.05}
# Compositions checked by the state/meta/convergence contract too (they are not separate ZeRO cases).
TRANSFORMS = {
    **REGISTRY,
    "sgd": lambda lr: fo.sgd(lr),
    "sgd_nesterov_wd": lambda lr: fo.sgd(lr, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "chain_adam_scale": lambda lr: fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(lr)),
    "chain_trace": lambda lr: fo.chain(fo.trace(0.5), fo.scale_by_learning_rate(lr)),
    "masked_sgd": lambda lr: fo.masked(fo.sgd(lr, momentum=0.9), lambda p: {k: k != "b" for k in p}),
    "multi_frozen": lambda lr: fo.multi_transform({"train": fo.adam(lr), "frozen": fo.set_to_zero()},
                                                   lambda p: {k: "frozen" if k == "a" else "train" for k in p}),
}
CONVERGENCE_LR.update({"sgd": 0.01, "sgd_nesterov_wd": 0.01, "chain_adam_scale": 0.05, "chain_trace": 0.01, "masked_sgd": 0.01,
                       "multi_frozen": 0.05})
SHAPES = {"a": (7,), "b": (1000,), "c": (33, 17)}


def make_params(seed: int = 0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def make_grads(params: dict, steps: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g) for k, p in params.items()} for _ in range(steps)]


def signature(tree):
    leaves, spec = optree.tree_flatten(tree)
    return spec, [(t.shape, t.dtype, t.device) for t in leaves]


# -- the contract -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("path", ["inplace", "pure"])
def test_state_structure_dtypes_and_shapes_are_stable(name, path):
    opt = TRANSFORMS[name](1e-2)
    params = make_params()
    state = opt.init(params)
    first = signature(state)
    for grads in make_grads(params, steps=3):
        if path == "inplace":
            state = fo.apply_inplace(opt, grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            assert signature(updates) == signature(params)
            params = fo.apply_updates(params, updates)
        assert signature(state) == first
    # torch.func flattens with torch.utils._pytree: it must see the same tensors
    assert len(torch_pytree.tree_leaves(state)) == len(optree.tree_leaves(state))


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_init_and_update_on_meta_tensors(name):
    opt = TRANSFORMS[name](1e-2)
    params = {"w": torch.empty(5, device="meta"), "b": torch.empty(2, 3, device="meta")}
    state = opt.init(params)
    leaves = optree.tree_leaves(state)
    assert all(t.device.type in ("meta", "cpu") for t in leaves)
    assert all(t.device.type == "meta" for t in leaves if t.dim() > 0)
    # the pure update is shape-correct abstractly: no data, no host sync on the moments or the norms
    updates, new_state = opt.update(params, state, params)
    assert signature(updates) == signature(params)
    assert signature(new_state) == signature(state)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_converges_on_least_squares(name):
    g = torch.Generator().manual_seed(5)
    a, x_true = torch.randn(32, 8, generator=g), torch.randn(8, generator=g)
    b = a @ x_true
    params = {"x": torch.full((8,), 0.1)}  # not zeros: LAMB's trust ratio ||p|| / ||u|| needs some ||p||
    opt = TRANSFORMS[name](CONVERGENCE_LR[name])
    state = opt.init(params)

    def loss(x):
        return ((a @ x - b) ** 2).mean()

    start = float(loss(params["x"]))
    for _ in range(300):
        grads = {"x": torch.func.grad(loss)(params["x"])}
        state = fo.apply_inplace(opt, grads, state, params)
    assert float(loss(params["x"])) < 1e-2 * start


# -- identical at every ZeRO stage --------------------------------------------------------------------------------

STAGE_STEPS = 3


def mlp_problem():
    torch.manual_seed(0)
    model = MLP([8, 32, 32, 4])
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 8, generator=gen), "y": torch.randn(8, 4, generator=gen)} for _ in range(STAGE_STEPS)]

    def loss_fn(params, batch):
        return torch.nn.functional.mse_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    return model, loss_fn, batches


def run_stage(name: str, stages: int):
    model, loss_fn, batches = mlp_problem()
    step = fzero.compile(loss_fn, optimizer=REGISTRY[name](1e-2), stages=stages, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    for batch in batches:
        state, _ = step(state, batch)
    return step.gather(state)


def run_reference(name: str):
    """The optimizer on the params pytree itself (one tensor per parameter): no flat buffers, no ranks."""
    model, loss_fn, batches = mlp_problem()
    params = fzero.params_of(model)
    opt = REGISTRY[name](1e-2)
    state = opt.init(params)
    for batch in batches:
        grads = torch.func.grad(loss_fn)(params, batch)
        state = fo.apply_inplace(opt, grads, state, params)
    return params


@pytest.mark.parametrize("name", list(REGISTRY))
def test_identical_at_every_stage(name):
    """Stages 1-3 shard the optimizer's flat buffers across ranks; the params must not notice. For LAMB this
    needs the train step to install a layout-aware Segments (per-parameter norms summed over the shards)."""
    base = run_stage(name, 0)
    start = fzero.params_of(mlp_problem()[0])
    assert any((base[k] - start[k]).abs().max() > 1e-3 for k in start)  # it trained: not trivially equal
    for stages in (1, 2, 3):
        assert_trees_close(run_stage(name, stages), base, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_stage0_equals_the_optimizer_on_the_params_pytree(name):
    """At stage 0 the optimizer sees whole flat unit buffers, each many parameters: LAMB's trust ratio must still
    be per parameter. (Tolerance: the 2-rank gradient is a mean of per-rank means.)"""
    assert_trees_close(run_stage(name, 0), run_reference(name), rtol=1e-6, atol=1e-7)


# -- Lion: element-wise, so the same bits however the leaves are cut ----------------------------------------------


def test_lion_is_bitwise_the_same_on_separate_tensors_a_flat_buffer_and_its_shards():
    params, numels = make_params(), [7, 1000, 561]
    grads = make_grads(params, steps=6)
    opt = fo.lion(1e-2, weight_decay=0.1)

    separate = {k: v.clone() for k, v in params.items()}
    state = opt.init(separate)
    for g in grads:
        state = fo.apply_inplace(opt, g, state, separate)

    def flat(tree):
        return torch.cat([tree[k].reshape(-1) for k in SHAPES])

    whole = {"flat": flat(params)}
    state = opt.init(whole)
    for g in grads:
        state = fo.apply_inplace(opt, {"flat": flat(g)}, state, whole)
    assert torch.equal(whole["flat"], flat(separate))

    assert whole["flat"].numel() == sum(numels)
    for cut in (333, 1001):  # two "ranks": views of one buffer, at odd offsets
        buf = flat(params)
        shards = {"r0": buf[:cut], "r1": buf[cut:]}
        state = opt.init(shards)
        for g in grads:
            fg = flat(g)
            state = fo.apply_inplace(opt, {"r0": fg[:cut], "r1": fg[cut:]}, state, shards)
        assert torch.equal(buf, whole["flat"]), f"cut at {cut}"


def test_lion_step_values():
    p, g = torch.tensor([1.0, -2.0, 0.5, 3.0]), torch.tensor([0.5, -1.0, 0.0, -4.0])
    opt = fo.lion(0.1, b1=0.9, b2=0.99, weight_decay=0.5)
    updates, state = opt.update({"p": g}, opt.init({"p": p}), {"p": p})
    # m = 0: c = 0.1 g, so sign(g); sign(0) = 0 leaves only the decay
    torch.testing.assert_close(updates["p"], -0.1 * (torch.sign(g) + 0.5 * p))
    torch.testing.assert_close(state[0].mu["p"], 0.01 * g)
    updates, state = opt.update({"p": -g}, state, {"p": p})
    # c = 0.9 * 0.01 g + 0.1 * (-g) = -0.091 g: the sign flips; m = 0.99 * 0.01 g + 0.01 * (-g) = -0.0001 g
    torch.testing.assert_close(updates["p"], -0.1 * (-torch.sign(g) + 0.5 * p))
    torch.testing.assert_close(state[0].mu["p"], -0.0001 * g)


# -- LAMB: per-parameter trust ratios through Segments ----------------------------------------------------------------


def lamb_reference(p, m, v, g, *, t, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, max_coeff=10.0, min_coeff=0.01):
    """One tensor, one step of DeepSpeed's FusedLamb CUDA kernel written out in float64 (eps outside the sqrt)."""
    p, m, v, g = (x.double() for x in (p, m, v, g))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (v.sqrt() + eps) + wd * p
    w_norm, u_norm = p.norm(), u.norm()
    coeff = 1.0 if w_norm == 0 or u_norm == 0 else float((w_norm / u_norm).clamp(min_coeff, max_coeff))
    step_size = lr * (1 - b2**t) ** 0.5 / (1 - b1**t)
    return p - step_size * coeff * u, m, v, coeff


@pytest.mark.parametrize("wd, max_coeff, min_coeff", [(0.01, 10.0, 0.01), (0.0, 10.0, 0.01), (0.1, 0.5, 0.2), (0.0, 100.0, 30.0)])
def test_lamb_is_deepspeed_fused_lamb(wd, max_coeff, min_coeff):
    """Against the FusedLamb kernel's arithmetic (csrc/lamb/fused_lamb_cuda_kernel.cu), clipping on both sides."""
    params = make_params()
    grads = make_grads(params, steps=5)
    opt = fo.lamb(1e-2, weight_decay=wd, max_coeff=max_coeff, min_coeff=min_coeff)
    ours = {k: v.clone() for k, v in params.items()}
    state = opt.init(ours)
    ref = {k: (v.double(), torch.zeros_like(v, dtype=torch.float64), torch.zeros_like(v, dtype=torch.float64)) for k, v in params.items()}
    for t, g in enumerate(grads, start=1):
        state = fo.apply_inplace(opt, g, state, ours)
        for k in ref:
            p, m, v, _ = lamb_reference(*ref[k], g[k], t=t, lr=1e-2, wd=wd, max_coeff=max_coeff, min_coeff=min_coeff)
            ref[k] = (p, m, v)
    assert_trees_close(ours, {k: ref[k][0].float() for k in ref}, rtol=1e-5, atol=1e-6)
    assert_trees_close(state[0].mu, {k: ref[k][1].float() for k in ref}, rtol=1e-5, atol=1e-7)


def test_lamb_trust_ratio_is_one_where_a_norm_is_zero():
    opt = fo.lamb(0.1, weight_decay=0.0)
    params = {"zero_p": torch.zeros(4), "zero_g": torch.ones(3)}
    grads = {"zero_p": torch.ones(4), "zero_g": torch.zeros(3)}
    updates, _ = opt.update(grads, opt.init(params), params)
    # zero_p: ||p|| = 0, trust 1, so the plain bias-corrected Adam step -lr * m̂ / (sqrt(v̂) + eps') = about -lr
    torch.testing.assert_close(updates["zero_p"], torch.full((4,), -0.1), rtol=1e-4, atol=0)
    assert torch.equal(updates["zero_g"], torch.zeros(3))  # ||u|| = 0: no step, and no NaN


def test_lamb_needs_params():
    opt = fo.lamb(1e-3)
    grads = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"fzero\.optim\.lamb: update needs the params .* got params=None"):
        opt.update(grads, opt.init(grads))


class FlatSegments:
    """Test-only ``Segments`` for flat leaves: ``ids[leaf]`` gives the segment of every element (the last id is
    padding). With an ``exchange``, sums of squares are summed over simulated ranks (threads) in rank order."""

    def __init__(self, ids: dict[str, torch.Tensor], counts: dict[str, int], exchange=None, rank: int = 0):
        self.ids, self.counts, self.exchange, self.rank = ids, counts, exchange, rank

    def sumsq(self, tree):
        out = {}
        for k, t in tree.items():
            partial = torch.zeros(self.counts[k], dtype=t.dtype).index_add_(0, self.ids[k], t.reshape(-1).square())
            out[k] = partial if self.exchange is None else self.exchange.all_reduce(self.rank, partial)
        return out

    def expand(self, per_segment, like):
        return {k: per_segment[k][self.ids[k]].reshape(like[k].shape) for k in like}


class Exchange:
    """all_reduce over threads: each rank deposits, all read the sum in rank order (a plain Python sum)."""

    def __init__(self, n: int):
        self.barrier, self.slots = threading.Barrier(n, timeout=30), [None] * n

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0])
        self.barrier.wait()  # everyone has read before the slots are reused
        return total


PAD = 32  # a flat unit is padded, as fzero's are


def flat_layout():
    numels = [SHAPES[k][0] if len(SHAPES[k]) == 1 else SHAPES[k][0] * SHAPES[k][1] for k in SHAPES]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(numels)] + [torch.full((PAD,), len(numels))])
    return ids, len(numels) + 1


def flatten(tree):
    return torch.cat([tree[k].reshape(-1) for k in SHAPES] + [torch.zeros(PAD)])


def run_lamb_separate(opt, params, grads):
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    for g in grads:
        state = fo.apply_inplace(opt, g, state, params)
    return flatten(params), state


def run_lamb_flat(opt, params, grads, segments=None):
    flat = {"unit0": flatten(params)}
    state = opt.init(flat)
    for g in grads:
        if segments is None:
            state = fo.apply_inplace(opt, {"unit0": flatten(g)}, state, flat)
        else:
            with fo.use_segments(segments):
                state = fo.apply_inplace(opt, {"unit0": flatten(g)}, state, flat)
    return flat["unit0"], state


def test_lamb_on_a_flat_buffer_with_segments_equals_separate_params():
    params = make_params()
    grads = make_grads(params, steps=5)
    opt = fo.lamb(1e-2, weight_decay=0.01)
    expected, exp_state = run_lamb_separate(opt, params, grads)
    ids, count = flat_layout()
    got, state = run_lamb_flat(opt, params, grads, FlatSegments({"unit0": ids}, {"unit0": count}))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state[0].nu["unit0"], flatten(exp_state[0].nu), rtol=0, atol=0)  # moments: element-wise
    assert torch.equal(got[-PAD:], torch.zeros(PAD))  # padding stays zero
    # without segments the whole buffer is one "parameter": a different trust ratio, visibly different params
    wrong, _ = run_lamb_flat(opt, params, grads)
    assert (wrong - expected).abs().max() > 1e-4


@pytest.mark.parametrize("cut", [512, 333])
def test_lamb_on_two_shards_sums_partial_norms_over_ranks(cut):
    """Two ranks (threads, as local_mesh runs them), each with a view of its part of one flat buffer and its own
    ``use_segments`` (thread-local), whose sumsq sums both ranks' partial sums: equal to the unsharded LAMB."""
    params = make_params()
    grads = make_grads(params, steps=5)
    opt = fo.lamb(1e-2, weight_decay=0.01)
    expected, _ = run_lamb_separate(opt, params, grads)
    ids, count = flat_layout()
    buf = flatten(params)
    exchange, errors = Exchange(2), []
    ranges = [(0, cut), (cut, buf.numel())]

    def rank_main(rank):
        try:
            lo, hi = ranges[rank]
            shard = {"unit0": buf[lo:hi]}
            segments = FlatSegments({"unit0": ids[lo:hi]}, {"unit0": count}, exchange, rank)
            state = opt.init(shard)
            for g in grads:
                with fo.use_segments(segments):
                    assert fo.current_segments() is segments
                    state = fo.apply_inplace(opt, {"unit0": flatten(g)[lo:hi]}, state, shard)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            exchange.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert isinstance(fo.current_segments(), fo.WholeLeaves)  # nothing leaked into this thread
    torch.testing.assert_close(buf, expected, rtol=1e-6, atol=1e-7)


def test_use_segments_nests_restores_and_checks():
    default = fo.current_segments()
    assert isinstance(default, fo.WholeLeaves) and isinstance(default, fo.Segments)
    ids, count = flat_layout()
    a, b = FlatSegments({"u": ids}, {"u": count}), FlatSegments({"u": ids}, {"u": count})
    with fo.use_segments(a):
        assert fo.current_segments() is a
        with fo.use_segments(b):
            assert fo.current_segments() is b
        assert fo.current_segments() is a
        with pytest.raises(RuntimeError):
            with fo.use_segments(b):
                raise RuntimeError("restored even on errors")
        assert fo.current_segments() is a
    assert fo.current_segments() is default
    with pytest.raises(TypeError, match=r"fzero\.optim\.use_segments: segments must have sumsq\(tree\) and expand\(per_segment, like\) .* got dict"):
        with fo.use_segments({}):
            pass


def test_whole_leaves():
    seg = fo.WholeLeaves()
    tree = {"a": torch.tensor([3.0, 4.0]), "b": torch.ones(2, 2, dtype=torch.bfloat16), "s": torch.tensor(2.0)}
    sums = seg.sumsq(tree)
    assert_trees_equal(sums, {"a": torch.tensor([25.0]), "b": torch.tensor([4.0]), "s": torch.tensor([4.0])})
    out = seg.expand(sums, tree)
    assert out["b"].shape == (2, 2) and out["s"].shape == () and float(out["a"][1]) == 25.0


# -- input validation --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: fo.lion(-1e-4), ValueError, r"fzero\.optim\.lion: learning_rate must be a float >= 0 or a schedule callable, got -0\.0001"),
        (lambda: fo.lion(1e-4, b1=1.5), ValueError, r"fzero\.optim\.lion: b1 must be in \[0\.0, 1\.0\], got 1\.5\. Typical: b1=0\.9"),
        (lambda: fo.lion(1e-4, weight_decay=-0.1), ValueError, r"fzero\.optim\.lion: weight_decay must be in .* got -0\.1\. Typical: 0\.1"),
        (lambda: fo.lion(1e-4, b2="0.99"), TypeError, r"fzero\.optim\.lion: b2 must be a float .* got str '0\.99'"),
        (lambda: fo.lamb("1e-3"), TypeError, r"fzero\.optim\.lamb: learning_rate must be .* got str '1e-3'"),
        (lambda: fo.lamb(1e-3, b2=1.0), ValueError, r"fzero\.optim\.lamb: b2 must be in \[0\.0, 1\.0\), got 1\.0\. Typical: b2=0\.999"),
        (lambda: fo.lamb(1e-3, eps=-1.0), ValueError, r"fzero\.optim\.lamb: eps must be in \[0\.0, inf\], got -1\.0"),
        (lambda: fo.lamb(1e-3, min_coeff=2.0, max_coeff=1.0), ValueError,
         r"fzero\.optim\.lamb: the trust ratio is clipped to \[min_coeff, max_coeff\], so min_coeff must be finite and <= "
         r"max_coeff; got min_coeff=2\.0, max_coeff=1\.0\. Typical: min_coeff=0\.01"),
        (lambda: fo.lamb(1e-3, max_coeff=-1.0), ValueError, r"fzero\.optim\.lamb: max_coeff must be in \[0\.0, inf\], got -1\.0"),
        (lambda: fo.lamb(1e-3, 0.9), TypeError, r"positional"),
        (lambda: fo.scale_by_lamb(weight_decay=-1.0), ValueError, r"fzero\.optim\.scale_by_lamb: weight_decay must be in"),
    ],
)
def test_errors_name_the_api_the_value_and_the_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
