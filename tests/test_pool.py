"""The step's pool of host buffers (issue 15, ``fzero.step._pool``): memory reused across units and steps, never values.

A step lends itself its units' flat gradients, the reduce-scattered shards and (stage 3) the gathered units'
memory, and gets them back when their use is over. What must hold: the same bits as without the pool, no
buffer lent while anything still refers to it, no fresh unit-sized allocation in a step once the pool has
them, and a pool that does not grow from step to step.
"""

import collections

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
import fzero.step._pool as pool_module
import fzero.step._step as step_module
from fzero.step._pool import Pool, alloc_memory, can_move, free_memory
from fzero.testing import assert_trees_equal
from problems import PROBLEMS, fzero_run


# -- the pool itself ---------------------------------------------------------------------------------------


def test_a_given_buffer_is_lent_again():
    pool = Pool()
    a = pool.take(1000, dtype=torch.float32, device="cpu")
    ptr = a.data_ptr()
    pool.give(a)
    del a
    assert pool.held_bytes == 4000
    b = pool.take(1000, dtype=torch.float32, device="cpu")
    assert b.data_ptr() == ptr and pool.held_bytes == 0
    c = pool.take(1000, dtype=torch.float32, device="cpu")  # nothing free: a new one
    assert c.data_ptr() != ptr
    pool.give(b)
    pool.give(c)
    assert pool.held_bytes == 8000
    pool.clear()
    assert pool.held_bytes == 0


def test_a_buffer_something_still_holds_is_never_lent_again():
    pool = Pool()
    for keep in (lambda t: t[10:20], lambda t: t, lambda t: t.view(10, 100)):  # a view, the taker's tensor, a reshape
        a = pool.take(1000, dtype=torch.float32, device="cpu")
        a.fill_(7.0)
        held = keep(a)
        pool.give(a)
        del a
        b = pool.take(1000, dtype=torch.float32, device="cpu")
        b.fill_(-1.0)  # had the pool lent the same memory, ``held`` would read -1
        assert bool((held == 7.0).all())
        del held, b
        pool = Pool()


def test_only_its_own_whole_buffers_come_back():
    pool = Pool()
    pool.give(torch.empty(100))  # never lent
    a = pool.take(100, dtype=torch.float32, device="cpu")
    pool.give(a[:50])  # a view of a loan
    assert pool.held_bytes == 0
    pool.give(a)
    assert pool.held_bytes == 400
    assert pool.take(100, dtype=torch.float64, device="cpu").dtype == torch.float64  # by dtype too
    assert pool.held_bytes == 400


NO_SWAP = "this torch has no UntypedStorage._swap_data_ptr_ (torch 2.11 has none): memory cannot move between buffers"


@pytest.mark.skipif(not pool_module._SWAP, reason=NO_SWAP)
def test_memory_moves_into_a_freed_buffer_and_back_without_a_write():
    # stage 3: a gathered unit's memory goes to the pool between forward and backward; the graph's views stay
    pool = Pool()
    full = pool.take(64, dtype=torch.float32, device="cpu")
    full.copy_(torch.arange(64.0))
    view = full[8:16]
    version = full._version
    assert can_move(pool, full)
    free_memory(pool, full)
    assert full.untyped_storage().nbytes() == 0 and pool.held_bytes == 256
    alloc_memory(pool, full)
    assert full.untyped_storage().nbytes() == 256 and pool.held_bytes == 0
    full.copy_(torch.arange(64.0))
    assert torch.equal(view, torch.arange(8.0, 16.0)) and view._version == version + 1  # only our own copy counted


def test_without_swap_a_freed_buffer_is_resized_and_the_pool_is_not_used(monkeypatch):
    # where torch cannot swap storages' memory (torch 2.11), free and alloc fall back to resize_: the same views,
    # the pool untouched; the buffer's contents are undefined after alloc, as after a swap
    monkeypatch.setattr(pool_module, "_SWAP", False)
    pool = Pool()
    full = pool.take(64, dtype=torch.float32, device="cpu")
    view = full[8:16]
    assert not can_move(pool, full)
    free_memory(pool, full)
    assert full.untyped_storage().nbytes() == 0 and pool.held_bytes == 0
    alloc_memory(pool, full)
    assert full.untyped_storage().nbytes() == 256 and pool.held_bytes == 0
    full.copy_(torch.arange(64.0))
    assert torch.equal(view, torch.arange(8.0, 16.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_buffers_are_left_to_the_caching_allocator():
    pool = Pool()
    a = pool.take(100, dtype=torch.float32, device="cuda")
    pool.give(a)
    assert a.is_cuda and pool.held_bytes == 0


# -- in a step -----------------------------------------------------------------------------------------------


def _without_pool(monkeypatch):
    monkeypatch.setattr(step_module.Step, "pool", property(lambda self: None))


@pytest.mark.parametrize("problem", ["mlp", "gpt"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_a_pooled_step_equals_one_without_the_pool_bitwise(monkeypatch, problem, stages):
    prob = PROBLEMS[problem]()
    pooled, m_pooled = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), grad_accum=2)
    _without_pool(monkeypatch)
    plain, m_plain = fzero_run(prob, stages=stages, mesh=fzero.local_mesh(2), grad_accum=2)
    for a, b in zip(pooled, plain):
        assert_trees_equal(a, b)
    assert [m["grad_norm"] for m in m_pooled] == [m["grad_norm"] for m in m_plain]


class _UnitSizedAllocations(TorchDispatchMode):
    """New storages of at least ``least`` bytes, by op."""

    def __init__(self, least: int) -> None:
        super().__init__()
        self.least = least
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().nbytes() >= self.least \
                    and t.untyped_storage().data_ptr() not in ins:
                self.by_op[str(func)] += 1
        return out


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_after_the_first_step_no_unit_sized_buffer_is_allocated(stages):
    # an MLP whose layers (the units) are much larger than its activations: a unit-sized allocation is a buffer
    if stages == 3 and not pool_module._SWAP:
        pytest.skip(NO_SWAP + "; stage 3 frees a gathered unit with resize_ and allocates it again")
    width = 256
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    unit = width * width + width

    def loss_fn(params, batch):
        return fzero.apply(model, params, batch).square().mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=stages, mesh=fzero.local_mesh(1),
                         **({"unit_elements": unit} if stages < 2 else {}))
    state = step.init(fzero.params_of(model))
    x = torch.randn(2, width)
    for _ in range(2):
        state, _ = step(state, x)
    held = step.pool.held_bytes
    seen = _UnitSizedAllocations(least=unit * 4 // 2)  # a whole unit, or a shard of one (there is one rank here)
    with seen:
        state, _ = step(state, x)
    # what is left: the per-parameter weight gradients autograd makes (as in plain PyTorch), nothing of fzero's
    assert set(seen.by_op) <= {"aten.mm.default"}, seen.by_op
    assert step.pool.held_bytes == held  # the pool does not grow from step to step


def test_a_pool_holds_at_most_what_a_step_used_at_once():
    # stage 2 on two simulated ranks: the pool keeps the shards (one unit's half each) and the flat gradients of
    # at most two units (the one in flight and the next); nothing grows with the steps
    prob = PROBLEMS["mlp"](steps=6)
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=2, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    held = []
    for b in prob.batches:
        state, _ = step(state, b)
        held.append(step.pool.held_bytes)
    units = state[0].meta.layout.units
    shards = sum(u.padded // 2 for u in units) * 4
    largest = max(u.padded for u in units) * 4
    # a bucket: units until BUCKET_ELEMENTS is reached; its units' gradients and their interleaved copy, and the
    # bucket in flight before it
    bucket = largest  # one unit per bucket (the default)
    assert held[2:] == held[2:3] * (len(held) - 2)  # its size is reached within two steps, then kept
    assert 0 < held[-1] <= 2 * (shards + 3 * bucket)  # two ranks


@pytest.mark.parametrize("settings", [
    {"stages": 2, "grad_accum": 2},
    {"stages": 3, "grad_accum": 2, "ranks": 2},
    {"stages": 3, "remat": True},
    {"stages": 3, "remat": True, "grad_accum": 2, "ranks": 2},
    {"stages": 2, "grad_accum": 2, "bucket_elements": 5000, "ranks": 2},
    {"stages": 3, "offload": "cpu", "grad_accum": 2, "clip_grad_norm": 1.0, "ranks": 2},
    {"stages": 0, "precision": "bf16", "ranks": 2},
    {"stages": 1, "precision": "bf16", "grad_accum": 2, "ranks": 2},
    {"stages": 2, "precision": "fp16", "ranks": 2},
    {"stages": 3, "precision": "bf16", "grad_accum": 2, "ranks": 2},
], ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "resize"])
def test_every_loan_ends_within_its_step(settings, swap, monkeypatch):
    """A buffer a step takes is given back or forgotten by the end of the step. The pool's record of loans grew every
    step where one was not: each micro-batch after the first (its gradients were added and dropped), every gather of
    a remat unit, every reduced bucket of several units (about 2 KB a step for a 12-block model under remat, for as
    long as training ran). ``resize``: a torch without ``UntypedStorage._swap_data_ptr_`` (2.11 has none), where stage 3
    frees a gathered unit with ``resize_(0)``: its buffer never comes back either (found on an H200 with torch 2.11).
    ``precision``: a reduced bf16/fp16 gradient the update casts to fp32 was dropped without ending its loan (about 3
    records a step at stage 3 on 2 ranks, 3557 after 800 steps: a few hundred MB of records over 10**6 steps)."""
    if not swap:
        monkeypatch.setattr(pool_module, "_SWAP", False)
    elif not pool_module._SWAP:
        pytest.skip(NO_SWAP)
    settings = dict(settings)
    ranks = settings.pop("ranks", 1)
    prob = PROBLEMS["mlp"](steps=6)
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), mesh=fzero.local_mesh(ranks), **settings)
    state = step.init(fzero.params_of(prob.model))
    loans = []
    for b in prob.batches:
        state, _ = step(state, b)
        loans.append(step.pool.loans)
    assert loans == [0] * len(loans), loans


@pytest.mark.parametrize("case", ["whole", "transposed", "padding", "missing", "scalar", "bf16"])
def test_a_units_flat_gradient_is_each_gradient_in_its_place_and_zeros_elsewhere(case):
    """``join`` (a unit's backward: its params' gradients into one pooled flat buffer) equals ``torch.cat`` of the
    flattened gradients, with zeros for a param that got none and for the padding, whichever path it takes: one
    ``torch._chunk_cat`` when every param has a gradient, or piece by piece. The pool's buffer is reused, so its old
    contents (NaN here) must never show through."""
    from fzero.step._context import join

    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    shapes = [(3, 5), (5,), (2, 4)] if case != "scalar" else [(3, 5), (), (2, 4)]
    grads = [torch.randn(s).to(dtype) for s in shapes]
    if case == "transposed":
        grads[0] = torch.randn(5, 3).t()  # a transposed weight's gradient: not contiguous
    if case == "missing":
        grads[1] = None
    sizes = tuple(max(1, torch.Size(s).numel()) for s in shapes) + ((3,) if case == "padding" else ())
    pool = Pool()
    old = pool.take(sum(sizes), dtype=dtype, device=torch.device("cpu"))
    old.fill_(float("nan"))
    pool.give(old)
    address = old.data_ptr()
    del old  # held here, the pool would never lend it again
    used = [False] * len(shapes)
    flat = join(tuple(grads), sizes, used, (dtype, torch.device("cpu")), pool=pool)
    assert flat.data_ptr() == address  # the pool's buffer, written over
    want = torch.cat([torch.zeros(n, dtype=dtype) if g is None else g.reshape(-1) for g, n in zip(grads + [None], sizes)])
    assert torch.equal(flat, want)
    assert used == [g is not None for g in grads]
