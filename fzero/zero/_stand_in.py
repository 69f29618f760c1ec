"""The stand-ins of a stage 2-3 skeleton (``fzero.zero._sharded``): what a trainable parameter is between its unit's calls.

A stand-in (``_StandIn``) is a meta tensor of the parameter's shape, and a view or cast of one (``_StandInView``) is
guarded as it is: an op that meets one with a real tensor raises, and the step's wrapper names the batch and the fix,
while its metadata (shape, dtype, device) stays readable (``_guard``). The frozen params the state holds sharded
(``step.init(..., frozen=...)``) are stand-ins in the skeleton too, checked against the module each step
(``_sharded_frozen``).

Apart from ``fzero.zero._sharded``, which builds the skeleton, so that each stays short.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fzero.layout import named_tensors, ROOT, Layout
from fzero.step import DATA_WRITE, PARAM_WRITE_FIX


# What a stand-in may be asked outside its unit's call (its shape, dtype, ``requires_grad``: properties, read by
# ``model.dtype`` and by fzero itself); anything that computes with its values is refused (``_StandIn``).
_STAND_IN_METADATA = frozenset({torch.Tensor.size, torch.Tensor.stride, torch.Tensor.dim, torch.Tensor.numel,
                                torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
                                torch.Tensor.__repr__, torch.Tensor.__format__})


_DEVICE = torch._C.TensorBase.device  # a read of ``tensor.device`` comes to __torch_function__ as its ``__get__``

# Ops whose result is the stand-in's own values in another shape or dtype (a view, a cast): guarded as it is, so that
# self.blocks[0].fc.weight.t() meeting a real tensor is refused, not computed from missing memory. Other ops on stand-ins
# alone give plain meta tensors, whose shapes code outside a unit may read (a parametrization run for its shape: its
# values are never used); a loss made of them is refused where the step meets it (a meta loss).
_VIEWS = frozenset({"t", "transpose", "permute", "view", "view_as", "reshape", "reshape_as", "expand", "expand_as",
                    "narrow", "select", "__getitem__", "unsqueeze", "squeeze", "flatten", "unflatten", "contiguous",
                    "as_strided", "detach", "unbind", "split", "chunk", "movedim", "moveaxis", "swapaxes", "swapdims",
                    "clone", "to", "type_as", "float", "half", "bfloat16", "double", "T", "mT", "H", "mH", "data"})


def _guard(func: Any, args: Any = (), kwargs: Any = None) -> Any:
    """``__torch_function__`` of the stand-ins (``_StandIn``) and their views (``_StandInView``)."""
    tensors = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if func in _STAND_IN_METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    stand_in = next((a for a in tensors if isinstance(a, _GUARDED)), None)
    getter = getattr(func, "__self__", None) if getattr(func, "__name__", None) == "__get__" else None
    where = None if stand_in is None else stand_in.__dict__.get("_fz_device")
    if getter is _DEVICE and where is not None:
        # ``.device`` read in Python is where the param computes, not meta: ``model.device`` (transformers': its
        # first param's) read outside a unit gave meta, and torch.arange(n, device=model.device) made meta positions,
        # which a CPU embedding took as values from missing memory (evaluate 1e27 where PyTorch gives 1.05,
        # silently). torch's own kernels still see the meta tensor (the guard below)
        return where
    name = getattr(getter, "__name__", None) if getter is not None else getattr(func, "__name__", None)
    if name in ("to", "cpu", "cuda") and where is not None and stand_in is args[0]:
        # to the device it reports (w.to(w.device)): no move, as for a real tensor already there (a move out of meta
        # would be torch's "Cannot copy out of meta tensor"); a dtype change stays a cast on meta
        target, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **(kwargs or {})) if name == "to" else (
            torch.device("cpu") if name == "cpu" else None, None, None, None)
        if target is None or target == where or (target.type == where.type and target.index is None):
            first: Any = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                out = first if dtype is None else first.to(dtype=dtype)
            return out if out is first else _guarded(out, stand_in)
    if name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", None) == "data" and args \
            and isinstance(args[0], _GUARDED):
        # ``self.blocks[0].fc.weight.data = w`` outside that unit's call: set on the meta stand-in, so the unit's call
        # ran on the gathered values and the write was lost (9.5e-2 off PyTorch after 3 SGD steps), silently
        at = args[0].__dict__.get("_fz_where")
        raise RuntimeError(DATA_WRITE.format(
            how=f"replaced the trainable parameter {at[1] if at else '?'!r} of unit {at[0] if at else '?'!r}",
            shape=tuple(args[0].shape), where="is, outside that unit's call, a stand-in with no values (stages 2-3)"))
    if getter is None and args and isinstance(args[0], _GUARDED) and _writes_in_place(name):
        # an in-place write of a stand-in alone (``self.blocks[1].fc.weight.mul_(0.9)`` under no_grad in the model's
        # forward, outside that unit's call) would run on meta and do nothing, where PyTorch keeps it (it was lost silently)
        at = args[0].__dict__.get("_fz_where")
        what = f"parameter {at[1]!r} of unit {at[0]!r}" if at else "a unit's parameter"
        raise RuntimeError(
            f"{name}() wrote the {what} (shape {tuple(args[0].shape)}) in place outside that unit's call. At stages 2-3 a "
            f"unit's params exist only while the unit runs (between its calls each is a stand-in with no values), so the "
            f"write would be lost. {PARAM_WRITE_FIX}")
    if getter is not None or all(t.is_meta for t in tensors):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return _guarded(out, stand_in) if name in _VIEWS else out
    shape = "?" if stand_in is None else tuple(stand_in.shape)
    at = None if stand_in is None else stand_in.__dict__.get("_fz_where")
    what = f"parameter {at[1]!r} (shape {shape}) of unit {at[0]!r}" if at else f"unit's parameter of shape {shape}"
    # a weight of a unit tied to a module outside it (Bart's model.shared as a unit, read as encoder.embed_tokens)
    tied = "" if stand_in is None else stand_in.__dict__.get("_fz_tied", "")
    # not "fzero..."-prefixed: the step's wrapper adds the batch and the fix for a unit's param used outside its call
    raise RuntimeError(f"{getattr(func, '__name__', func)}() was given the {what} outside that "
                       f"unit's call, where it is a meta tensor with no values to compute with" + (f". {tied}" if tied else ""))


# in-place methods that change no values (what fzero itself and torch's module methods call on a parameter)
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


def _writes_in_place(name: str | None) -> bool:
    """Whether the tensor method ``name`` writes its tensor's values in place (``mul_``, ``clamp_``, ``w[0] = ...``)."""
    if not name or name in _NOT_WRITES:
        return False
    if name.startswith("__"):
        return name == "__setitem__" or (name.startswith("__i") and name not in ("__index__", "__invert__", "__iter__", "__int__"))
    return name.endswith("_") and not name.startswith("_")


class _StandIn(nn.Parameter):
    """A trainable parameter of a stage 2-3 skeleton between its unit's calls: a meta tensor of its shape. The unit's
    own attributes are guarded by ``_UnitSkin``, but a parameter of a module inside a unit (``self.blocks[0].fc.weight``
    read by the model's forward, a weight shared across layers) is reached without it, and torch's CPU kernels take a
    meta operand beside real ones and read its missing memory as values (``F.linear(h, meta)`` returns numbers): under
    ``step.evaluate`` a silently wrong loss, in a step an error about "the module's own parameters". So an op that
    meets a stand-in (or a view of one, ``_StandInView``) with a real tensor raises, and the step's wrapper names the
    batch and the fix (``UNIT_OUTSIDE_ITS_CALL``); its metadata (shape, dtype, device) stays readable (``_guard``)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guard(func, args, kwargs)


class _StandInView(torch.Tensor):
    """A view or cast of a stand-in (``_VIEWS``), guarded as the stand-in is. A plain tensor subclass, not a parameter:
    assigned to a module (``self.wt = w.t()``) it is an attribute, as the real view would be."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _guard(func, args, kwargs)


_GUARDED = (_StandIn, _StandInView)


def _guarded(out: Any, like: Any) -> Any:
    """``out`` with each meta tensor in it a ``_StandInView`` that names what ``like`` names (its unit and path)."""
    if like is None:
        return out
    if isinstance(out, torch.Tensor):
        if not out.is_meta or isinstance(out, _GUARDED):
            return out
        guarded = out.as_subclass(_StandInView)
        guarded.__dict__.update({k: v for k, v in like.__dict__.items() if k in ("_fz_where", "_fz_tied", "_fz_device")})
        return guarded
    if isinstance(out, (tuple, list)):
        return type(out)(_guarded(o, like) for o in out)
    return out


def _leaves(tree: Any) -> list:
    import torch.utils._pytree as torch_pytree

    return torch_pytree.tree_leaves(tree)


def _sharded_frozen(module: nn.Module, layout: Layout, seen: dict, api: str) -> dict[int, tuple[str, str, torch.dtype]]:
    """``id`` of each module parameter the state holds sharded (``step.init(..., frozen=...)``) -> (its unit, its path,
    the dtype it is gathered in), checked against the module: still there, frozen, of the same shape, not written
    since init copied it (``seen``; a meta one, emptied by ``fzero.free_frozen``, holds nothing to write), and not
    tied to a name in another unit (whose call would not bind it)."""
    every = named_tensors(module, "_parameters", remove_duplicate=False)
    by_name = dict(every)
    aliases: dict[int, list[str]] = {}
    for name, t in every:
        aliases.setdefault(id(t), []).append(name)
    units = [u.name for u in layout.units if u.name != ROOT]
    out = {}
    for group in layout.frozen:
        for s in group.slots:
            p: torch.Tensor | None = by_name.get(s.path)
            if p is None or p.requires_grad or tuple(p.shape) != s.shape:
                what = ("has no such parameter" if p is None else "trains it now (requires_grad=True)" if p.requires_grad
                        else f"has it with shape {tuple(p.shape)}")
                raise ValueError(
                    f"{api}: the state holds the frozen param {s.path!r} (shape {s.shape}, frozen= at step.init), but "
                    f"{type(module).__name__} {what}. Make the state from this model: step.init(fzero.params_of(model), "
                    f"frozen=fzero.frozen_of(model)).")
            if not p.is_meta and s.path in seen and seen[s.path] != (p._version, p.data_ptr()):
                raise ValueError(
                    f"{api}: the frozen param {s.path!r} of {type(module).__name__} was written (or replaced) since "
                    f"step.init copied it into the state's shards (frozen=), which the step reads instead of the module: "
                    f"the new value would be ignored (restore_frozen or load(..., model=) for another state made from this "
                    f"module replaces it too: after free_frozen, each state its own module). Give the module its values "
                    f"before step.init (load_state_dict first), or make the state again: step.init(fzero.params_of(model), frozen=fzero.frozen_of(model)) "
                    f"(the optimizer's moments start again; model.load_state_dict(step.state_dict(state, model)) first "
                    f"keeps the trained values).")
            owners = {next((u for u in units if n.startswith(u + ".")), ROOT) for n in aliases[id(p)]}
            if owners != {group.name}:
                raise ValueError(
                    f"{api}: the frozen param {s.path!r} is tied to {[n for n in aliases[id(p)] if n != s.path][:4]}, "
                    f"which lie in units {sorted(owners)}; the state shards it with unit {group.name!r}, whose gather "
                    f"the others' calls do not see. Leave it out of frozen= (it is then read from the module), or give "
                    f"units= that put every module sharing it in one unit, or all of them outside the units (the root).")
            out[id(p)] = (group.name, s.path, layout.frozen_dtype(group))
    return out
