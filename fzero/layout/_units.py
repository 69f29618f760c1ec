"""Which parameters form a stage-3 *unit*: gathered together, just before the unit's forward.

A unit is a submodule whose params are gathered as one flat buffer when its forward runs; every
parameter outside all units belongs to the root unit, gathered once at the top of ``fzero.apply``.

Units are named by module path, and a parameter belongs to the unit whose path prefixes its name.
That keeps ``Step.init(params)`` free of the module: by default the unit of ``blocks.3.attn.qkv.weight``
is ``blocks.3``, the name up to its first numeric component, which is exactly "each child of a
``ModuleList``/``Sequential``". ``units_of(model, module_types=..., min_elements=...)`` picks units by
module type and size instead, like FSDP's wrap policies, and returns the paths to pass as ``units=``.
"""

from __future__ import annotations

import difflib
from typing import Callable, Iterable, Sequence

from torch import nn

from fzero.layout._layout import ROOT


def by_container_child(path: str) -> str:
    """Default unit of a parameter: its name up to the first numeric component (a ModuleList/Sequential child)."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ROOT


def by_prefixes(prefixes: Sequence[str], *, api: str) -> Callable[[str], str]:
    """Unit of a parameter: the listed module path that prefixes its name, else the root unit."""
    prefixes = tuple(prefixes)
    for p in prefixes:
        if not isinstance(p, str) or not p or p == ROOT:
            raise ValueError(f"{api}: units must be module paths such as 'blocks.0', got {p!r}.")
    for a in prefixes:
        for b in prefixes:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"{api}: units must not nest: {b!r} is inside {a!r}. Keep the outer or the inner ones.")

    def unit_of(path: str) -> str:
        for p in prefixes:
            if path.startswith(p + "."):
                return p
        return ROOT

    return unit_of


def check_units_exist(units: Sequence[str], paths: Iterable[str], *, api: str) -> None:
    """Raise for a ``units`` entry that names no module holding trainable parameters.

    Such an entry prefixes no parameter, so it would silently hold nothing (and if every entry is a
    typo, the whole model becomes the root unit: stage 3 with no sharding benefit). ``Step.init`` sees
    only parameter paths, not the module, so the module paths are every dotted prefix of them.
    """
    paths = set(paths)
    modules: set[str] = set()
    for path in paths:
        parts = path.split(".")
        modules.update(".".join(parts[:i]) for i in range(1, len(parts)))
    for unit in units:
        if unit in modules:
            continue
        close = difflib.get_close_matches(unit, sorted(modules), n=1, cutoff=0.5)
        if unit in paths:
            owner = unit.rpartition(".")[0]
            hint = f"It is a parameter, not a module; the module that holds it is {owner!r}." if owner else "It is a parameter, not a module."
        elif close:
            hint = f"The closest module path is {close[0]!r}."
        else:
            tops = sorted({m.split(".")[0] for m in modules})
            hint = f"Top-level modules with parameters: {', '.join(map(repr, tops[:8]))}{', ...' if len(tops) > 8 else ''}."
        raise ValueError(
            f"{api}: units entry {unit!r} matches no module with trainable parameters (no parameter name starts with "
            f"{unit + '.'!r}). {hint} A module whose weight is tied to another's (an LM head tied to the token "
            f"embedding) owns no parameter of its own: named_parameters names the weight once, under the module that "
            f"holds it first. Pass module paths as fzero.units_of(model) returns them, e.g. "
            f"units=fzero.units_of(model, module_types=Block)."
        )


def units_of(model: nn.Module, *, module_types: tuple[type, ...] | type | None = None, min_elements: int = 0) -> tuple[str, ...]:
    """Module paths of the units of ``model``, for ``shard_params(step, units=...)``/``compile(..., units=...)``.

    A module is a unit if it is an instance of ``module_types`` (default: any child of a ``ModuleList``
    or ``Sequential`` that is not itself a ``ModuleList`` or ``ModuleDict``, which a model never calls: their
    children are looked at instead) and holds at least ``min_elements`` trainable parameters; units do not nest
    (the outermost match wins), and what no unit holds stays in the root unit.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fzero.units_of: expected an nn.Module, got {type(model).__name__}.")
    if isinstance(module_types, type):
        module_types = (module_types,)
    found: list[str] = []
    containers = {name for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))}

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if module_types is not None:
                wanted = isinstance(child, module_types)
            else:
                wanted = ((path in containers or (path == "" and "" in containers))
                          and not isinstance(child, (nn.ModuleList, nn.ModuleDict)))
            size = sum(p.numel() for p in child.parameters() if p.requires_grad)
            if wanted and size and size >= min_elements:
                found.append(child_path)
            else:
                visit(child, child_path)

    visit(model, "")
    return tuple(found)
