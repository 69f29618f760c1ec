"""What a step refuses of a module before it runs it, once: its params against those the state holds (names,
shapes, ties, which train, gradient hooks on them), a module or submodule whose call would run the module's own
tensors instead of the step's (compiled in place, wrapped by ``torch.compile``, a ``forward`` set on it that calls it),
and features no step trains (a sparse embedding gradient).

Why apart from ``fzero.step._module``: these only look and refuse, where that module runs the module (``apply``, the
buffer bank, the between-steps watch). Stage 3's skeleton runs the params checks when the params' pattern changes
(``fzero.zero._sharded``), ``fzero.apply`` at stages 0-1 at each call. The small predicates every call reads
(``has_grad_hooks``, ``compiled_in_place``, ``compiled_wrapper``) live in ``fzero.layout``, which both import.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fzero.layout import compiled_in_place, compiled_wrapper, has_grad_hooks, named_tensors


# -- a module against the params a state holds -------------------------------------------------------------------


def check_params_fit_module(module: Any, params: Any, *, api: str,
                            units: dict[str, str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """Raise a ``ValueError`` when a param of ``params`` (name -> tensor, as ``fzero.params_of`` names them) has
    another shape than the parameter of that name in ``module``: the state was made from another model (an
    MLP(4, 8, 2) state run by an MLP(4, 16, 2)), and ``torch.func.functional_call`` would run it anyway, as the
    smaller model. ``units``: name -> unit, to name the unit too. Names the module lacks are refused too, with
    the names missing on either side: ``functional_call`` would fail deep inside torch ("Sequential has no
    attribute layers") or set an attribute the forward never reads.

    Meant for ``fzero.apply`` (stages 0-1) and the stage 2-3 skeleton, once per module and layout (a dict lookup
    per param). Returns the module's ``(name, parameter)`` pairs it walked, for ``check_trainable_set``."""
    named = named_tensors(module, "_parameters", remove_duplicate=False)  # per step: one walk, not torch's generators
    own = dict(named)
    unexpected = [name for name in params if name not in own]
    if unexpected:
        known = {*own, *(n for n, _ in module.named_buffers(remove_duplicate=False))}
        unexpected = [name for name in unexpected if name not in known]
    if unexpected:
        missing = [name for name, q in own.items() if name not in params and q.requires_grad]
        raise ValueError(
            f"{api}: params has {len(unexpected)} name(s) that {type(module).__name__} does not have: "
            f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}; the model has {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''} that params lacks. The params (or the state) were made from another "
            f"model, or a module renamed its layers. Make the state from this model's params "
            f"(step.init(fzero.params_of(model))), run the model it came from, or rename the keys to this model's names."
        )
    for name, p in params.items():
        q = own.get(name)
        if q is None or not isinstance(p, torch.Tensor) or p.shape == q.shape:
            continue
        unit = f"unit {units[name]!r} " if units and name in units else ""
        raise ValueError(
            f"{api}: {unit}param {name!r} has shape {tuple(p.shape)} in the state but {tuple(q.shape)} in the model "
            f"({type(module).__name__}): the state was made from another model or another configuration of it. Make "
            f"the state from this model's params (step.init(fzero.params_of(model))), or run the model it came from."
        )
    return named


def trainable_changes(named: list[tuple[str, torch.Tensor]], names: set[str]) -> tuple[list[str], list[str]]:
    """(params in ``names`` that are frozen now, params trainable now that ``names`` lacks), from the module's
    ``named`` parameters (a tied one under each of its names; the first is the one ``params_of`` uses)."""
    frozen, seen, new = [], set(), []
    for name, p in named:
        if name in names and not p.requires_grad:
            frozen.append(name)
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad and name not in names:
            new.append(name)
    return frozen, new


def check_no_grad_hooks(named: list[tuple[str, torch.Tensor]], module: Any, *, api: str,
                        step_params: Mapping[str, Any] | None = None) -> None:
    """Raise a ``ValueError`` when a trainable parameter of the user's module carries a gradient hook.

    A step takes the gradient with respect to the state's tensors, never the module's own parameters, so a hook on
    one of those (a per-element clamp, a mask that keeps some rows of an embedding frozen, an optimizer run in
    backward) would never run and the step would train on the gradient it was meant to change, silently. ``named``:
    the module's ``(name, parameter)`` pairs (the user's own tensors). Only inside a step that takes a gradient.
    ``step_params``: the params the step runs the module with, whose own hooks (fzero's, at stages 0-1 under plain
    autograd) are not the user's: the module holds them from its first ``fzero.apply`` in a forward until the backward
    (``step_scope``), so a second call (a per-image loop, a siamese pair) finds them in its place."""
    hooked = [name for name, p in named if has_grad_hooks(p) and (step_params is None or p is not step_params.get(name))
              and not _step_hooks_only(p)]
    if not hooked:
        return
    raise ValueError(
        f"{api}: the parameter(s) {hooked[:4]}{' ...' if len(hooked) > 4 else ''} of {type(module).__name__} carry "
        f"gradient hooks (Tensor.register_hook or register_post_accumulate_grad_hook on the module's own parameters). "
        f"fzero takes the gradient of the train state's tensors, not of the module's, so these hooks would never run "
        f"and the step would train on the gradient they were meant to change. Remove them (handle.remove()) and change "
        f"the gradient where fzero's tensors are: register the hook in the module's forward on the tensor it reads "
        f"(self.weight.register_hook(fn), run at every stage on the param that step uses; under remat=True the "
        f"recompute registers it again, as under torch.utils.checkpoint), or at stages 0-2 in "
        f"loss_fn (params[name].register_hook(fn) before fzero.apply); clip by norm with compile(clip_grad_norm=...)."
    )


def _step_hooks_only(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient hooks are all the step's own (stages 0-1 under plain autograd: ``fzero.step._parts``):
    a module called again in one forward with other params (first-order MAML's fast weights, a pair with one weight
    masked) still holds the step's tensors from its first call, and those are not the user's."""
    return not p._backward_hooks and all(getattr(h, "fzero_step_hook", False)
                                         for h in p._post_accumulate_grad_hooks.values())


def check_trainable_set(named: list[tuple[str, torch.Tensor]], state_names: Any, module: Any, *, api: str) -> None:
    """Raise a ``ValueError`` when the module's trainable parameters are no longer those the state was made with.

    ``named``: the module's parameters as ``named_parameters(remove_duplicate=False)`` lists them (a tied one under
    each of its names); ``state_names``: the names of the state's params. A state fixes at ``step.init`` which params
    train (as a DeepSpeed engine or an FSDP module fixes them when it is made); a ``requires_grad`` changed on the
    module afterwards, or a trainable module attached, would otherwise be ignored (stages 0-1: a frozen param kept
    training, a new one never trained) or, at stages 2-3, run on the uninitialised memory of a stand-in. Once per
    ``fzero.apply`` in a step: a pass over names the caller has already collected."""
    names = set(state_names)
    if not names <= {name for name, _ in named}:
        return  # the state names params this module lacks: another model, which the callers name as such
    by_tensor: dict[int, list[str]] = {}
    for name, p in named:
        by_tensor.setdefault(id(p), []).append(name)
    for aliases in by_tensor.values():
        held = [a for a in aliases if a in names]
        if len(held) > 1:  # torch's functional_call would say "Consider using tie_weights=False"
            raise ValueError(
                f"{api}: the state holds separate values for {held}, which are one tied parameter in "
                f"{type(module).__name__}: the state (or a checkpoint loaded into it) was made from a configuration of the "
                f"model without that tie (e.g. tie_word_embeddings=False). Build the model as the state was made, or make "
                f"the state from this model (step.init(fzero.params_of(model)))."
            )
    frozen, new = trainable_changes(named, names)
    if not frozen and not new:
        return
    what = []
    if frozen:
        what.append(f"frozen since (requires_grad=False now): {frozen[:4]}{' ...' if len(frozen) > 4 else ''}")
    if new:
        what.append(f"trainable now but not in the state (unfrozen, a module attached, or the state, or a checkpoint "
                    f"loaded into it, made from a smaller configuration of the model): {new[:4]}{' ...' if len(new) > 4 else ''}")
    raise ValueError(
        f"{api}: the trainable parameters of {type(module).__name__} are not those the state was made with; "
        f"{'; '.join(what)}. A state fixes which params train when it is made (step.init), and fzero would otherwise "
        f"train the old set silently. Undo the change, or start a state with the new set: write the trained values "
        f"into the model (model.load_state_dict(step.state_dict(state, model))), change requires_grad or attach the "
        f"modules, then state = step.init(fzero.params_of(model)) (the optimizer's moments start again). To freeze "
        f"some params for a while and train them later as torch.optim does, keep them in the state and detach what "
        f"they compute while frozen (h = backbone(x).detach()): a param with no gradient is skipped, as torch.optim "
        f"skips grad=None (docs/migrating.md, \"The module after step.init\")."
    )


# -- modules whose call would run their own tensors, not the step's -----------------------------------------------


def _named(path: str, module: nn.Module) -> tuple[str, str]:
    """(how to reach the module at ``path`` of ``module`` in code, what to call it in a message); "" is ``module``."""
    if not path:
        return "model", "the module"
    return f"model.get_submodule({path!r})", f"the submodule {path!r} of {type(module).__name__}"


def compiled_in_place_error(api: str, path: str, module: nn.Module) -> TypeError:
    """The refusal of a module ``module.compile()`` ran on, at ``path`` of ``module`` ("" for ``module`` itself)."""
    where, what = _named(path, module)
    return TypeError(
        f"{api}: {what} was compiled in place ({where}.compile(), nn.Module.compile): its compiled call is bound to "
        f"that module and runs it with the module's own tensors, not the step's params. Undo it ({where}."
        f"_compiled_call_impl = None, or build the model without calling .compile() on it); to compile, give "
        f"fzero.compile(..., jit=True) at stages 2-3, which compiles each unit's forward."
    )


def calls_itself(fn: Any, module: nn.Module, *, depth: int = 4) -> bool:
    """Whether ``fn``, a callable kept on ``module`` itself (``module.forward = ...``), calls ``module``: a method bound to
    it, a wrapper of one (``__wrapped__``), or a function whose closure holds it or such a method, a few levels deep.
    A step's copy of the module shares that callable, which then runs the original module with its own tensors."""
    stack = [(fn, 0)]
    while stack:
        f, d = stack.pop()
        if f is module:
            return True
        if isinstance(f, types.MethodType):
            if f.__self__ is module:
                return True
            f = f.__func__
        if d >= depth:
            continue
        inner = [getattr(f, "__wrapped__", None)] if not isinstance(f, nn.Module) else []
        for cell in getattr(f, "__closure__", None) or ():
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        stack.extend((x, d + 1) for x in inner if x is not None and callable(x))
    return False


def trains_under(module: nn.Module) -> bool:
    """Whether ``module`` or a module under it has a trainable param: the step's values, which a call bound to the
    original module would not read (frozen params it reads are the same values)."""
    return any(p.requires_grad for p in module.parameters())


def own_forward_error(api: str, path: str, module: nn.Module) -> TypeError:
    """The refusal of a ``forward`` set on the module at ``path`` of ``module`` ("" for itself) that calls that module."""
    where, what = _named(path, module)
    return TypeError(
        f"{api}: {what} has a forward of its own, an instance attribute that calls that module ({where}.forward = ...: "
        f"Accelerate's prepare() with mixed_precision sets one, and unwrap_model() leaves one; so does a patch of "
        f"forward): a step runs a copy of the module holding the step's params, and this forward would run the "
        f"original with its own tensors. Remove it (del {where}.forward, which restores the class's forward; fzero's "
        f"precision= replaces Accelerate's mixed_precision), or put the change in the class (a subclass's forward)."
    )


def check_no_compiled_submodules(module: nn.Module, *, api: str) -> None:
    """Refuse a submodule that ``torch.compile`` wrapped or ``.compile()`` compiled in place, or whose own ``forward``
    attribute calls it (``calls_itself``): its call runs the original submodule with its own tensors (see ``check_not_compiled``), so a step would train (and
    ``step.evaluate`` would report) a model the params never reach."""
    for path, m in module.named_modules():
        if path and compiled_in_place(m):
            raise compiled_in_place_error(api, path, module)
        own = m.__dict__.get("forward") if path else None
        if own is not None and calls_itself(own, m) and trains_under(m):
            raise own_forward_error(api, path, module)
        if path and compiled_wrapper(m):
            parent, _, name = path.rpartition(".")
            raise TypeError(
                f"{api}: the submodule {path!r} of {type(module).__name__} is a torch.compile wrapper "
                f"(OptimizedModule of {type(getattr(m, '_orig_mod', None)).__name__}): its compiled forward runs the "
                f"module it wraps with that module's own tensors, not the step's params. Put the wrapped module "
                f"back in its place (model.get_submodule({parent!r}).register_module({name!r}, "
                f"model.get_submodule({path!r})._orig_mod)) and make the state from fzero.params_of(model) again; "
                f"to compile, give fzero.compile(..., jit=True) at stages 2-3, which "
                f"compiles each unit's forward."
            )


def check_module_features(modules: list[nn.Module]) -> None:
    """At the first forward with a graph, before its backward: refuse what ``fzero.apply`` ran but a step cannot
    train. A ``torch.compile`` wrapper inside the model runs the original submodule's own tensors (see
    ``check_not_compiled``). An ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True`` and a trainable weight
    gives a sparse gradient, which no unit's flat gradient buffer can hold: without this check it failed deep in
    fzero or in autograd ("copy_() between dense and sparse Tensors", "reshape is not implemented for sparse
    tensors") with no name of the module or the fix."""
    for module in modules:
        check_no_compiled_submodules(module, api="fzero.Step")
        for path, m in module.named_modules():
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
                raise ValueError(
                    f"fzero.Step: the {type(m).__name__} {path or '<root>'!r} of {type(module).__name__} has sparse=True, "
                    f"so the gradient of {(path + '.' if path else '') + 'weight'!r} is a sparse tensor; fzero keeps every "
                    f"gradient dense, in its units' flat buffers (reduced, sharded and clipped together), and takes no "
                    f"sparse gradients. Build it with sparse=False (or set its .sparse = False before training): with "
                    f"a dense gradient it trains as torch.optim's SGD and AdamW do; torch.optim.SparseAdam's lazy update "
                    f"of the looked-up rows alone has no fzero optimizer."
                )
