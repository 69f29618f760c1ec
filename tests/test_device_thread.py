"""A step's backward where autograd runs it on a GPU: in its own device thread, which has no fzero context.

On CUDA, autograd runs the backward of device operations in one thread per device for the whole process, not in
the thread that called it. A recompute there (``fzero.remat``, or the model's own ``torch.utils.checkpoint``) of a
stage-3 unit found no context, so it noted no gradient for the unit's params: they skipped every update, silently
(found on an H200: the optimizer put back the whole model's masters and moments every step, a 12 B/param host
transient). On the CPU the backward runs in the calling thread, so the CPU twin makes that thread look like the
device thread for the length of the backward: the loss's hook takes the thread's context away, and the end of the
backward gives it back. The thread's dispatch modes stay, as in the device thread, which runs each node under the
thread-local state the backward began with (``at::ThreadLocalState``). Only one rank's backward runs there on a GPU
(``local_mesh(1)``, ``dist_mesh``): a rank thread of ``local_mesh(n)`` runs its own; the twins of several ranks keep
the lent context consistent with what the borrowing thread runs under.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fzero
from fzero.mesh import _rank


def _backward_without_the_threads_context(loss: torch.Tensor) -> torch.Tensor:
    """``loss``, whose backward runs (after its first node) in a thread without fzero's context, as a CUDA backward
    runs in autograd's device thread."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        saved = _rank._local.__dict__.pop("context", None)  # (None: taken already, FZERO_DEVICE_THREAD_TWIN)

        def give_back() -> None:
            _rank._local.context = saved

        if saved is not None:
            torch.autograd.Variable._execution_engine.queue_callback(give_back)
        return grad

    loss.register_hook(hook)
    return loss


class _Net(torch.nn.Module):
    """Three blocks and a head; ``checkpointed``: each block through torch.utils.checkpoint (non-reentrant), as
    Hugging Face's ``gradient_checkpointing_enable()`` runs its layers."""

    def __init__(self, d: int = 8, *, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh()) for _ in range(3)])
        self.head = torch.nn.Linear(d, 3)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def _batches(device: str) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=gen).to(device), torch.randint(0, 3, (4,), generator=gen).to(device))
            for _ in range(3)]


def _assert_trains_as_pytorch(device: str, *, checkpointed: bool, remat: bool, offload: str | None, stages: int,
                              ranks: int) -> None:
    """Params after 3 AdamW steps against PyTorch's (on ``ranks`` ranks each takes half the batch: DDP's mean of
    the halves' mean losses is the whole batch's mean, so PyTorch on the whole batch is the reference)."""
    torch.manual_seed(0)
    model = _Net(checkpointed=checkpointed).to(device)
    ref = _Net(checkpointed=checkpointed).to(device)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in _batches(device):
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()

    def loss_fn(params, batch):
        loss = F.cross_entropy(fzero.apply(model, params, batch[0]), batch[1])
        return _backward_without_the_threads_context(loss) if device == "cpu" else loss

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=stages, remat=remat, offload=offload,
                         mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    for batch in _batches(device):
        state, _ = step(state, batch)
    got = step.gather(state)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].to(device), p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


_CASES = [  # (checkpointed, remat, offload, stages, ranks)
    pytest.param(False, True, None, 3, 1, id="remat-stage3"),
    pytest.param(False, True, "cpu", 3, 1, id="remat-stage3-offload"),
    pytest.param(False, True, None, 3, 2, id="remat-stage3-two-ranks"),
    pytest.param(False, True, None, 0, 1, id="remat-stage0"),
    pytest.param(True, False, None, 3, 1, id="checkpoint-stage3"),
    pytest.param(True, False, "cpu", 3, 1, id="checkpoint-stage3-offload"),
]


@pytest.mark.parametrize("checkpointed,remat,offload,stages,ranks", _CASES)
def test_a_recompute_in_a_thread_without_the_steps_context_trains_as_pytorch(checkpointed, remat, offload, stages, ranks):
    """The CPU twin: the backward after its first node runs in a thread without the step's context, as on a GPU."""
    _assert_trains_as_pytorch("cpu", checkpointed=checkpointed, remat=remat, offload=offload, stages=stages, ranks=ranks)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checkpointed,remat,offload,stages,ranks", _CASES)
def test_on_a_gpu_a_recompute_in_autograds_device_thread_trains_as_pytorch(checkpointed, remat, offload, stages, ranks):
    _assert_trains_as_pytorch("cuda", checkpointed=checkpointed, remat=remat, offload=offload, stages=stages, ranks=ranks)


def test_the_device_threads_context_is_the_steps_only_while_its_backward_runs():
    """What a thread without a context of its own reads: the step's context inside the step's backward, and the
    empty one after it (the task's note is forgotten) and in any other backward."""
    seen = []

    def loss_fn(params, batch):
        def hook(grad):
            seen.append(("in the step's backward", _rank.current_context().usage is not None))
            return grad

        loss = _backward_without_the_threads_context(F.cross_entropy(fzero.apply(model, params, batch[0]), batch[1]))
        loss.register_hook(hook)  # after the context was taken away
        return loss

    model = _Net()
    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=3)
    state = step.init(fzero.params_of(model))
    step(state, _batches("cpu")[0])
    assert _rank._TASKS == {}
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()

    def other(grad):
        saved = _rank._local.__dict__.pop("context", None)
        seen.append(("in another backward", _rank.current_context() is _rank._EMPTY))
        if saved is not None:
            _rank._local.context = saved
        return grad

    y.register_hook(other)
    y.backward()
    assert seen == [("in the step's backward", True), ("in another backward", True)]


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
@pytest.mark.parametrize("stages", [0, 3])
def test_no_backward_is_remembered_after_its_step(autodiff, stages):
    """The tasks a step's backward noted are forgotten when its gradient is taken, under torch.func too (whose
    rebuilt list arguments once kept every step's context, its module clones among it, for the process's life)."""
    model = _Net()
    step = fzero.compile(lambda p, b: F.cross_entropy(fzero.apply(model, p, b[0]), b[1]), optimizer=fzero.optim.adamw(1e-2),
                         stages=stages, autodiff=autodiff, remat=True)
    state = step.init(fzero.params_of(model))
    for batch in _batches("cpu")[:2]:
        state, _ = step(state, batch)
    assert _rank._TASKS == {}


def test_a_backward_that_loss_fn_runs_itself_counts_its_buffers_in_a_thread_without_a_context():
    """An adversarial input's gradient (``torch.autograd.grad`` inside ``loss_fn``) is a backward no step noted; on a
    GPU its device-thread part found no context, so the units it gathered again went unseen by ``fzero.memory``'s
    counters (before: ``GatheredBytes.peak`` 768 against 2304 where that backward ran in the rank's thread) and
    outside the step's pool. fzero's Functions run their backward in their forward's context there; params and
    counts are those of a backward run in the rank's thread."""
    from fzero.memory import GatheredBytes

    def run(without_context: bool):
        torch.manual_seed(0)
        model = _Net()

        def loss_fn(params, batch):
            x = batch[0].clone().requires_grad_(True)
            inner = F.cross_entropy(fzero.apply(model, params, x), batch[1])
            gx, = torch.autograd.grad(_backward_without_the_threads_context(inner) if without_context else inner, x)
            return F.cross_entropy(fzero.apply(model, params, (x + 0.1 * gx).detach()), batch[1])

        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=3)
        state = step.init(fzero.params_of(model))
        batches = _batches("cpu")
        state, _ = step(state, batches[0])
        with GatheredBytes() as gathered:
            state, _ = step(state, batches[1])
        return gathered.peak, step.gather(state)

    (peak, params), (expected_peak, expected) = run(True), run(False)
    assert peak == expected_peak > 0
    for name, value in expected.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _dropped_blocks() -> torch.nn.Module:
    import zoo

    return zoo.TokenModel(zoo.Blocks(block=lambda d: torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU(),
                                                                         torch.nn.Dropout(0.2))))


def _recomputes_with_dropout():
    """Two zoo-style entries whose backward draws dropout masks again: the model's own torch.utils.checkpoint around
    each block (``user_checkpoint``, dropout inside the checkpointed function), and fzero's remat of units with
    dropout inside them."""
    import zoo

    remat = zoo.Entry(zoo._seeded(_dropped_blocks), zoo._tokens(64, seed=30), zoo._lm_loss, settings={"remat": True})
    return {"checkpoint": zoo.ZOO["user_checkpoint"], "remat": remat}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("recompute,stages", [("checkpoint", 0), ("checkpoint", 3), ("remat", 3)])
def test_a_ranks_recompute_in_a_thread_without_its_context_draws_the_forwards_masks(recompute, stages):
    """A rank of ``local_mesh(2)`` whose backward runs in a thread without its context: autograd runs every node
    there under the thread-local state the backward began with (``at::ThreadLocalState``, dispatch modes among it),
    so the rank's ``own_stream`` mode is active there and draws from the rank's stream. The context that thread
    borrows must name the same stream: lent without it, the recompute set torch's global generator to the forward's
    state (``fzero.mesh.rng.replay``; ``torch.utils.checkpoint`` through ``torch.set_rng_state``) and then drew from
    the rank's stream as it stood, another dropout mask (2.0e-3 off DDP after one AdamW step, silently). On a GPU a rank
    thread of ``local_mesh(n)`` runs its whole backward itself (``set_multithreading_enabled(False)``,
    ``test_a_rank_thread_runs_its_whole_backward_itself``), so this is the borrowed context kept consistent with
    what the borrowing thread runs under, not a path a GPU takes today."""
    import dataclasses

    import zoo

    entry = _recomputes_with_dropout()[recompute]
    simulated = dataclasses.replace(
        entry, loss=lambda call, b: _backward_without_the_threads_context(entry.loss(call, b)))
    zoo.check(simulated, zoo.reference_run(entry, 2), zoo.fzero_run(simulated, stages=stages, ranks=2))


def test_a_rank_thread_runs_its_whole_backward_itself():
    """The premise of lending the context by graph task only where one rank runs: a rank thread of ``local_mesh(n)``
    keeps autograd from handing its backward to the device thread (``fzero/mesh/_mesh.py``), where a rank's collective
    would block the other ranks' backwards; a single rank (and ``dist_mesh``) leaves it on, as plain PyTorch does."""
    seen = {}
    model = _Net()

    def loss_fn(params, batch):
        seen[threading.current_thread().name] = torch.autograd.is_multithreading_enabled()
        return F.cross_entropy(fzero.apply(model, params, batch[0]), batch[1])

    caller = threading.current_thread().name
    for ranks, expected in ((2, {"fzero-rank0": False, "fzero-rank1": False}), (1, {caller: True})):
        step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, mesh=fzero.local_mesh(ranks))
        step(step.init(fzero.params_of(model)), _batches("cpu")[0])
        assert seen == expected, ranks
        seen.clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_backward_runs_where_the_cpu_twins_say():
    """What the CPU twins stand for, on CUDA: plain autograd runs a CUDA backward in another thread, under the calling
    thread's dispatch modes; a single rank's backward runs there too (the thread borrows the step's context), and a
    rank of ``local_mesh(2)`` runs its own in its own thread."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    got = {}

    def note(grad):
        got["thread"] = threading.get_ident()
        got["modes"] = [type(m) for m in _get_current_dispatch_mode_stack()]
        return grad

    x = torch.ones(4, device="cuda", requires_grad=True)
    with Passing():
        y = (x * 2).sum()
        y.register_hook(note)
        y.backward()
    assert got["thread"] != threading.get_ident() and Passing in got["modes"], got

    model = _Net().cuda()
    for ranks in (1, 2):
        threads = {}

        def loss_fn(params, batch):
            loss = F.cross_entropy(fzero.apply(model, params, batch[0]), batch[1])
            mine = threading.get_ident()

            def hook(grad):
                threads[mine] = (threading.get_ident(), _rank.current_context().usage is not None)
                return grad

            loss.register_hook(hook)
            return loss

        step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, mesh=fzero.local_mesh(ranks))
        step(step.init(fzero.params_of(model)), _batches("cuda")[0])
        assert len(threads) == ranks and all(found for _, found in threads.values()), threads
        assert all((ran != mine) == (ranks == 1) for mine, (ran, _) in threads.items()), (ranks, threads)
