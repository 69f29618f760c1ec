"""The gradient of one micro-batch: ``loss_fn`` differentiated with respect to the flat unit inputs,
by ``torch.func.grad`` or plain autograd, with the loss and aux it returned."""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch


def gradient(loss_fn: Callable, as_params: Callable, inputs: list[torch.Tensor], batch: Any, scale: float, autodiff: str):
    """Gradient of ``loss_fn(as_params(inputs), batch) * scale`` with respect to ``inputs``; and the loss, aux.

    By ``torch.func.grad`` or by plain ``torch.autograd.grad`` on leaf aliases of ``inputs``. torch.func
    unwraps only tensors out of aux, so the non-tensor leaves of aux are kept aside and put back.
    """
    box: dict[str, Any] = {}

    def objective(xs):
        loss, aux = split_loss(loss_fn(as_params(xs), batch))
        leaves, box["spec"] = optree.tree_flatten(aux)
        box["leaves"] = leaves
        scaled = loss if scale == 1.0 else loss.float() * scale  # fp16: the loss scale, in fp32
        return scaled, (loss, [x for x in leaves if isinstance(x, torch.Tensor)])

    if autodiff == "func":
        grads, (loss, tensors) = torch.func.grad(objective, has_aux=True)(inputs)
    else:
        leaves = [x.detach().requires_grad_() for x in inputs]  # aliases of the state's buffers, as leaves
        with torch.enable_grad():
            scaled, (loss, tensors) = objective(leaves)
            grads = list(torch.autograd.grad(scaled, leaves, allow_unused=True, materialize_grads=True))
        loss, tensors = loss.detach(), [t.detach() for t in tensors]
    it = iter(tensors)
    aux = box["spec"].unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in box["leaves"]])
    return grads, loss, aux


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
