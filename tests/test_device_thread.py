"""A step's backward where autograd runs it on a GPU: in its own device thread, which has no fzero context.

On CUDA, autograd runs the backward of device operations in one thread per device for the whole process, not in
the thread that called it. A recompute there (``fzero.remat``, or the model's own ``torch.utils.checkpoint``) of a
stage-3 unit found no context, so it noted no gradient for the unit's params: they skipped every update, silently
(found on an H200: the optimizer put back the whole model's masters and moments every step, a 12 B/param host
transient). On the CPU the backward runs in the calling thread, so the CPU twin makes that thread look like the
device thread for the length of the backward: the loss's hook takes the thread's context away, and the end of the
backward gives it back.
"""

from __future__ import annotations

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
