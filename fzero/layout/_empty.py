"""Models whose parameters have no values yet: built under ``fzero.empty_params()``, made by ``step.init``.

Why not ``torch.device("meta")``: under it *every* tensor is meta, buffers too. A persistent buffer is part of
the train state and gets its value there, but a non-persistent one (a Llama's rotary ``inv_freq``, a causal mask)
is a constant the forward reads from the module itself, and nothing can compute it after the fact: it was made
from an ``arange`` that was meta as well. ``empty_params()`` does what ``accelerate.init_empty_weights()`` does:
each parameter goes to meta as the module registers it, and every buffer is computed for real. A parameter
moves to meta once and keeps its identity, so weights a model ties while it is built (an LM head that *is* the
embedding's parameter) stay tied.

``check_no_meta`` is what ``fzero.apply`` runs before a forward: a meta tensor the forward would read from the
module (a buffer nobody gave a value, a parameter outside ``params``) is named, with the fix, instead of failing
deep in the model with torch's "Cannot copy out of meta tensor".
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterable, Iterator

from torch import nn

from fzero.layout._bind import walk

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


def check_no_meta(module: nn.Module, names: Iterable[str], *, state_buffers: bool, api: str) -> None:
    """Refuse a forward of ``module`` that would read a meta tensor from the module itself.

    ``names``: the params the call is given (a meta module parameter among them is replaced, so fine).
    ``state_buffers``: persistent buffers come from the train state (inside a step), which names its own meta
    ones; a non-persistent buffer always comes from the module."""
    given = None
    seen: set[int] = set()  # a tied parameter is checked under its first path, as named_parameters names it
    meta_params = []
    for prefix, sub in walk(module):  # one walk for both checks: this runs at every fzero.apply
        for name, b in sub._buffers.items():
            if b is None or not b.is_meta:
                continue
            persistent = name not in sub._non_persistent_buffers_set
            if state_buffers and persistent:
                continue
            why = ("outside a step, the forward reads buffers from the module" if persistent else
                   "it is non-persistent, so no train state or checkpoint holds it: the forward reads it from the module")
            raise ValueError(
                f"{api}: the {'buffer' if persistent else 'non-persistent buffer'} {prefix + name!r} "
                f"of {type(module).__name__} is a meta tensor (a shape without a value), and {why}. {META_BUFFER_FIX}."
            )
        for name, p in sub._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if p.is_meta:
                    meta_params.append((prefix + name, p))
    for path, p in meta_params:  # after every buffer, as before: a meta buffer is named first
        if p.is_meta:
            given = set(names) if given is None else given
            if path not in given:
                why = "it is frozen (requires_grad=False), so fzero.params_of leaves it out" if not p.requires_grad else "params lacks it"
                raise ValueError(
                    f"{api}: the parameter {path!r} of {type(module).__name__} is a meta tensor and {why}, so the "
                    f"forward would read it from the module. Make it trainable and pass it in params (step.init "
                    f"materializes it), or give the module a real value for it (e.g. load_state_dict(..., assign=True)) "
                    f"before training."
                )
