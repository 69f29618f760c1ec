"""fzero.ops: every Triton kernel against its torch reference, the references against torch, and the dispatch.

On a CPU-only machine the Triton kernels run under Triton's interpreter (``impl="triton"`` on CPU tensors
builds the interpreted twin of each kernel, ``fzero.ops._kernels``), on small tensors: lengths that are not a
multiple of the block, fp32/bf16/fp16 gradients, non-finite elements, ``inv_scale != 1``, Adam and AdamW,
several steps. Tests marked ``gpu`` need CUDA and are skipped without it.
"""

import pytest
import torch

import fzero
import fzero.ops as ops
from fzero.ops import _dispatch
from fzero.ops._adam import BLOCK
from fzero.ops.bench import adamw_gbps
from fzero.optim import _fused

needs_triton = pytest.mark.skipif(not ops.triton_available(), reason="triton is not installed (pip install 'fzero[triton]')")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
N = 2 * BLOCK + 37  # three blocks, the last one partial


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype and shape, NaN at the same places, every other element the same bits (-0.0 != 0.0). NaN payloads
    are not compared: torch's own fp32->bf16 conversion gives different NaN bits on different paths."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), "NaN at different places"
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    diff = (actual.view(as_int) != expected.view(as_int)) & ~nan_a
    assert not diff.any(), f"{int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}: " \
                           f"{actual[diff][0].item()!r} vs {expected[diff][0].item()!r}"


def adam_state(n: int, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    exp_avg = torch.randn(n, generator=g) * 1e-2
    exp_avg_sq = torch.rand(n, generator=g) * 1e-4
    return [t.to(device) for t in (master, exp_avg, exp_avg_sq)]


def run_both(fn, *tensors):
    """``fn(impl, *copies)`` once per impl on its own copies of ``tensors``; returns {impl: (copies, result)}."""
    out = {}
    for impl in ("triton", "torch"):
        copies = [t.clone() for t in tensors]
        out[impl] = (copies, fn(impl, *copies))
    return out


# -- fused Adam / AdamW: the Triton kernel (interpreted) against the reference, bit for bit ----------------------


@needs_triton
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adam_kernel_equals_reference_over_steps(grad_dtype, decoupled):
    # Bitwise: the kernel and the reference do the same IEEE operations in the same order (fzero.ops._adam).
    master, exp_avg, exp_avg_sq = adam_state(N)
    states = {impl: [master.clone(), exp_avg.clone(), exp_avg_sq.clone()] for impl in ("triton", "torch")}
    gen = torch.Generator().manual_seed(1)
    # Step by step: a power-of-two loss scale as a number, a non-power-of-two one as a device tensor, then none;
    # a bf16, then fp16, then fp32 copy-out; lr changes as under a schedule.
    plan = [(2.0**-7, torch.bfloat16, 1e-2), (torch.tensor([0.37]), torch.float16, 3e-3), (1.0, torch.float32, 1e-3)]
    for step, (inv_scale, out_dtype, lr) in enumerate(plan, start=1):
        grad = (torch.randn(N, generator=gen) * 50).to(grad_dtype)
        outs, flags = {}, {}
        for impl, (p, m, v) in states.items():
            outs[impl] = torch.full((N,), 7.0, dtype=out_dtype)
            flags[impl] = ops.adam_(p, grad, m, v, step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                    decoupled=decoupled, inv_scale=inv_scale, param_out=outs[impl], impl=impl)
        for a, b in zip(states["triton"], states["torch"]):
            assert_bitwise(a, b)
        assert_bitwise(outs["triton"], outs["torch"])
        assert_bitwise(outs["torch"], states["torch"][0].to(out_dtype))  # the copy-out is the master, rounded
        assert flags["triton"].item() == flags["torch"].item() == 0.0
    assert not torch.equal(states["torch"][0], master)  # it did step


@needs_triton
@pytest.mark.parametrize("n", [1, BLOCK, BLOCK + 1, 3 * BLOCK - 1])
def test_adam_kernel_lengths(n):
    master, exp_avg, exp_avg_sq = adam_state(n, seed=n)
    grad = torch.randn(n)
    res = run_both(lambda impl, p, m, v: ops.adamw_(p, grad, m, v, step=4, lr=1e-3, impl=impl), master, exp_avg, exp_avg_sq)
    for a, b in zip(res["triton"][0], res["torch"][0]):
        assert_bitwise(a, b)


@needs_triton
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adam_kernel_nonfinite_flag(grad_dtype):
    master, exp_avg, exp_avg_sq = adam_state(N)
    grad = torch.randn(N).to(grad_dtype)
    grad[5], grad[N - 1] = float("inf"), float("nan")  # one in the first block, one in the partial last block
    res = run_both(lambda impl, p, m, v: ops.adamw_(p, grad, m, v, step=2, lr=1e-3, inv_scale=0.5, impl=impl),
                   master, exp_avg, exp_avg_sq)
    for impl in ("triton", "torch"):
        assert res[impl][1].tolist() == [1.0]
    for a, b in zip(res["triton"][0], res["torch"][0]):
        assert_bitwise(a, b)  # the inf/NaN elements came out NaN in both, the others updated alike
    # The flag is only ever set: a later finite call leaves a set flag set, and a clear one clear.
    for impl in ("triton", "torch"):
        p, m, v = res[impl][0]
        flag = res[impl][1]
        ops.adamw_(p, torch.randn(N).to(grad_dtype), m, v, step=3, lr=1e-3, nonfinite=flag, impl=impl)
        assert flag.tolist() == [1.0]
        assert ops.adamw_(p, torch.randn(N).to(grad_dtype), m, v, step=3, lr=1e-3, impl=impl).tolist() == [0.0]


@needs_triton
def test_adam_kernel_inv_scale_overflow_sets_flag():
    # A finite fp16 gradient times an inv_scale > 1 that overflows fp32 counts as non-finite: the check is on the
    # gradient the update uses.
    master, exp_avg, exp_avg_sq = adam_state(N)
    grad = torch.ones(N, dtype=torch.float16)
    res = run_both(lambda impl, p, m, v: ops.adam_(p, grad, m, v, step=1, lr=1e-3, inv_scale=1e39, impl=impl),
                   master, exp_avg, exp_avg_sq)
    assert res["triton"][1].tolist() == res["torch"][1].tolist() == [1.0]


@needs_triton
def test_adam_kernel_found_inf_skips_the_step():
    master, exp_avg, exp_avg_sq = adam_state(N)
    grad = torch.randn(N)
    grad[3] = float("inf")
    out = torch.zeros(N, dtype=torch.bfloat16)
    for impl in ("triton", "torch"):
        p, m, v, o = master.clone(), exp_avg.clone(), exp_avg_sq.clone(), out.clone()
        flag = ops.adamw_(p, grad, m, v, step=1, lr=1e-3, param_out=o, found_inf=torch.ones(1), impl=impl)
        for a, b in zip((p, m, v, o), (master, exp_avg, exp_avg_sq, out)):
            assert_bitwise(a, b)  # nothing read or written
        assert flag.tolist() == [0.0]
    # found_inf = 0 is the same as no found_inf.
    res = run_both(lambda impl, p, m, v: ops.adam_(p, grad, m, v, step=1, lr=1e-3, found_inf=torch.zeros(1), impl=impl),
                   master, exp_avg, exp_avg_sq)
    plain = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
    ops.adam_(plain[0], grad, plain[1], plain[2], step=1, lr=1e-3, impl="torch")
    for a, b, c in zip(res["triton"][0], res["torch"][0], plain):
        assert_bitwise(a, c)
        assert_bitwise(b, c)


@needs_triton
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_kernel_without_weight_decay(decoupled):
    # weight_decay=0 drops the decay term, as torch does (0 * inf would be NaN): an inf master stays inf.
    master, exp_avg, exp_avg_sq = adam_state(N)
    master[0] = float("inf")
    grad = torch.randn(N, dtype=torch.bfloat16)
    res = run_both(lambda impl, p, m, v: ops.adam_(p, grad, m, v, step=7, lr=1e-3, weight_decay=0.0, decoupled=decoupled,
                                                   impl=impl), master, exp_avg, exp_avg_sq)
    for a, b in zip(res["triton"][0], res["torch"][0]):
        assert_bitwise(a, b)
    assert res["torch"][0][0][0].item() == float("inf")


# -- the reference against torch's own fused kernels (CPU) ------------------------------------------------------


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_reference_agrees_with_torch_fused_cpu(decoupled):
    # Not bitwise: torch's CPU kernel is another arithmetic (fp32 hyperparameters, lerp for exp_avg, a scalar tail;
    # fzero.ops._adam follows the CUDA kernel). Measured after 10 steps: a few fp32 ulps of each tensor's largest
    # element (4e-7 relative), so the bound is 1e-6 of it.
    n = 10_003
    gen = torch.Generator().manual_seed(0)
    ours = adam_state(n)
    theirs = [t.clone() for t in ours]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    for step in range(1, 11):
        grad = torch.randn(n, generator=gen)
        ops.adam_(ours[0], grad, ours[1], ours[2], step=step, lr=1e-3, weight_decay=0.1, decoupled=decoupled, impl="torch")
        kernel([theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step))], lr=1e-3,
               beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * b.abs().max().item())


def test_reference_unscales_as_torch_grad_scale():
    # torch divides by grad_scale, fzero.ops multiplies by inv_scale: the same bits for a power-of-two scale, so the
    # comparison has the tolerance above and no more. found_inf skips in both.
    n = 4099
    ours = adam_state(n)
    theirs = [t.clone() for t in ours]
    grad = torch.randn(n) * 1024
    ops.adamw_(ours[0], grad, ours[1], ours[2], step=1, lr=1e-3, inv_scale=1 / 1024, impl="torch")
    torch._fused_adamw_([theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]], [], [torch.tensor(1.0)], lr=1e-3, beta1=0.9,
                        beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.tensor(1024.0))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * b.abs().max().item())


# -- per-unit sum of squares ------------------------------------------------------------------------------------


def _units(gen):
    sizes_dtypes = [(3 * BLOCK + 5, torch.float32), (1, torch.bfloat16), (BLOCK, torch.float16), (0, torch.float32),
                    (777, torch.bfloat16)]
    return [(torch.randn(n, generator=gen) * 3).to(d) for n, d in sizes_dtypes]


@needs_triton
def test_sumsq_kernel_and_reference_are_accurate():
    # Not bitwise: the two add the same fp32 squares in different orders (a block tree and P partials in the kernel,
    # BLAS's dot in the reference). Each is checked against the exact (fp64) sum: within 1e-5 relative, a bound on
    # fp32 summation error for these sizes with room to spare (measured: about 1e-6).
    units = _units(torch.Generator().manual_seed(0))
    exact = torch.stack([g.double().square().sum() for g in units]).float()
    for impl in ("triton", "torch"):
        sumsq, flag = ops.grad_sumsq(units, impl=impl)
        assert sumsq.dtype == torch.float32 and sumsq.shape == (len(units),)
        torch.testing.assert_close(sumsq, exact, rtol=1e-5, atol=0)
        assert sumsq[3].item() == 0.0
        assert flag.tolist() == [0.0]


@needs_triton
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), "overflow"])
def test_sumsq_nonfinite_flag(bad):
    units = _units(torch.Generator().manual_seed(1))
    if bad == "overflow":  # finite elements whose squares pass fp32's range: the norm is unusable all the same
        units[0][:4] = 1e20
    else:
        units[2][BLOCK - 1] = bad
    for impl in ("triton", "torch"):
        sumsq, flag = ops.grad_sumsq(units, impl=impl)
        assert flag.tolist() == [1.0]
        assert torch.isfinite(sumsq).tolist() == [bad != "overflow", True, bad == "overflow", True, True]


def test_sumsq_flat_buffer_with_sizes():
    units = _units(torch.Generator().manual_seed(2))[:1] * 2 + [torch.randn(5)]
    flat = torch.cat(units)
    by_list = ops.grad_sumsq(units, impl="torch")
    by_flat = ops.grad_sumsq(flat, sizes=[u.numel() for u in units], impl="torch")
    # Not bitwise: BLAS's dot splits its work by the data's address, and a unit inside the buffer sits elsewhere.
    torch.testing.assert_close(by_flat.sumsq, by_list.sumsq, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"fzero\.ops\.grad_sumsq: sizes must .* add up to the buffer's"):
        ops.grad_sumsq(flat, sizes=[1, 2])
    with pytest.raises(TypeError, match=r"fzero\.ops\.grad_sumsq: a single tensor needs sizes="):
        ops.grad_sumsq(flat)


# -- cast and scale ---------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("out_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_scale_cast_kernel_equals_reference(grad_dtype, out_dtype):
    # Bitwise: an exact conversion to fp32, one fp32 product, one rounding to nearest even (fzero.ops._cast).
    grad = (torch.randn(N, generator=torch.Generator().manual_seed(3)) * 1e3).to(grad_dtype)
    grad[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    res = run_both(lambda impl, g: ops.scale_cast(g, 1 / 3, out_dtype, impl=impl), grad)
    assert_bitwise(res["triton"][1], res["torch"][1])
    assert res["torch"][1].dtype == out_dtype


@needs_triton
def test_scale_cast_rounds_to_nearest_even():
    # fp32 bit patterns at and around bf16's rounding ties, the largest finite values, and fp32 subnormals.
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x00018000, 0x80000001]
    x = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    expected = x.to(torch.bfloat16)  # torch rounds to nearest even
    for impl in ("triton", "torch"):
        assert_bitwise(ops.scale_cast(x, 1.0, torch.bfloat16, impl=impl), expected)


@needs_triton
def test_scale_cast_into_out_and_in_place():
    grad = torch.randn(N)
    expected = ops.scale_cast(grad, 0.125, torch.float32, impl="torch")
    for impl in ("triton", "torch"):
        out = torch.empty(N)
        assert ops.scale_cast(grad, 0.125, torch.float32, out=out, impl=impl) is out
        assert_bitwise(out, expected)
        g = grad.clone()
        ops.scale_cast(g, 0.125, torch.float32, out=g, impl=impl)
        assert_bitwise(g, expected)


# -- dispatch and errors ----------------------------------------------------------------------------------------


def _refuse(*args, **kwargs):
    raise AssertionError("the Triton path ran")


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    import fzero.ops._adam as adam_mod
    import fzero.ops._cast as cast_mod
    import fzero.ops._norm as norm_mod

    monkeypatch.setattr(adam_mod, "_adam_triton", _refuse)
    monkeypatch.setattr(norm_mod, "_sumsq_triton", _refuse)
    monkeypatch.setattr(cast_mod, "_scale_cast_triton", _refuse)
    master, exp_avg, exp_avg_sq = adam_state(100)
    ops.adamw_(master, torch.randn(100), exp_avg, exp_avg_sq, step=1, lr=1e-3)
    ops.grad_sumsq([torch.randn(10)])
    ops.scale_cast(torch.randn(10), 0.5, torch.bfloat16)
    assert _dispatch.choose("api", "auto", torch.device("cpu")) == "torch"


def test_triton_without_triton_says_how_to_install(monkeypatch):
    monkeypatch.setattr(_dispatch, "_import_triton", lambda: (None, "ModuleNotFoundError: No module named 'triton'"))
    assert not ops.triton_available()
    master, exp_avg, exp_avg_sq = adam_state(10)
    with pytest.raises(ImportError, match=r"fzero\.ops\.adamw_: impl='triton' needs the triton package.*"
                                          r"No module named 'triton'.*pip install 'fzero\[triton\]'"):
        ops.adamw_(master, torch.randn(10), exp_avg, exp_avg_sq, step=1, lr=1e-3, impl="triton")
    with pytest.raises(ImportError, match=r"fzero\.ops\.grad_sumsq: impl='triton'"):
        ops.grad_sumsq([torch.randn(3)], impl="triton")
    with pytest.raises(ImportError, match=r"fzero\.ops\.scale_cast: impl='triton'"):
        ops.scale_cast(torch.randn(3), 1.0, torch.float16, impl="triton")
    # "auto" still works, on the reference.
    ops.adamw_(master, torch.randn(10), exp_avg, exp_avg_sq, step=1, lr=1e-3, impl="auto")
    assert _dispatch.choose("api", "auto", torch.device("cuda")) == "torch"


def test_bad_arguments_name_the_api_and_the_value():
    master, exp_avg, exp_avg_sq = adam_state(8)
    grad = torch.randn(8)
    with pytest.raises(ValueError, match=r"fzero\.ops\.adamw_: impl must be one of 'auto', 'triton', 'torch'; got 'cuda'"):
        ops.adamw_(master, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, impl="cuda")
    with pytest.raises(TypeError, match=r"fzero\.ops\.adam_: master must be float32 .* got torch\.float16"):
        ops.adam_(master.half(), grad, exp_avg, exp_avg_sq, step=1, lr=1e-3)
    with pytest.raises(TypeError, match=r"fzero\.ops\.adamw_: grad must be float32, bfloat16 or float16, got torch\.float64"):
        ops.adamw_(master, grad.double(), exp_avg, exp_avg_sq, step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"fzero\.ops\.adamw_: exp_avg must have master's numel .*got 7"):
        ops.adamw_(master, grad, exp_avg[:7], exp_avg_sq, step=1, lr=1e-3)
    with pytest.raises(ValueError, match=r"fzero\.ops\.adamw_: grad must be contiguous"):
        ops.adamw_(master[:4], torch.randn(8)[::2], exp_avg[:4], exp_avg_sq[:4], step=1, lr=1e-3)
    with pytest.raises(TypeError, match=r"fzero\.ops\.adamw_: lr must be a Python number .*got Tensor"):
        ops.adamw_(master, grad, exp_avg, exp_avg_sq, step=1, lr=torch.tensor(1e-3))
    with pytest.raises(ValueError, match=r"fzero\.ops\.adamw_: step must be .* >= 1 .*got 0"):
        ops.adamw_(master, grad, exp_avg, exp_avg_sq, step=0, lr=1e-3)
    with pytest.raises(ValueError, match=r"fzero\.ops\.adamw_: found_inf must be a one-element float32 tensor"):
        ops.adamw_(master, grad, exp_avg, exp_avg_sq, step=1, lr=1e-3, found_inf=torch.zeros(2))
    with pytest.raises(TypeError, match=r"fzero\.ops\.scale_cast: dtype must be .* got torch\.int8"):
        ops.scale_cast(grad, 1.0, torch.int8)
    with pytest.raises(ValueError, match=r"fzero\.ops\.scale_cast: out must be a contiguous torch\.bfloat16 tensor"):
        ops.scale_cast(grad, 1.0, torch.bfloat16, out=torch.empty(8))


def test_import_fzero_ops_does_not_import_triton():
    # The check runs in a fresh interpreter: this one may have imported triton already.
    import subprocess
    import sys

    code = "import sys, fzero, fzero.ops, fzero.optim; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- fzero.optim's in-place Adam step on Triton's leaves ---------------------------------------------------------


def test_fused_step_keeps_torch_kernel_on_cpu():
    kernel = torch._fused_adamw_
    assert _fused._kernel(kernel, True, {(torch.device("cpu"), torch.float32): None}) is kernel


@needs_triton
def test_fused_step_runs_the_triton_kernel_on_its_leaves(monkeypatch):
    # CUDA float32 leaves go to fzero.ops' kernel; here CPU leaves are made eligible so that the kernel runs under
    # the interpreter. It must equal fzero.ops' reference bit for bit, and torch's kernel must not run for them.
    monkeypatch.setattr(_fused, "triton_leaf", lambda device, dtype: dtype == torch.float32)
    monkeypatch.setattr(_fused, "TRITON_MIN_ELEMENTS", 0)
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(N, generator=gen), "b": torch.randn(37, generator=gen)}
    opt = fzero.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    ref = {k: [v.clone(), torch.zeros_like(v), torch.zeros_like(v)] for k, v in params.items()}
    for step in range(1, 4):
        grads = {k: torch.randn(v.shape, generator=gen) for k, v in params.items()}
        state = fzero.optim.apply_inplace(opt, grads, state, params)
        for k, (p, m, v) in ref.items():
            ops.adamw_(p, grads[k], m, v, step=step, lr=1e-2, weight_decay=0.1, impl="torch")
    assert calls == []
    for k, (p, m, v) in ref.items():
        assert_bitwise(params[k], p)


@needs_triton
def test_fused_step_adapter_splits_leaves_and_counts(monkeypatch):
    # The adapter behind _kernel: eligible leaves through fzero.ops with their own step counts (as _per_param_counts
    # passes them), the others (fp64 here) through torch's kernel in one call.
    monkeypatch.setattr(_fused, "triton_leaf", lambda device, dtype: dtype == torch.float32)
    monkeypatch.setattr(_fused, "TRITON_MIN_ELEMENTS", 0)
    calls = []
    torch_kernel = lambda *a, **k: calls.append([t.dtype for t in a[0]]) or torch._fused_adam_(*a, **k)  # noqa: E731
    leaves = [adam_state(N, seed=0), adam_state(50, seed=1), [t.double() for t in adam_state(9, seed=2)]]
    grads = [torch.randn(N), torch.randn(50), torch.randn(9, dtype=torch.float64)]
    steps = [torch.tensor(3.0), torch.tensor(1.0), torch.tensor(3.0)]
    expected = [[t.clone() for t in leaf] for leaf in leaves[:2]]
    _fused._triton_adam(torch_kernel, False, [x[0] for x in leaves], grads, [x[1] for x in leaves], [x[2] for x in leaves],
                        [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    assert calls == [[torch.float64]]
    for (p, m, v), g, step in zip(expected, grads, steps):
        ops.adam_(p, g, m, v, step=float(step), lr=1e-3, weight_decay=0.1, impl="torch")
    for got, want in zip(leaves, expected):
        for a, b in zip(got, want):
            assert_bitwise(a, b)


@needs_triton
def test_fused_step_sends_leaves_below_the_size_threshold_to_torchs_kernel(monkeypatch):
    # Below TRITON_MIN_ELEMENTS torch's one multi-tensor call is faster than a Triton call per leaf (measured on an
    # H100): the small leaf goes to torch's kernel, the large one to fzero.ops', each with its own arithmetic.
    monkeypatch.setattr(_fused, "triton_leaf", lambda device, dtype: dtype == torch.float32)
    monkeypatch.setattr(_fused, "TRITON_MIN_ELEMENTS", 100)
    calls = []
    torch_kernel = lambda *a, **k: calls.append([t.numel() for t in a[0]]) or torch._fused_adam_(*a, **k)  # noqa: E731
    leaves = [adam_state(N, seed=0), adam_state(50, seed=1)]
    grads = [torch.randn(N), torch.randn(50)]
    steps = [torch.tensor(2.0), torch.tensor(2.0)]
    big = [t.clone() for t in leaves[0]]
    small = [t.clone() for t in leaves[1]]
    _fused._triton_adam(torch_kernel, False, [x[0] for x in leaves], grads, [x[1] for x in leaves], [x[2] for x in leaves],
                        [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    assert calls == [[50]]
    ops.adam_(*big[:1], grads[0], *big[1:], step=2.0, lr=1e-3, weight_decay=0.1, impl="torch")
    torch._fused_adam_([small[0]], [grads[1]], [small[1]], [small[2]], [], [torch.tensor(2.0)], lr=1e-3, beta1=0.9,
                       beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    for got, want in zip(leaves, [big, small]):
        for a, b in zip(got, want):
            assert_bitwise(a, b)


def test_fused_step_without_triton_keeps_torch_kernel(monkeypatch):
    monkeypatch.setattr(_fused, "triton_leaf", lambda device, dtype: True)
    monkeypatch.setattr(_dispatch, "_import_triton", lambda: (None, "ModuleNotFoundError"))
    kernel = torch._fused_adam_
    assert _fused._kernel(kernel, False, {(torch.device("cpu"), torch.float32): None}) is kernel


# -- the bandwidth benchmark ------------------------------------------------------------------------------------


def test_adamw_gbps_runs_on_cpu():
    for impl in ("torch", "torch_fused"):
        assert adamw_gbps(4096, device="cpu", impl=impl, repeats=2, warmup=1) > 0
    assert adamw_gbps(4096, device="cpu", impl="torch", repeats=1, param_out=torch.bfloat16, grad_dtype=torch.bfloat16) > 0
    with pytest.raises(ValueError, match=r"fzero\.ops\.bench\.adamw_gbps: impl='triton' needs a CUDA device"):
        adamw_gbps(4096, device="cpu", impl="triton")


# -- on a GPU ---------------------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_gpu_adam_kernel_equals_reference_and_torch(grad_dtype, decoupled):
    # Compiled Triton against the reference on the GPU: bitwise (no FMA contraction, IEEE div and sqrt; the
    # reference divides by a device tensor, as torch's CUDA division by a host number multiplies by its reciprocal:
    # with that mended, bitwise on an H100 under torch 2.11). Against torch's CUDA kernel: not bitwise. nvcc
    # contracts its multiply-adds into FMAs, which round once where the kernel rounds twice, so an element differs
    # by the rounding of its terms: on the H100 (torch 2.11, after one step at step 3) 0.9% of the elements, by up
    # to 1.2e-7 on masters of about 1 (1-2 ulp), and by more ulps of the result where two terms nearly cancel
    # (b1*m + (1-b1)*g). So each element is held to a few roundings of the terms that make it, carried through
    # the update (the bound below, in float64); a wrong formula misses it by orders of magnitude.
    n = (1 << 20) + 3
    master, exp_avg, exp_avg_sq = adam_state(n, device="cuda")
    grad = (torch.randn(n, device="cuda") * 64).to(grad_dtype)
    before = [t.double() for t in (master, exp_avg, exp_avg_sq)]
    res = run_both(lambda impl, p, m, v, o: ops.adam_(p, grad, m, v, step=3, lr=1e-3, weight_decay=0.1, decoupled=decoupled,
                                                      inv_scale=1 / 64, param_out=o, impl=impl),
                   master, exp_avg, exp_avg_sq, torch.empty(n, dtype=torch.bfloat16, device="cuda"))
    for a, b in zip(res["triton"][0], res["torch"][0]):
        assert_bitwise(a, b)
    if grad_dtype == torch.float32:
        theirs = [master.clone(), exp_avg.clone(), exp_avg_sq.clone()]
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel([theirs[0]], [grad.clone()], [theirs[1]], [theirs[2]], [], [torch.tensor(3.0, device="cuda")], lr=1e-3,
               beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
               grad_scale=torch.tensor(64.0, device="cuda"))
        bounds = _adam_rounding_bounds(*before, grad.double() / 64, step=3, lr=1e-3, wd=0.1, decoupled=decoupled)
        for name, a, b, bound in zip(("master", "exp_avg", "exp_avg_sq"), res["triton"][0][:3], theirs, bounds):
            excess = (a.double() - b.double()).abs() - bound
            assert excess.max().item() <= 0, f"{name}: {int((excess > 0).sum())} elements beyond rounding"


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_the_adam_rounding_bound_holds_across_kernels_and_misses_a_wrong_step(decoupled):
    # The bound the GPU test holds torch's CUDA kernel to, checked here on torch's CPU kernel (another rounding
    # of the same step) against fzero.ops' reference; a step with lr 1% off is far outside it.
    n = (1 << 16) + 3
    p, m, v = adam_state(n, seed=3)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 64
    bounds = _adam_rounding_bounds(p.double(), m.double(), v.double(), g.double() / 64, step=3, lr=1e-3, wd=0.1,
                                   decoupled=decoupled)
    theirs = [p.clone(), m.clone(), v.clone()]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel([theirs[0]], [g.clone()], [theirs[1]], [theirs[2]], [], [torch.tensor(3.0)], lr=1e-3, beta1=0.9, beta2=0.999,
           weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, grad_scale=torch.tensor(64.0))
    for lr, inside in ((1e-3, True), (1.01e-3, False)):
        mine = [p.clone(), m.clone(), v.clone()]
        ops.adam_(mine[0], g, mine[1], mine[2], step=3, lr=lr, weight_decay=0.1, decoupled=decoupled, inv_scale=1 / 64,
                  impl="torch")
        within = (mine[0].double() - theirs[0].double()).abs() <= bounds[0]
        assert bool(within.all()) if inside else float(within.float().mean()) < 0.05  # only the tiniest updates inside
        if inside:
            for a, b, bound in zip(mine[1:], theirs[1:], bounds[1:]):
                assert bool(((a.double() - b.double()).abs() <= bound).all())


def _adam_rounding_bounds(p, m, v, g, *, step, lr, wd, decoupled, b1=0.9, b2=0.999, eps=1e-8, k=8):
    """Per element, k fp32 roundings (unit roundoff u = 2^-24) of each term of one Adam step, carried through
    (float64): how far two correct fp32 implementations that round differently can be apart (each within four
    roundings of a term: k = 8 for their difference). torch's CPU kernel, whose lerp and vector/scalar paths round
    differently again, against fzero.ops' reference stays within half of it (checked on this machine)."""
    u = k * 2.0 ** -24
    # The step's scalars: a kernel may take the betas as fp32 and 1 - beta**step in fp32, whose error the
    # cancellation in 1 - beta**step amplifies by beta**step / (1 - beta**step) (about 333 for beta2 at step 3): a
    # relative error of the whole update, the same for every element. Measured on the H100 (torch 2.11, step 3):
    # 0.016% of the masters were beyond the per-element bound alone, by at most 3e-8.
    bc1, bc2 = b1 ** step, b2 ** step
    rel_scalars = (step + 2) * 2.0 ** -24 * (bc1 / (1 - bc1) + 0.5 * bc2 / (1 - bc2))
    g_eff, g_mag = (g, g.abs()) if decoupled else (g + wd * p, g.abs() + wd * p.abs())
    m1 = b1 * m + (1 - b1) * g_eff
    v1 = b2 * v + (1 - b2) * g_eff * g_eff
    # A kernel may also hold b1 and b2 in fp32 (torch 2.11's CUDA kernel does, judging by the size of its difference
    # in v: 1.3e-5 of the (1-b2)*g*g term, the error of fp32(0.999) over 1 - 0.999): 1 - b then carries b's
    # rounding, b/(1-b) ulps of it (999 for 0.999), the e_beta terms below.
    e_beta1, e_beta2 = 2.0 ** -24 * b1 * g_mag, 2.0 ** -24 * b2 * g_mag * g_mag
    e_m = u * (b1 * m.abs() + (1 - b1) * g_mag) + e_beta1
    e_v = u * (b2 * v.abs() + 3 * (1 - b2) * g_mag * g_mag) + e_beta2  # squaring doubles g_eff's relative error
    root = v1.sqrt() / (1 - b2 ** step) ** 0.5
    d = root + eps
    rel_d = (root * e_v / (2 * v1) + u * d) / d
    size = lr / (1 - b1 ** step)
    upd = size * m1 / d
    e_upd = size * e_m / d + upd.abs() * (rel_d + u + rel_scalars)
    e_p = u * (p.abs() + upd.abs()) + e_upd
    return e_p, e_m, e_v


@needs_triton
@pytest.mark.gpu
@requires_cuda
def test_gpu_sumsq_and_scale_cast():
    assert _dispatch.choose("api", "auto", torch.device("cuda")) == "triton"
    units = [u.cuda() for u in _units(torch.Generator().manual_seed(0))] + [torch.randn(5_000_000, device="cuda")]
    exact = torch.stack([g.double().square().sum() for g in units]).float()
    for impl in ("triton", "torch"):
        sumsq, flag = ops.grad_sumsq(units, impl=impl)
        torch.testing.assert_close(sumsq, exact, rtol=1e-5, atol=0)
        assert flag.tolist() == [0.0]
    again = ops.grad_sumsq(units, impl="triton").sumsq
    assert_bitwise(again, ops.grad_sumsq(units, impl="triton").sumsq)  # no atomics: the same bits every run
    grad = torch.randn(N, device="cuda") * 1e3
    for dtype in GRAD_DTYPES:
        assert_bitwise(ops.scale_cast(grad, 1 / 3, dtype, impl="triton"), ops.scale_cast(grad, 1 / 3, dtype, impl="torch"))


@needs_triton
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("triton_from", [0, None])
def test_gpu_fused_step_uses_triton_and_agrees_with_torch(monkeypatch, triton_from):
    # fzero.optim.apply_inplace on CUDA fp32 leaves. From TRITON_MIN_ELEMENTS (here 0): fzero.ops' kernel, within a
    # few ulps of torch's fused CUDA kernel after 5 steps (1 ulp per step at most in rare elements, which Adam's
    # normalisation can grow). Below it (the default for this size): torch's kernel itself, so bit for bit.
    if triton_from is not None:
        monkeypatch.setattr(_fused, "TRITON_MIN_ELEMENTS", triton_from)
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(N, generator=gen).cuda()}
    theirs = [params["w"].clone(), torch.zeros_like(params["w"]), torch.zeros_like(params["w"])]
    opt = fzero.optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)
    for step in range(1, 6):
        grads = {"w": torch.randn(N, generator=gen).cuda()}
        state = fzero.optim.apply_inplace(opt, grads, state, params)
        torch._fused_adamw_([theirs[0]], [grads["w"]], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step), device="cuda")],
                            lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
    if triton_from is None:
        assert_bitwise(params["w"], theirs[0])
    else:
        torch.testing.assert_close(params["w"], theirs[0], rtol=0, atol=1e-6 * theirs[0].abs().max().item())


@pytest.mark.gpu
@requires_cuda
def test_gpu_adamw_gbps():
    impls = ["torch_fused"] + (["triton"] if ops.triton_available() else [])
    for impl in impls:
        assert adamw_gbps(1 << 24, device="cuda", impl=impl, repeats=3) > 0
