"""What the caller's thread brings to a step, and several steps in one process: what it changes is what it changes in
plain PyTorch, and nothing is silently dropped or applied twice.

Found by a sweep of fzero objects sharing one module or one process (notebooks, tests):

* ``torch.no_grad()`` around ``step(...)``: stages 0-1 updated no param (their gradient hooks read the caller's grad
  mode and recorded every param as unused; only a ``ZeroGradientWarning``) while stages 2-3 trained; under
  ``torch.inference_mode()`` every stage did nothing or raised torch's error on an inference tensor. A step takes its
  gradient whatever the caller's mode now, as ``torch.func.grad`` ignores an outer ``no_grad``.
* ``torch.autocast`` around ``step(...)``: honoured on one rank (the same params as PyTorch's autocast training), but
  autocast is thread-local and a ``local_mesh(2)``'s rank threads ran in fp32. They run under the caller's now.
* A Ctrl-C while a ``local_mesh(2)`` step ran: the caller got its ``KeyboardInterrupt`` while the rank threads went on
  with the state; the state was accepted again, and the abandoned threads then updated its buffers under the new
  step's result (one lr off, silently). The ranks are stopped at their next collective and waited for now.
* One state given to two steps at once (two threads; a step called in a ``loss_fn`` that every rank thread runs): both
  were accepted and each updated the one set of buffers (both results one lr off). The second is refused now.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import fzero
from fzero.models import GPT, GPTConfig, gpt_loss


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny())


def _batches(n=2):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        out.append({"x": x, "y": x.roll(-1, 1)})
    return out


def _step(model, **kw):
    def loss_fn(params, batch):
        return gpt_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    return fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), **kw)


def _trained(model, batches, context=None, **kw):
    step = _step(model, **kw)
    state = step.init(fzero.params_of(model))
    for b in batches:
        if context is None:
            state, _ = step(state, b)
        else:
            with context():
                state, _ = step(state, b)
    return step.gather(state)


def _equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("settings", [dict(stages=0), dict(stages=1, remat=True), dict(stages=3),
                                      dict(stages=3, mesh=fzero.local_mesh(2))], ids=["s0", "s1-remat", "s3", "s3-2ranks"])
def test_a_step_under_no_grad_or_inference_mode_trains_as_outside_it(context, settings):
    model, batches = _model(), _batches()
    outside = _trained(model, batches, **settings)
    inside = _trained(model, batches, context=getattr(torch, context), **settings)
    assert _equal(inside, outside)
    assert torch.is_grad_enabled()


def test_autocast_around_a_step_reaches_the_rank_threads_of_a_local_mesh():
    model, batches = _model(), _batches(1)
    seen = []
    hook = model.blocks[0].mlp.up.register_forward_hook(lambda m, a, out: seen.append((threading.current_thread().name, out.dtype)))
    try:
        for mesh in (None, fzero.local_mesh(2)):
            seen.clear()
            step = _step(model, stages=3, mesh=mesh)
            state = step.init(fzero.params_of(model))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                state, _ = step(state, batches[0])
                step.evaluate(state, batches[0])
            assert seen and all(dtype == torch.bfloat16 for _, dtype in seen), (mesh, seen)
            if mesh is not None:
                assert {name for name, _ in seen} == {"fzero-rank0", "fzero-rank1"}
    finally:
        hook.remove()


@pytest.mark.parametrize("stages", [0, 3])
def test_a_ctrl_c_in_the_caller_stops_the_rank_threads_before_it_is_raised(stages):
    """SIGINT to the main thread while it waits for the ranks of a local_mesh(2) step (a real Ctrl-C)."""
    model, batches = _model(), _batches(3)
    mesh = fzero.local_mesh(2, timeout=30)
    expected = _trained(model, batches[:2], stages=stages, mesh=mesh)
    slow = {"on": False}
    hook = model.blocks[0].register_forward_hook(lambda m, a, out: time.sleep(1.0) if slow["on"] else None)
    try:
        step = _step(model, stages=stages, mesh=mesh)
        state = step.init(fzero.params_of(model))
        state, _ = step(state, batches[0])
        slow["on"] = True
        timer = threading.Timer(0.3, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            step(state, batches[1])
        timer.join()
        slow["on"] = False
        # no rank thread goes on with the state after the caller has it back
        assert not [t.name for t in threading.enumerate() if t.name.startswith("fzero-rank")]
        state, _ = step(state, batches[1])  # interrupted in its forward, before any update: still whole
        right_after = step.gather(state)
        time.sleep(1.5)  # (before: the abandoned threads' update landed in the returned state about now)
        assert _equal(right_after, expected)
        assert _equal(step.gather(state), expected)
    finally:
        hook.remove()


@pytest.mark.parametrize("stages", [0, 3])
def test_one_state_given_to_two_steps_at_once_is_refused(stages):
    model, batches = _model(), _batches(1)
    hook = model.blocks[0].register_forward_hook(lambda m, a, out: time.sleep(0.3))
    try:
        step = _step(model, stages=stages)
        state = step.init(fzero.params_of(model))
        out = {}

        def run(k):
            try:
                out[k] = step(state, batches[0])
            except ValueError as e:
                out[k] = e

        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        errors = [v for v in out.values() if isinstance(v, ValueError)]
        results = [v for v in out.values() if isinstance(v, tuple)]
        assert len(errors) == 1 and len(results) == 1, out
        assert "another thread" in str(errors[0]) or "already passed to a step" in str(errors[0])
    finally:
        hook.remove()
    assert _equal(step.gather(results[0][0]), _trained(model, batches, stages=stages))
    with pytest.raises(ValueError, match="already passed to a step"):
        step(state, batches[0])
