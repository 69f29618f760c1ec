"""Models whose parameters have no values yet: built under ``fzero.empty_params()``, made by ``step.init``.

Why not ``torch.device("meta")``: under it *every* tensor is meta, buffers too. A persistent buffer is part of
the train state and gets its value there, but a non-persistent one (a Llama's rotary ``inv_freq``, a causal mask)
is a constant the forward reads from the module itself, and nothing can compute it after the fact: it was made
from an ``arange`` that was meta as well. ``empty_params()`` does what ``accelerate.init_empty_weights()`` does:
each parameter goes to meta as the module registers it, and every buffer is computed for real. A parameter
moves to meta once and keeps its identity, so weights a model ties while it is built (an LM head that *is* the
embedding's parameter) stay tied.

Kept apart from ``fzero.layout._modules``, whose binding, clones and ``check_no_meta`` run at every step: this runs
only while a model is built.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from torch import nn


_lock = threading.Lock()
_depth = 0  # nested or concurrent empty_params() blocks share one patch of nn.Module.register_parameter
_original = nn.Module.register_parameter

META_BUFFER_FIX = (
    "Build the model under `with fzero.empty_params(): model = ...` instead of `with torch.device('meta'):` "
    "(parameters on meta, buffers computed for real, as accelerate.init_empty_weights() does), or give the module "
    "real buffers before training"
)


def _register_empty(module: nn.Module, name: str, param: Any) -> None:
    _original(module, name, param)
    if param is not None and not param.is_meta:
        # the same Parameter class and attributes, on meta; the brief real allocation of one parameter is all
        # the build costs (its init then runs on meta, doing nothing)
        meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
        meta.__dict__.update(param.__dict__)
        module._parameters[name] = meta


@contextlib.contextmanager
def empty_params() -> Iterator[None]:
    """Within the block, every parameter a module registers is a meta tensor (shape and dtype, no memory), and
    every buffer is real: ``with fzero.empty_params(): model = AutoModelForCausalLM.from_config(cfg)``, then
    ``step.init(fzero.params_of(model, copy=False), materialize=...)`` makes the values one unit at a time
    (``fzero.checkpoint.pretrained(dir, model=model)`` reads them from a Hugging Face checkpoint).

    It patches ``nn.Module.register_parameter`` for the length of the block, in every thread, as
    ``accelerate.init_empty_weights()`` does: build nothing else concurrently that must have real parameters.
    """
    global _depth
    with _lock:
        if _depth == 0:
            nn.Module.register_parameter = _register_empty
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                nn.Module.register_parameter = _original
