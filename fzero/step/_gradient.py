"""The gradient of one micro-batch: ``loss_fn`` differentiated with respect to the flat unit inputs,
by ``torch.func.grad`` or plain autograd, with the loss and aux it returned and the buffers its forward
left (see ``fzero.step._buffers``)."""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from fzero.step._buffers import Buffers, lift_for
from fzero.step._context import step_buffers, step_scope


def gradient(loss_fn: Callable, as_params: Callable, inputs: list[torch.Tensor], batch: Any, scale: float, autodiff: str,
             buffers: dict[str, torch.Tensor], dtype: torch.dtype | None = None, into: Callable | None = None):
    """Gradient of ``loss_fn(as_params(inputs), batch) * scale`` with respect to ``inputs``; and the loss, aux
    and the buffers after the forward (``buffers``: their values before it, never written; ``dtype``: the
    compute dtype floating buffers meet the params in; ``into``: under plain autograd, a function that gives the
    leaves ``.grad`` buffers to accumulate into, in place, returning True if it did: see
    ``fzero.step._parts.ParamView``).

    By ``torch.func.grad`` or by plain ``torch.autograd.grad`` on leaf aliases of ``inputs``. torch.func
    unwraps only tensors out of aux, so the non-tensor leaves of aux are kept aside and put back.
    """
    box: dict[str, Any] = {}

    def objective(xs):
        bank = Buffers(buffers, lift=lift_for(autodiff, xs[0].detach() if xs else None), dtype=dtype)
        with step_buffers(bank):
            loss, aux = split_loss(loss_fn(as_params(xs), batch))
        leaves, box["spec"] = optree.tree_flatten(aux)
        box["leaves"] = leaves
        scaled = loss if scale == 1.0 else loss.float() * scale  # fp16: the loss scale, in fp32
        return scaled, (loss, [x for x in leaves if isinstance(x, torch.Tensor)], bank.result())

    if autodiff == "func":
        try:
            with step_scope():
                grads, (loss, tensors, new_buffers) = torch.func.grad(objective, has_aux=True)(inputs)
        except RuntimeError as e:
            if any(m in str(e) for m in _FUNC_REFUSALS):
                raise RuntimeError(_FUNC_HINT.format(error=str(e).splitlines()[0])) from e
            raise
    else:
        leaves = [x.detach().requires_grad_() for x in inputs]  # aliases of the state's buffers, as leaves
        in_place = into is not None and into(leaves)
        with torch.enable_grad(), step_scope():  # modules keep their params until backward is done (checkpoint)
            scaled, (loss, tensors, new_buffers) = objective(leaves)
            if in_place:  # each param's gradient added to its .grad as soon as it exists, then freed
                if scaled.requires_grad:
                    torch.autograd.backward(scaled, inputs=leaves)
                grads = [leaf.grad for leaf in leaves]
            elif scaled.requires_grad:
                grads = list(torch.autograd.grad(scaled, leaves, allow_unused=True, materialize_grads=True))
            else:  # a loss that does not depend on the params: a zero gradient, as torch.func.grad gives
                grads = [torch.zeros_like(x) for x in leaves]
            del leaves
        loss, tensors = loss.detach(), [t.detach() for t in tensors]
        new_buffers = {k: v.detach() for k, v in new_buffers.items()}
    it = iter(tensors)
    aux = box["spec"].unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in box["leaves"]])
    return grads, loss, aux, new_buffers


# What torch.func.grad says when the model does what only plain autograd supports: torch.utils.checkpoint's
# saved-tensor hooks, requires_grad_() inside the transform (Hugging Face's enable_input_require_grads hook).
_FUNC_REFUSALS = ("functorch transform", "saved tensor hooks", "saved_tensors_hooks", "torch.func transforms don't yet support")
_FUNC_HINT = """fzero.Step (autodiff="func"): torch.func.grad refused what the model does in its forward: {error}
This is what a model with torch.utils.checkpoint inside it does (Hugging Face's gradient_checkpointing_enable() /
activation_checkpointing_enable(), or requires_grad_() on an activation). Build the step with plain autograd, which
supports it: fzero.compile(..., autodiff="autograd"); or turn the model's checkpointing off and recompute with
fzero's own (fzero.remat at stages 0-2, compile(..., stages=3, remat=True))."""


def split_loss(out: Any) -> tuple[torch.Tensor, Any]:
    loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"fzero.train_step: loss_fn must return a scalar tensor or a (loss, aux) pair; got {type(out).__name__}. "
            f"Return e.g. F.cross_entropy(logits, y), or (loss, {{'acc': acc}})."
        )
    if loss.dim() != 0 or not loss.is_floating_point():
        raise ValueError(
            f"fzero.train_step: loss_fn must return a 0-d floating-point loss; got a {loss.dtype} tensor of shape "
            f"{tuple(loss.shape)}. Reduce it to a scalar, e.g. loss.mean()."
        )
    return loss, aux
