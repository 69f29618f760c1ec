"""fzero.optim against torch.optim, the fused kernel's bitwise behaviour on flat buffers, and a contract suite.

The kernel facts measured here (torch 2.13, CPU) are the ones the ZeRO core relies on for bitwise parity:
see ``test_fused_adamw_flat_buffer_vs_separate_tensors`` and ``test_fused_adamw_on_shards_of_a_buffer``.
"""

from __future__ import annotations

import math

import pytest
import torch

import fzero.optim as fo

SHAPES = {"a": (7,), "b": (1000,), "c": (33, 17)}
STEPS = 10
# Every Vectorized<float> width torch's CPU kernels use is 8 or 16 lanes, and the fused kernels split work at
# 64-byte (16 fp32) boundaries: only the last ``numel % 16`` elements of a tensor can take the scalar loop.
CHUNK = 16


def make_params(seed: int = 0, shapes=SHAPES, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in shapes.items()}


def make_grads(params: dict, steps: int = STEPS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(p.shape, generator=g).to(p.dtype) for k, p in params.items()} for _ in range(steps)]


def run_fzero(opt, params, grads_seq, *, path="inplace"):
    """Params after each step: ``inplace`` = apply_inplace (the fused step), ``pure`` = update + apply_updates."""
    params = {k: v.clone() for k, v in params.items()}
    state = opt.init(params)
    history = []
    for grads in grads_seq:
        if path == "inplace":
            state = fo.apply_inplace(opt, grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            params = fo.apply_updates(params, updates)
        history.append({k: v.clone() for k, v in params.items()})
    return history


def run_torch(make_opt, params, grads_seq):
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = make_opt(list(params.values()))
    history = []
    for grads in grads_seq:
        for k, p in params.items():
            p.grad = grads[k].clone()
        opt.step()
        history.append({k: v.detach().clone() for k, v in params.items()})
    return history


def assert_bitwise(got, expected):
    for step, (g, e) in enumerate(zip(got, expected)):
        for k in e:
            assert torch.equal(g[k], e[k]), f"step {step + 1}, param {k!r}: max diff {(g[k] - e[k]).abs().max()}"


def assert_close(got, expected, **tol):
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tol)


# -- parity with torch.optim -----------------------------------------------------------------------------


def test_adamw_fused_step_is_bitwise_torch_fused_adamw(monkeypatch):
    params, kw = make_params(), dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    grads = make_grads(params)
    calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    got = run_fzero(fo.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1), params, grads)
    assert len(calls) == STEPS  # one kernel call per step for all leaves: the fused path really ran
    monkeypatch.undo()
    assert_bitwise(got, run_torch(lambda ps: torch.optim.AdamW(ps, fused=True, **kw), params, grads))
    for foreach in (False, True):
        expected = run_torch(lambda ps: torch.optim.AdamW(ps, foreach=foreach, **kw), params, grads)
        assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_adamw_pure_path_close_to_torch():
    params, grads = make_params(), make_grads(make_params())
    got = run_fzero(fo.adamw(1e-2, weight_decay=0.1), params, grads, path="pure")
    expected = run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), params, grads)
    assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_adam_matches_torch_adam():
    params, grads = make_params(), make_grads(make_params())
    opt = fo.adam(3e-3, b1=0.8, b2=0.99, eps=1e-6)
    kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)
    assert_bitwise(run_fzero(opt, params, grads), run_torch(lambda ps: torch.optim.Adam(ps, fused=True, **kw), params, grads))
    expected = run_torch(lambda ps: torch.optim.Adam(ps, foreach=False, **kw), params, grads)
    assert_close(run_fzero(opt, params, grads, path="pure"), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "settings",
    [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}, {"weight_decay": 0.05}, {"momentum": 0.8, "nesterov": True, "weight_decay": 0.05}],
    ids=["plain", "momentum", "nesterov", "weight_decay", "all"],
)
def test_sgd_matches_torch_sgd(settings):
    params, grads = make_params(), make_grads(make_params())
    opt = fo.sgd(0.05, **settings)
    # Bitwise: the in-place step runs the very ops of torch's default (for-loop) CPU path.
    assert_bitwise(run_fzero(opt, params, grads), run_torch(lambda ps: torch.optim.SGD(ps, lr=0.05, **settings), params, grads))
    # The pure path rounds p + (-lr * d) twice where torch's add_(d, alpha=-lr) rounds once.
    expected = run_torch(lambda ps: torch.optim.SGD(ps, lr=0.05, **settings), params, grads)
    assert_close(run_fzero(opt, params, grads, path="pure"), expected, rtol=1e-6, atol=1e-6)


def test_adamw_bf16_fused_matches_torch_fused():
    params, kw = make_params(dtype=torch.bfloat16), dict(lr=1e-2, weight_decay=0.1)
    grads = make_grads(params)
    got = run_fzero(fo.adamw(1e-2, weight_decay=0.1), params, grads)
    assert_bitwise(got, run_torch(lambda ps: torch.optim.AdamW(ps, fused=True, **kw), params, grads))
    assert_close(run_fzero(fo.adamw(1e-2, weight_decay=0.1), params, grads, path="pure"), got, rtol=2e-2, atol=2e-2)


def test_fused_and_pure_paths_share_one_state():
    params, grads = make_params(), make_grads(make_params(), steps=6)
    opt = fo.adamw(1e-2)
    p = {k: v.clone() for k, v in params.items()}
    state = opt.init(p)
    for i, g in enumerate(grads):  # alternate the two paths on the same state
        if i % 2:
            updates, state = opt.update(g, state, p)
            p = fo.apply_updates(p, updates)
        else:
            state = fo.apply_inplace(opt, g, state, p)
    assert float(state[0].count) == 6.0
    assert_close([p], run_fzero(opt, params, grads)[-1:], rtol=1e-6, atol=1e-6)


# -- the fused kernel on flat buffers (what ZeRO's bitwise parity depends on) ------------------------------


def _adamw_kernel(params: list[torch.Tensor], grads_seq: list[list[torch.Tensor]]):
    """torch._fused_adamw_ as torch.optim.AdamW(fused=True) calls it; returns (params, exp_avgs, exp_avg_sqs)."""
    ms, vs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float32) for _ in params]
    for grads in grads_seq:
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_(params, grads, ms, vs, [], steps, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)
    return [torch.cat([t.reshape(-1) for t in ts]) for ts in (params, ms, vs)]


def _scalar_tails(numels: list[int], total: int) -> torch.Tensor:
    """Mask of the elements that can take the kernel's scalar loop: the last numel % CHUNK of each tensor."""
    mask, start = torch.zeros(total, dtype=torch.bool), 0
    for n in numels:
        mask[start + n - n % CHUNK : start + n] = True
        start += n
    return mask


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.view(torch.int32) != b.view(torch.int32)


def test_fused_adamw_flat_buffer_vs_separate_tensors():
    """NOT bitwise in general. The kernel runs each tensor's last numel % Vec elements through a scalar loop
    that rounds differently (measured here: exp_avg_sq differs there after one step, params after a few).
    Elementwise math means every difference sits in a scalar tail of one of the two layouts."""
    numels = [7, 1000, 33 * 17, 5, 48]
    total = sum(numels)
    g = torch.Generator().manual_seed(3)
    flat0 = torch.randn(total, generator=g)
    grads = [torch.randn(total, generator=g) for _ in range(STEPS)]
    flat = _adamw_kernel([flat0.clone()], [[x] for x in grads])
    separate = _adamw_kernel([t.clone() for t in flat0.split(numels)], [list(x.split(numels)) for x in grads])
    allowed = _scalar_tails(numels, total) | _scalar_tails([total], total)
    for a, b in zip(flat, separate):
        assert not (_mismatch(a, b) & ~allowed).any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # where this was measured
        assert _mismatch(flat[2], separate[2]).any(), "exp_avg_sq used to differ in the scalar tails"


@pytest.mark.parametrize("cut", [1, 7, 333, 512, 1024, 1571])
def test_fused_adamw_on_shards_of_a_buffer(cut):
    """Two shards (views of one buffer, one kernel call each, as ZeRO ranks do) vs the whole buffer.
    Bitwise when the cut is a multiple of 16 elements (64 bytes of fp32); at an odd cut the elements just
    before the cut fall into the first shard's scalar tail (and the second shard's tail moves), so they differ."""
    total = 1573  # odd, like a ceil-padded unit; its own tail is 1573 % 16 = 5 elements
    g = torch.Generator().manual_seed(4)
    buf0 = torch.randn(total, generator=g)
    grads = [torch.randn(total, generator=g) for _ in range(STEPS)]
    whole = _adamw_kernel([buf0.clone()], [[x] for x in grads])
    buf = buf0.clone()
    shards = [buf[:cut], buf[cut:]]  # views: the kernel writes through them into buf
    ms, vs = [torch.zeros_like(s) for s in shards], [torch.zeros_like(s) for s in shards]
    steps = torch.zeros((), dtype=torch.float32)
    for x in grads:
        steps.add_(1)
        for i, (lo, hi) in enumerate([(0, cut), (cut, total)]):  # one call per rank
            torch._fused_adamw_([shards[i]], [x[lo:hi]], [ms[i]], [vs[i]], [], [steps], lr=1e-2, beta1=0.9,
                                beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    sharded = [buf, torch.cat(ms), torch.cat(vs)]
    if cut % CHUNK == 0:
        for a, b in zip(sharded, whole):
            assert torch.equal(a, b)
    else:
        allowed = _scalar_tails([cut, total - cut], total) | _scalar_tails([total], total)
        for a, b in zip(sharded, whole):
            assert not (_mismatch(a, b) & ~allowed).any()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_apply_inplace_writes_through_views_of_a_buffer():
    buf = torch.randn(40)
    views = {"x": buf[:13], "y": buf[13:]}
    ids = {k: id(v) for k, v in views.items()}
    before = buf.clone()
    for opt in (fo.adamw(1e-2), fo.sgd(0.1, momentum=0.9), fo.chain(fo.scale(-0.1))):
        state = opt.init(views)
        fo.apply_inplace(opt, {"x": torch.ones(13), "y": torch.ones(27)}, state, views)
    assert {k: id(v) for k, v in views.items()} == ids
    assert (buf < before).all()  # every element moved, through the views


def test_non_contiguous_params_take_the_pure_path():
    """The CPU kernel walks data_ptr densely, so strided params must not reach it; results stay correct."""
    base = torch.randn(30, 2)
    other_column = base[:, 1].clone()
    strided = {"w": base[:, 0]}
    dense = {"w": base[:, 0].clone()}
    grads = make_grads(dense, steps=3)
    opt = fo.adamw(1e-2)
    s1, s2 = opt.init(strided), opt.init(dense)
    for g in grads:
        s1 = fo.apply_inplace(opt, g, s1, strided)
        s2 = fo.apply_inplace(opt, g, s2, dense)
    torch.testing.assert_close(strided["w"], dense["w"], rtol=1e-6, atol=1e-6)
    assert torch.equal(base[:, 1], other_column)  # the interleaved elements were not touched


# The state/meta/convergence contract over a registry of optimizers and compositions: tests/test_optim_contract.py.


@pytest.mark.parametrize("make", [lambda lr: fo.adamw(lr), lambda lr: fo.adam(lr), lambda lr: fo.sgd(lr, momentum=0.9)])
def test_schedule_gives_the_lr_of_each_step(make):
    """A schedule is called with 0, 1, 2, ... once per step, on both paths, and the step uses its value."""
    seen = []

    def schedule(step):
        seen.append(step)
        return 0.0 if step % 2 else 1e-2  # odd steps must not move the params

    opt = make(schedule)
    assert opt.learning_rate is schedule
    for path in ("inplace", "pure"):
        seen.clear()
        params = make_params()
        history = run_fzero(opt, params, make_grads(params, steps=4), path=path)
        assert seen == [0, 1, 2, 3]
        if not any(isinstance(s, fo.TraceState) for s in opt.init(params)):  # Adam at lr 0 stays put (momentum SGD has no lr-0 fixed point to check)
            for k in params:
                assert torch.equal(history[1][k], history[0][k])
                assert torch.equal(history[3][k], history[2][k])
        assert not torch.equal(history[2]["b"], history[1]["b"])


def test_chain_and_learning_rate_attribute():
    assert fo.adamw(3e-4).learning_rate == 3e-4
    assert fo.chain(fo.scale(2.0)).fused is None
    one = fo.sgd(0.1)
    assert fo.chain(one) is one  # a chain of one is that transform, fused step included
    assert fo.chain(fo.trace(0.9), fo.scale_by_learning_rate(0.5)).learning_rate == 0.5
    assert fo.identity().update({"x": torch.ones(2)}, fo.identity().init({}))[0]["x"].sum() == 2


def test_schedules():
    assert fo.constant_schedule(0.3)(10) == 0.3
    lin = fo.linear_schedule(1.0, 0.0, 4)
    assert [lin(s) for s in (0, 2, 4, 9)] == [1.0, 0.5, 0.0, 0.0]
    cos = fo.cosine_decay_schedule(2.0, 10, alpha=0.1)
    assert cos(0) == pytest.approx(2.0) and cos(5) == pytest.approx(2.0 * (0.9 * 0.5 + 0.1)) and cos(50) == pytest.approx(0.2)
    wc = fo.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.1)
    assert [wc(s) for s in (0, 2)] == [0.0, 0.5]
    assert wc(4) == pytest.approx(1.0) and wc(9) == pytest.approx(0.55) and wc(14) == pytest.approx(0.1) and wc(99) == pytest.approx(0.1)
    assert all(isinstance(f(3), float) for f in (lin, cos, wc))


# -- input validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: fo.adamw(-1.0), ValueError, r"fzero\.optim\.adamw: learning_rate must be a float >= 0 or a schedule callable, got -1\.0"),
        (lambda: fo.adamw("1e-3"), TypeError, r"fzero\.optim\.adamw: learning_rate must be .* got str '1e-3'"),
        (lambda: fo.adamw(float("nan")), ValueError, r"adamw: learning_rate .* got nan"),
        (lambda: fo.adamw(1e-3, b1=1.0), ValueError, r"fzero\.optim\.adamw: b1 must be in \[0\.0, 1\.0\), got 1\.0\. Typical: b1=0\.9"),
        (lambda: fo.adamw(1e-3, b2=-0.1), ValueError, r"fzero\.optim\.adamw: b2 must be in"),
        (lambda: fo.adamw(1e-3, eps=-1e-8), ValueError, r"fzero\.optim\.adamw: eps must be in \[0\.0, inf\], got -1e-08"),
        (lambda: fo.adamw(1e-3, weight_decay=-0.01), ValueError, r"fzero\.optim\.adamw: weight_decay must be in .* got -0\.01"),
        (lambda: fo.adam(0.1, b1=True), TypeError, r"fzero\.optim\.adam: b1 must be a float .* got bool True"),
        (lambda: fo.sgd(-0.1), ValueError, r"fzero\.optim\.sgd: learning_rate must be"),
        (lambda: fo.sgd(0.1, nesterov=True), ValueError, r"fzero\.optim\.sgd: nesterov=True needs momentum > 0, got momentum=0\.0"),
        (lambda: fo.sgd(0.1, momentum=-0.9), ValueError, r"fzero\.optim\.sgd: momentum must be in"),
        (lambda: fo.sgd(0.1, momentum=0.9, nesterov=1), TypeError, r"fzero\.optim\.sgd: nesterov must be a bool, got int 1"),
        (lambda: fo.scale_by_adam(b2=2.0), ValueError, r"fzero\.optim\.scale_by_adam: b2 must be in"),
        (lambda: fo.trace(-1.0), ValueError, r"fzero\.optim\.trace: decay must be in"),
        (lambda: fo.add_decayed_weights(-1.0), ValueError, r"fzero\.optim\.add_decayed_weights: weight_decay"),
        (lambda: fo.scale_by_learning_rate(None), TypeError, r"scale_by_learning_rate: learning_rate must be .* got NoneType None"),
        (lambda: fo.chain(fo.scale(1.0), "sgd"), TypeError, r"fzero\.optim\.chain: argument 1 must be a GradientTransformation .* got str"),
        (lambda: fo.linear_schedule(1.0, 0.0, 0), ValueError, r"fzero\.optim\.linear_schedule: transition_steps must be an int >= 1, got 0"),
        (lambda: fo.cosine_decay_schedule(1.0, 10, alpha=2.0), ValueError, r"cosine_decay_schedule: alpha must be in \[0\.0, 1\.0\], got 2\.0"),
        (lambda: fo.cosine_decay_schedule(1.0, 10.5), TypeError, r"decay_steps must be an int >= 1, got float 10\.5"),
        (lambda: fo.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), ValueError, r"decay_steps .* must exceed warmup_steps; got decay_steps=10, warmup_steps=10"),
        (lambda: fo.linear_schedule(1.0, 0.0, 5)(-1), ValueError, r"linear_schedule: the step count must be >= 0, got -1"),
    ],
)
def test_errors_name_the_api_the_value_and_the_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_runtime_errors():
    params = {"w": torch.zeros(3)}
    with pytest.raises(TypeError, match=r"fzero\.optim\.apply_inplace: opt must be a GradientTransformation .* got SGD"):
        fo.apply_inplace(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), params, None, params)
    opt = fo.adamw(1e-3)
    with pytest.raises(ValueError, match=r"fzero\.optim\.apply_inplace: grads must have the tree structure of params"):
        fo.apply_inplace(opt, {"v": torch.zeros(3)}, opt.init(params), params)
    wd = fo.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match=r"add_decayed_weights: update needs the params to decay, got params=None"):
        wd.update(params, wd.init(params))
    chained = fo.chain(fo.scale(1.0), fo.scale(2.0))
    with pytest.raises(ValueError, match=r"fzero\.optim\.chain: state must be the tuple of 2 states"):
        chained.update(params, None, params)
    assert math.isfinite(opt.learning_rate)


# -- optax's global-norm clipping, over every rank ---------------------------------------------------------


def _clip_run(optimizer, *, stages: int, ranks: int, offload=None, steps: int = 3):
    import fzero
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([4, 8, 8, 2])
    gen = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=gen), "y": torch.randn(8, 2, generator=gen)}
    step = fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=optimizer,
                         stages=stages, mesh=fzero.local_mesh(ranks) if ranks > 1 else None, offload=offload)
    state = step.init(fzero.params_of(model))
    for _ in range(steps):
        state, _ = step(state, batch)
    return step.gather(state)


def test_clip_by_global_norm_clips_by_the_norm_over_every_rank_as_compiles_clip():
    """optax users chain ``clip_by_global_norm`` in front of the optimizer. Written by hand (the norm of the updates
    the transform is given), it took the norm of this rank's shard at stages 1-3, 7.9e-4 off stage 0 after 3 SGD
    steps on 2 ranks, without a word. ``fzero.optim.clip_by_global_norm`` sums the ranks' shares: every stage and
    CPU offload train as stage 0 on one rank and as ``compile(clip_grad_norm=...)``; in a ``multi_transform`` group
    it clips by the group's norm, at every stage alike."""
    import fzero

    want = _clip_run(fo.chain(fo.clip_by_global_norm(0.01), fo.sgd(0.1)), stages=0, ranks=1)
    unclipped = _clip_run(fo.sgd(0.1), stages=0, ranks=1)
    assert max(float((want[k] - unclipped[k]).abs().max()) for k in want) > 1e-2  # the clip acts here
    torch.manual_seed(0)
    from fzero.models import MLP

    model = MLP([4, 8, 8, 2])
    gen = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=gen), "y": torch.randn(8, 2, generator=gen)}
    step = fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=fo.sgd(0.1),
                         clip_grad_norm=0.01)
    state = step.init(fzero.params_of(model))
    for _ in range(3):
        state, _ = step(state, batch)
    for k, v in step.gather(state).items():  # compile's clip divides by norm + 1e-6
        torch.testing.assert_close(want[k], v, rtol=1e-5, atol=1e-7)
    for stages, offload in ((1, None), (2, "cpu"), (3, None)):
        got = _clip_run(fo.chain(fo.clip_by_global_norm(0.01), fo.sgd(0.1)), stages=stages, ranks=2, offload=offload)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=f"stage {stages}, {offload}: {k}")
    grouped = fo.multi_transform({"clipped": fo.chain(fo.clip_by_global_norm(0.01), fo.sgd(0.1)), "plain": fo.sgd(0.1)},
                                 lambda p: {k: "clipped" if k.startswith("layers.0") else "plain" for k in p})
    want = _clip_run(grouped, stages=0, ranks=1)
    got = _clip_run(grouped, stages=3, ranks=2)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


def test_global_norm_is_refused_where_the_leaves_are_a_disk_offload_sub_group(tmp_path):
    import fzero
    from fzero.models import MLP

    model = MLP([4, 8, 2])
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), stages=1, offload="disk", offload_dir=str(tmp_path),
                         optimizer=fo.chain(fo.clip_by_global_norm(1.0), fo.sgd(0.1)))
    with pytest.raises(NotImplementedError, match=r"fzero\.optim\.global_norm: .*offload='disk'.*clip_grad_norm"):
        step(step.init(fzero.params_of(model)), torch.randn(4, 4))


@pytest.mark.parametrize("name, says", [("MultiSteps", r"grad_accum=k"), ("apply_if_finite", r"on_nonfinite='skip'"),
                                        ("inject_hyperparams", r"lambda step: lr\['now'\]"),
                                        ("exponential_decay", r"any function of the step count is a schedule"),
                                        ("rmsprop", r"adamw, adam, sgd, lamb and lion")])
def test_an_optax_name_fzero_has_no_function_for_names_the_way(name, says):
    with pytest.raises(AttributeError, match=rf"fzero\.optim' has no attribute '{name}' \(optax's {name}\): .*{says}"):
        getattr(fo, name)
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_thing'$"):
        fo.no_such_thing


def test_layout_segments_are_made_once_per_layout_rank_and_sharding():
    """``LayoutSegments`` reads its per-parameter pieces from a cache by layout identity (``_segments_of``): each
    (layout, rank, sharding) gets its own, equal to the pieces made from scratch, and a layout made later (another world
    size, another model: a new object, which may reuse a dead one's id) never reads a dead layout's entry."""
    import gc
    import weakref

    from fzero.layout import LayoutSegments
    from fzero.layout._layout import _SEGMENTS, build_layout

    def fresh(layout, sharded, rank):  # what LayoutSegments computed at every step before the cache
        out = {}
        for unit in layout.units:
            lo, hi = unit.shard_range(rank, layout.world_size) if sharded else (0, unit.padded)
            bounds = [(s.offset, s.offset + s.numel) for s in unit.slots] + [(unit.numel, unit.padded)]
            out[unit.name] = ([(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in bounds],
                              [*layout.leaf_indices(unit), -1])
        return out

    def segments(layout, sharded, rank):
        seg = LayoutSegments(layout, sharded=sharded, rank=rank, comm=None)
        return {k: (list(seg.pieces[k]), list(seg.params[k])) for k in seg.pieces}

    params = {"a": torch.zeros(5), "b": torch.zeros(3, 2), "c": torch.zeros(7)}
    seen = []
    for world in (1, 2, 3):
        layout = build_layout(params, world_size=world, unit_elements=8, api="test")
        for sharded in (False, True):
            for rank in range(world):
                got = segments(layout, sharded, rank)
                assert got == fresh(layout, sharded, rank)
                assert segments(layout, sharded, rank) == got  # the cached entry, read again
                seen.append(got)
        ref = weakref.ref(layout)
        del layout
        gc.collect()
        assert ref() is None  # the cache holds no layout alive, and its entries go with it
        assert not any(hit[0]() is None for hit in _SEGMENTS.values())
    assert seen[4] != seen[5]  # world 2, sharded: the two ranks' shards hold different pieces
    with pytest.raises(TypeError):
        LayoutSegments(build_layout(params, world_size=1, api="test"), sharded=False, rank=0, comm=None).pieces["x"] = ()


def test_split_sizes_are_made_once_per_unit_and_handed_out_as_new_lists():
    """``split_sizes`` reads a unit's sizes from a cache by the unit's identity (a unit is frozen): each call gets a new
    list equal to the sizes made from scratch (a caller that appends to it changes no later call's), and a unit made
    later (another layout: a new object, which may reuse a dead one's id) never reads a dead unit's entry."""
    import gc
    import math
    import weakref

    from fzero.layout._layout import _SIZES, build_layout, split_sizes

    for world in (1, 2, 3):
        params = {"a": torch.zeros(5 * world), "b": torch.zeros(3, 2), "c": torch.zeros(7)}
        layout = build_layout(params, world_size=world, unit_elements=8, api="test")
        for unit in layout.units:
            fresh = [math.prod(s.shape) for s in unit.slots] + ([unit.padded - unit.numel] if unit.padded > unit.numel else [])
            first = split_sizes(unit)
            assert first == fresh
            first.append(-1)  # the caller's own list
            assert split_sizes(unit) == fresh
        ref = weakref.ref(layout.units[0])
        del layout, unit
        gc.collect()
        assert ref() is None  # the cache holds no unit alive, and its entries go with it
        assert not any(hit[0]() is None for hit in _SIZES.values())
