"""What a reentrant ``torch.utils.checkpoint`` does to a step, and how a step tells it from a param that is unused.

``fzero.step._batch`` refuses, after a micro-batch's backward, a reentrant checkpoint whose backward autograd
skipped (``REENTRANT_HINT`` says why and the fix); this module finds one in the graph, walked only in a step where
some param got no gradient.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from torch import nn


# torch.utils.checkpoint(..., use_reentrant=True) runs its function under no_grad and leaves one node in the graph,
# whose backward recomputes the function and adds the gradients to each param's .grad with a backward of its own.
# fzero takes the gradient with respect to the state's params only (torch.autograd.backward(inputs=...) or
# torch.autograd.grad), which torch refuses once the backward reaches that node; and where nothing trainable comes
# before the checkpointed block (a LoRA adapter on a frozen base, its inputs made to require grad by Hugging Face's
# enable_input_require_grads), the engine prunes the node as leading to no input: the params inside the block get no
# gradient at all, without an error, where plain PyTorch's loss.backward() trains them.
_REENTRANT_NODE = "CheckpointFunctionBackward"  # torch.utils.checkpoint.CheckpointFunction's node
REENTRANT_HINT = """fzero.Step: the model runs torch.utils.checkpoint with use_reentrant=True{what}.
A reentrant checkpoint recomputes its block inside its own backward and adds the gradients to each param's .grad
there; fzero takes the gradient with respect to the state's params only, which torch refuses with reentrant
checkpoints, and where nothing trainable comes before the block (a LoRA adapter on a frozen base model) the block's
backward never runs at all, so its params would get no gradient, silently: the step stops here, before any update.
This is Hugging Face's gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": True}}), or
gradient_checkpointing_kwargs={{}} (torch's default is then reentrant; peft's prepare_model_for_kbit_training passes {{}}).
Fix: non-reentrant checkpointing, which fzero supports at every stage:
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}}) (transformers 5's
default; 4.x defaulted to reentrant), torch.utils.checkpoint(..., use_reentrant=False) in your own code; or turn the
model's checkpointing off and recompute with fzero's own, compile(..., remat=True)."""


def holds_reentrant_checkpoint(root: Any) -> bool:
    """Whether the autograd graph under the node ``root`` holds a ``torch.utils.checkpoint(use_reentrant=True)`` call
    whose block may hold a trainable param (``_block_may_train``) (a walk over the graph's nodes: about 2 us a node,
    4 ms for a 32-layer Llama's 2,500)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == _REENTRANT_NODE and _block_may_train(getattr(node, "run_function", None)):
            return True
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions)
    return False


def _block_may_train(fn: Any) -> bool:
    """Whether the function a reentrant checkpoint recomputes may hold a trainable param. Autograd also skips the
    backward of a block that holds none (a frozen backbone under checkpointing, its input made to require grad by
    ``enable_input_require_grads``), which costs nothing: there the params no gradient reached are unused for another
    reason (an unused pooler, a dropped layer), as in plain PyTorch, and are not refused. Unknown (no module found in
    the function, its partial or its closure): True, refused as before."""
    modules = _modules_in(fn, depth=3)
    return not modules or any(p.requires_grad for m in modules for p in m.parameters())


def _modules_in(fn: Any, *, depth: int) -> list[nn.Module]:
    """The modules ``fn`` runs, as far as it shows them: ``fn`` itself, a bound method's module (Hugging Face passes
    ``layer.__call__``), a ``functools.partial``'s function and arguments, or a closure's cells (``create_custom_forward
    (module)``), ``depth`` levels deep."""
    if isinstance(fn, nn.Module):
        return [fn]
    if depth == 0 or fn is None:
        return []
    if isinstance(fn, types.MethodType):
        return _modules_in(fn.__self__, depth=depth - 1) or _modules_in(fn.__func__, depth=depth - 1)
    if isinstance(fn, functools.partial):
        parts = [fn.func, *fn.args, *fn.keywords.values()]
    else:
        parts = [c.cell_contents for c in getattr(fn, "__closure__", None) or () if _filled(c)]
    return [m for part in parts if isinstance(part, nn.Module) or callable(part) for m in _modules_in(part, depth=depth - 1)]


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True
