"""``fzero.estimate_memory``: per-rank bytes of a ZeRO run, by category and by place, before running it.

Model states follow the ZeRO paper (computed by ``_formula.per_rank``), with Ψ parameters, N ranks,
P bytes per param and gradient (4 in fp32, 2 in bf16/fp16) and K optimizer bytes per parameter (the fp32 master,
when the policy keeps one, plus the optimizer's state: 8 for Adam's m and v in fp32)::

    stage 0: (2P + K)Ψ     stage 1: 2PΨ + KΨ/N     stage 2: PΨ + (P + K)Ψ/N     stage 3: (2P + K)Ψ/N

Given a model or a params pytree (not just a count) the estimate uses fzero's own layout: units padded as
``Step.init`` pads them, and the working set of a step on top of the model states:

* ``gathered`` (stage 3): the unit that runs and the one prefetched (the two largest units), and the root unit
  (parameters outside every unit, gathered for the whole step);
* ``transient``: what else the step's peak holds. In backward, beside the whole gradient: at stages 0-1 the largest
  of a parameter's gradient before it is copied into its size bucket (lent at its first gradient), and the
  collective's output (stage 0: an all-reduced bucket; stage 1: a bucket's reduce-scattered shard; none on one rank);
  stage 2: the unit's gradient and its per-parameter pieces before they are joined; stage 3: the gradient of the
  unit recomputed. At stages 2-3 the root unit's gradient comes through autograd
  and is reduced after backward: its per-parameter pieces and the flat gradient they are joined into (two root
  units), beside the other units' shards and, at stage 3, the gathered root. A parameter reached under several
  names (tied embeddings: ``named_parameters(remove_duplicate=False)``) gets one gradient piece per use, which
  autograd sums pairwise: the sum so far, the next piece and their sum are alive at once, so its gradient counts
  twice more however many names it has (T5's shared embedding: four names, three uses), once more again in a size
  bucket that other params' gradients lent already (given a module; a params pytree has no tying).
  In the update, the fp32 gradient the optimizer reads: fzero converts the reduced gradient of what a rank owns
  to fp32 unit by unit, in the layout's order (4 bytes per owned element), each unit's copy made while its own
  compute-dtype gradient and those of the units after it are alive: under a master-weight policy that outgrows
  the 2-byte gradients it replaces (the paper counts 2), most where a large unit (the root) comes first.
  The peak is the larger of the two phases; activations are not counted (they depend on the batch).

Offload: ``"cpu"`` moves the optimizer state (master included) to the host, with the fp32 gradient it reads
(one copy, kept from step to step; at stages 2-3 each unit's shard goes there as backward makes it, so the device
holds no whole gradient) and, without fp32 masters, a copy of the param shards it updates;
``offload_params=True`` (stage 3) the param shards too. ``"disk"``/``"nvme"`` keeps the optimizer state in mapped
files, updated a sub-group at a time (``sub_group_size`` elements of one unit's owned shard, the root unit's
included): the pages of the sub-group being updated are resident in the process (the next one is read ahead into
the page cache, which is not the process's memory, and updated ones are given back), beside that sub-group's fp32
gradient (and params, without masters); with ``offload_params=True`` the param shards are files too (mapped:
their pages are resident only while a gather or the update uses them, which this estimate does not count).

``one_memory``: the same run where device and host are one memory (a CPU-only machine, where fzero's tests and
benchmarks measure): each category summed over device and host, less the host's copies of device tensors (the
gradient the host optimizer reads is the device's own there). Its ``total`` is the peak of one rank's live tensor
bytes (``fzero.memory``: state plus a step's peak), and with activations about the process's peak RSS. With disk
offload it is the process's peak RSS (the resident pages of the mapped sub-group are no tensor's): the update's
live bytes, the sub-group's pages and, at stage 3, the gathered units the step's host buffer pool keeps through
the update (``fzero.step._pool``), when that outgrows backward's peak.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import torch
from torch import nn

from fzero.layout import pytrees as _tree, DEFAULT_UNIT_ELEMENTS, ROOT, SHARD_ALIGN, units_by_size, by_container_child, by_prefixes, check_units_exist
from fzero.estimate._formula import per_rank
from fzero import _rules
from fzero.zero import DEFAULT_SUB_GROUP, KINDS, check_units
from fzero.step import policy

API = "fzero.estimate_memory"
CATEGORIES = ("params", "grads", "optimizer", "gathered", "transient")


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Bytes one rank holds in one place, by category."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0  # the optimizer's state, fp32 master weights included
    gathered: float = 0.0  # stage 3: gathered units (running + prefetched + root)
    transient: float = 0.0  # the rest of the step's peak (see the module docstring)
    frozen: float = 0.0  # the module's frozen parameters (requires_grad=False): whole on every rank, at every stage

    @property
    def model_states(self) -> float:
        """params + grads + optimizer: the ZeRO paper's model states."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak of a step: model states + gathered + transient + frozen."""
        return self.model_states + self.gathered + self.transient + self.frozen


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes of one configuration. ``print(est)`` shows them; ``est.device.total`` is the device peak."""

    num_params: int  # Ψ, without padding
    stages: int
    world_size: int
    precision: str
    optimizer: str
    offload: str | None
    offload_params: bool
    device: Bytes
    host: Bytes
    disk: Bytes
    units: int | None  # units of the layout, when a model or params were given
    one_memory: Bytes | None = None  # device and host as one memory (a CPU-only machine); see estimate_memory
    frozen_params: int = 0  # the module's frozen parameters (not in num_params): held whole, see Bytes.frozen

    @property
    def model_states(self) -> float:
        """params + grads + optimizer per rank, wherever they are (the paper's Figure 1 column)."""
        return self.device.model_states + self.host.model_states + self.disk.model_states

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("num_params", "stages", "world_size", "precision", "optimizer", "offload",
                                             "offload_params", "units", "frozen_params")}
        for place in ("device", "host", "disk", "one_memory"):
            b = getattr(self, place)
            out[place] = {**{c: getattr(b, c) for c in (*CATEGORIES, "frozen")}, "model_states": b.model_states, "total": b.total}
        return out

    def __str__(self) -> str:
        where = "none" if self.offload is None else self.offload + (" + params" if self.offload_params else "")
        frozen = f" (+ {self.frozen_params:,} frozen)" if self.frozen_params else ""
        head = (f"estimated memory per rank: {self.num_params:,} params{frozen}, stage {self.stages}, {self.world_size} ranks, "
                f"{self.precision}, {self.optimizer}, offload {where}")
        cats = (*CATEGORIES, "frozen") if self.frozen_params else CATEGORIES
        lines = [head, f"{'':8s}" + "".join(f"{c:>12s}" for c in (*cats, "total"))]
        for place in ("device", "host", "disk"):
            b = getattr(self, place)
            if place == "device" or b.total:
                lines.append(f"{place:8s}" + "".join(f"{_fmt(getattr(b, c)):>12s}" for c in cats) + f"{_fmt(b.total):>12s}")
        return "\n".join(lines)


def _fmt(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def estimate_memory(
    model_or_params_or_count: Any,
    *,
    stages: int,
    world_size: int,
    offload: str | None = None,
    precision: Any = "fp32",
    optimizer: Any = "adamw",
    offload_params: bool = False,
    units: Any = None,
    unit_elements: int = DEFAULT_UNIT_ELEMENTS,
    prefetch: bool = True,
    sub_group_size: int = DEFAULT_SUB_GROUP,
    shard_frozen: bool = False,
) -> MemoryEstimate:
    """Per-rank bytes of ZeRO stage ``stages`` on ``world_size`` ranks, by category, on device, host and disk.

    ``model_or_params_or_count``: an ``nn.Module`` (its trainable parameters; its frozen ones, which fzero does not
    shard, in ``frozen``, whole on every rank, with the compute-dtype copy a bf16/fp16 step makes of them in
    ``transient``; meta-device models work, nothing is allocated), a params pytree (e.g. ``fzero.params_of(model)``) or a parameter count. ``precision``: "fp32",
    "bf16", "fp16" or a ``fzero.Precision``. ``optimizer``: "adamw", "adam", "lamb", "lion", "sgd" (momentum), a
    ``fzero.optim`` transform (its state is measured on meta tensors), or bytes of optimizer state per parameter.
    ``offload``: None, "cpu", "disk"/"nvme"; ``offload_params`` (stage 3, with either offload). ``units``, ``unit_elements`` and
    ``prefetch`` as in ``fzero.compile``; ``sub_group_size`` for disk offload. Collectives are taken one unit at a
    time (``compile``'s default ``bucket_elements=0``): buckets hold more, up to about two buckets of gradient in
    backward, and at stage 3 a bucket of gathered params beside the unit that runs (tests/test_memory.py,
    tests/test_stage3.py), which this estimate does not add. ``shard_frozen=True`` (stage 3, a module): the frozen
    params sharded as ``step.init(..., frozen=fzero.frozen_of(model))`` holds them, 1/N of them in ``frozen``, and each
    unit's gathered with it, in the compute dtype, in ``gathered``.
    """
    _rules.check_stage(stages, api=API)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{API}: world_size must be an int >= 1, got {world_size!r}.")
    if offload is not None and offload not in KINDS:
        raise ValueError(f"{API}: offload must be None or one of {sorted(KINDS)}, got {offload!r}.")
    _rules.check_offload(stages, offload, offload_params, api=API)
    for key, value, low in (("unit_elements", unit_elements, 1), ("sub_group_size", sub_group_size, SHARD_ALIGN)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:  # as compile refuses them
            raise ValueError(f"{API}: {key} must be an int >= {low} (elements), got {value!r}.")
    if units is not None:
        units = check_units(units, API)
    prec = policy(precision, api=API)
    p_bytes = torch.empty((), dtype=prec.compute).element_size()
    state_dtype = torch.float32 if prec.has_master else prec.compute
    opt_name, state_bytes = _optimizer_bytes(optimizer, state_dtype)
    k_bytes = state_bytes + (4 if prec.has_master else 0)
    n = world_size

    sizes = _unit_sizes(model_or_params_or_count, stages, n, units, unit_elements)
    if isinstance(sizes, int):  # a count: Ψ itself, no layout
        psi = numel = sizes
        largest, second, root, root_tie, tie, piece, n_units = 0, 0, 0, 0, 0, 0, None
        padded_units = None  # no layout: the update's casts are counted as if each unit were small
    else:
        psi = sum(u.numel for u in sizes)
        numel = sum(u.padded for u in sizes)  # padded, as the state holds it
        others = sorted((u.padded for u in sizes if u.name != ROOT), reverse=True) + [0, 0]
        root, root_tie = next(((u.padded, u.tie) for u in sizes if u.name == ROOT), (0, 0))
        largest, second, n_units = others[0], others[1], len(sizes)
        tie = max(u.tie for u in sizes)
        piece = max(u.largest_param for u in sizes)
        padded_units = [u.padded for u in sizes]  # in the layout's order, the order the update walks them
        if _rules.accepts("unit_elements", stages):  # size buckets: no root unit, the largest bucket is the largest unit
            largest = max(u.padded for u in sizes)

    params_e, grads_e, owned_e = per_rank(numel, stage=stages, world_size=n)  # elements held per rank; owned: optimizer's
    gathered = p_bytes * (largest + (second if prefetch else 0) + root) if _rules.sharded("params", stages) else 0.0
    if shard_frozen:  # the frozen params gathered with their units (``step.init(..., frozen=...)``)
        sharded_frozen, frozen_gathered = _sharded_frozen_bytes(model_or_params_or_count, stages, n, units, prec.compute, prefetch)
        gathered += frozen_gathered
    if stages <= 1:  # beside the whole gradient (every size bucket lent): the largest of
        backward_extra = p_bytes * max(
            piece,  # a param's gradient, before it is copied into its bucket (the bucket is lent at its first)
            tie,  # a tied parameter's accumulated pieces: the sum so far, the next piece and their sum
            # the collective's output: stage 0 the all-reduced bucket, stage 1 its reduce-scattered shard (1 rank: none)
            (largest if stages == 0 else largest / n) if n > 1 else 0)
    else:
        backward_extra = p_bytes * largest * {2: 2, 3: 1}[stages]

    params, grads, opt = p_bytes * params_e, p_bytes * grads_e, k_bytes * owned_e
    device, host, disk = {"params": params, "grads": grads, "optimizer": opt}, {}, {}
    copies = 0.0  # host bytes that copy a device tensor (none of them where host and device are one memory)
    mapped = 0.0  # disk offload: resident pages of the mapped state files, during the update only
    if offload is not None:
        (disk if KINDS[offload] == "disk" else host)["optimizer"] = device.pop("optimizer")
        if offload_params:
            (disk if KINDS[offload] == "disk" else host)["params"] = device.pop("params")
        no_master = 0 if prec.has_master else p_bytes  # without masters the host updates a copy of the params
        if KINDS[offload] == "disk":
            # sub-groups are cut from each unit's owned shard, the root unit's (often the largest) included
            biggest = max(padded_units) if padded_units else numel  # all of it for a count
            owned_unit = biggest / n if _rules.sharded("optimizer", stages) else biggest
            group = min(math.ceil(sub_group_size / SHARD_ALIGN) * SHARD_ALIGN, owned_unit)  # as DiskOffload rounds it
            copies = (4 + no_master) * group  # one sub-group's fp32 gradient (and params) on the host at a time
            # + the sub-group of the state being updated: its pages of the mapped files (the next one is read ahead
            # into the page cache, MADV_WILLNEED, not into this process; released ones leave it, MADV_DONTNEED)
            mapped = k_bytes * group
            host["transient"] = mapped + copies
        else:
            copies = (4 + no_master) * owned_e  # the fp32 gradient (and params), kept on the host for the optimizer
            host["transient"] = copies
    held = device.get("params", 0.0) + device.get("optimizer", 0.0)
    backward_peak = held + grads + gathered + backward_extra
    if root and stages >= 2:  # the root unit's gradient, reduced after backward: its pieces and their join (or sum)
        gathered_root = p_bytes * root if _rules.sharded("params", stages) else 0.0
        backward_peak = max(backward_peak, held + grads - p_bytes * root / n + gathered_root
                            + p_bytes * (root + max(root, root_tie)))
    bucket = p_bytes * largest if stages == 0 and n > 1 else 0.0  # the all-reduce's output next to its input
    update_peak = held + grads + bucket
    if prec.has_master and padded_units is None:
        update_peak = max(update_peak, held + 4 * owned_e)  # the fp32 gradient of what this rank owns
    elif prec.has_master:  # the update casts unit by unit, in layout order: the fp32 gradients of the units before
        # it, this unit's reduced gradient and its fp32 copy, and the compute-dtype gradients of the units after it
        owned = [p / n if _rules.sharded("optimizer", stages) else p for p in padded_units]
        before, after = 0.0, sum(owned)
        for o in owned:
            after -= o
            update_peak = max(update_peak, held + 4 * (before + o) + p_bytes * (o + after))
            before += o
    device["gathered"] = gathered
    # a module's frozen params: whole on every rank at every stage (fzero shards what trains), and under a bf16/fp16
    # policy a copy in the compute dtype of those of another dtype, made for each step and held through it
    frozen, frozen_cast = _frozen_bytes(model_or_params_or_count, prec.compute)
    if shard_frozen:  # 1/N of them held; each unit's cast as it is gathered, in ``gathered`` (above)
        frozen, frozen_cast = sharded_frozen, 0.0
    device["frozen"] = frozen
    device["transient"] = max(backward_peak, update_peak) - held - grads - gathered + frozen_cast
    # One memory (a CPU-only machine): the host's copies of device tensors are those tensors themselves
    one = {c: device.get(c, 0.0) + host.get(c, 0.0) for c in (*CATEGORIES, "frozen")}
    one["transient"] -= copies
    if mapped:  # the mapped sub-group is resident in the update, not beside backward's peak; on a CPU-only machine
        # the step's buffer pool (fzero.step._pool) keeps stage 3's gathered units through the update too
        # (the fp32 gradient the optimizer reads: the compute-dtype ones are freed as they are converted)
        opt_grads = 4 * owned_e if prec.has_master else grads
        one["transient"] = (max(backward_peak, update_peak, held + opt_grads + gathered + mapped) - held - grads - gathered
                            + frozen_cast)
    if offload is not None and KINDS[offload] == "cpu" and stages >= 2 and not offload_params:
        # the gradient goes to the host unit by unit in backward (``CPUOffload.grad_homes``; plain autograd, the
        # default: under autodiff="func" it stays on the device until the update), into the fp32 host gradient counted
        # above, which is then the rank's gradient: the device holds the unit being differentiated and one reduced shard
        # in flight, the root unit's pieces until the backward ends, and no gradient in the update (one memory: as
        # before, the same tensors)
        device["grads"] = 0.0
        host["grads"], host["transient"] = 4 * owned_e, host["transient"] - 4 * owned_e
        in_backward = held + gathered + backward_extra + p_bytes * largest / n
        if root:
            gathered_root = p_bytes * root if _rules.sharded("params", stages) else 0.0
            in_backward = max(in_backward, held + gathered_root + p_bytes * (root + max(root, root_tie)))
        device["transient"] = in_backward - held - gathered + frozen_cast
    return MemoryEstimate(
        num_params=psi, stages=stages, world_size=n, precision=_precision_name(prec), optimizer=opt_name,
        offload=offload, offload_params=offload_params, device=Bytes(**device), host=Bytes(**host), disk=Bytes(**disk),
        units=n_units, one_memory=Bytes(**one), frozen_params=_frozen_count(model_or_params_or_count),
    )


def _frozen_of(source: Any) -> list[torch.Tensor]:
    """A module's frozen parameters, each once (a params pytree or a count has none: they are the module's)."""
    if not isinstance(source, nn.Module):
        return []
    return [p for p in source.parameters() if not p.requires_grad]


def _frozen_bytes(source: Any, compute: torch.dtype) -> tuple[float, float]:
    """(bytes of a module's frozen parameters, bytes of the compute-dtype copies a step makes of them): under a
    bf16/fp16 policy ``fzero.apply`` casts a floating frozen param of another dtype for the step (an fp32 base under a
    LoRA adapter: one bf16 copy of it per step), as it casts the inputs."""
    frozen = _frozen_of(source)
    held = float(sum(p.numel() * p.element_size() for p in frozen))
    size = torch.empty((), dtype=compute).element_size()
    cast = float(sum(p.numel() * size for p in frozen if p.is_floating_point() and p.dtype != compute)) if compute != torch.float32 else 0.0
    return held, cast


def _sharded_frozen_bytes(source: Any, stages: int, n: int, units: Any, compute: torch.dtype, prefetch: bool) -> tuple[float, float]:
    """``shard_frozen=True``: (bytes of this rank's shards of the frozen params, bytes of them gathered at once: the
    largest unit's, the next one's when prefetched, and the root's, in the compute dtype), grouped as ``step.init``
    groups them (``fzero.layout.build_frozen``: with their unit, one per dtype)."""
    if stages != 3 or not isinstance(source, nn.Module):
        raise ValueError(f"{API}: shard_frozen=True counts a module's frozen params sharded as stage 3 holds them "
                         f"(step.init(..., frozen=...)); it needs stages=3 and the nn.Module, got stages={stages} and a "
                         f"{type(source).__name__}.")
    unit_of = by_container_child if units is None else by_prefixes(units, api=API)
    named = list(source.named_parameters())
    per: dict[tuple[str, torch.dtype], int] = {}  # (unit, dtype) -> elements: a group each, as build_frozen makes them
    for name, p in named:
        if not p.requires_grad:  # with its unit, one of its own where the unit trains nothing (``step.init``)
            key = (unit_of(name), p.dtype)
            per[key] = per.get(key, 0) + p.numel()
    quantum = n * SHARD_ALIGN
    held, by_unit = 0.0, {}  # by_unit: bytes of a unit's frozen params gathered (in the compute dtype under a policy)
    for (u, dtype), numel in per.items():
        padded = math.ceil(numel / quantum) * quantum
        held += padded * dtype.itemsize / n
        gathered_as = compute if compute != torch.float32 else dtype
        by_unit[u] = by_unit.get(u, 0) + padded * gathered_as.itemsize
    root = by_unit.pop(ROOT, 0)
    sizes = sorted(by_unit.values(), reverse=True) + [0, 0]
    return held, float(sizes[0] + (sizes[1] if prefetch else 0) + root)


def _frozen_count(source: Any) -> int:
    return sum(p.numel() for p in _frozen_of(source))


def _precision_name(prec) -> str:
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[prec.compute]
    return name + (" (fp32 master)" if prec.has_master else "")


def _optimizer_bytes(optimizer: Any, dtype: torch.dtype) -> tuple[str, float]:
    """(name, bytes of optimizer state per parameter in ``dtype``), measured from ``init`` on meta tensors."""
    from fzero import optim

    names = {"adamw": lambda: optim.adamw(1e-3), "adam": lambda: optim.adam(1e-3), "lamb": lambda: optim.lamb(1e-3),
             "lion": lambda: optim.lion(1e-4), "sgd": lambda: optim.sgd(1e-3, momentum=0.9)}
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not (optimizer >= 0 and math.isfinite(optimizer)):  # NaN and inf made every total NaN, silently
            raise ValueError(f"{API}: optimizer as a number is bytes of state per parameter (finite, >= 0), got {optimizer!r}.")
        return f"{optimizer:g} B/param optimizer", float(optimizer)
    if isinstance(optimizer, str):
        if optimizer not in names:
            raise ValueError(f"{API}: optimizer must be one of {sorted(names)}, a fzero.optim transform or bytes per "
                             f"parameter, got {optimizer!r}.")
        name, opt = optimizer, names[optimizer]()
    elif callable(getattr(optimizer, "init", None)):
        name, opt = "given optimizer", optimizer
    else:
        raise TypeError(f"{API}: optimizer must be a name such as 'adamw', a fzero.optim transform or bytes per parameter, "
                        f"got {type(optimizer).__name__}.")
    n = 4096
    state = opt.init({"w": torch.empty(n, dtype=dtype, device="meta")})
    # each tensor once: the groups of multi_transform share one state tensor where their states match
    held = {id(t): t for t in _tree.tree_leaves(state) if isinstance(t, torch.Tensor) and t.numel() == n}
    total = sum(t.numel() * t.element_size() for t in held.values())
    return name, total / n


class _Unit(NamedTuple):
    name: str
    numel: int
    padded: int
    tie: int  # see _unit_sizes
    largest_param: int  # elements of the unit's largest parameter


def _unit_sizes(source: Any, stages: int, n: int, units: Any, unit_elements: int) -> int | list[_Unit]:
    """A count, or the layout's units in its order, as ``Step.init`` would build them; ``tie``: the largest, over
    the unit's parameters that a module reaches under several names, of the gradient pieces autograd holds at once
    for it, in elements: it sums them pairwise (the sum so far, the next piece, their sum: the third replaces the
    first), so 2 x numel however many names, one more for a size bucket that holds other params too (0: none)."""
    if isinstance(source, numbers.Real) and not isinstance(source, bool):  # numbers.Real: a numpy count too
        if not (source >= 1 and math.isfinite(source)):
            raise ValueError(f"{API}: a parameter count must be a finite number >= 1, got {source!r}.")
        return int(round(source))
    uses: dict[int, int] = {}
    if isinstance(source, nn.Module):
        named = [(k, p) for k, p in source.named_parameters() if p.requires_grad]
        for _, p in source.named_parameters(remove_duplicate=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    else:
        paths, leaves, _ = _tree.flatten_with_paths(source)
        named = list(zip(paths, leaves))
    if not named or not all(isinstance(t, torch.Tensor) for _, t in named):
        raise TypeError(f"{API}: expected an nn.Module with trainable parameters, a params pytree of tensors, or a count; "
                        f"got {type(source).__name__}.")
    paths, leaves = [k for k, _ in named], [t for _, t in named]
    if _rules.accepts("unit_elements", stages):  # flat buffers by size; else units are modules
        groups = units_by_size(paths, leaves, unit_elements)
    else:
        if units is not None:  # an entry naming no module held nothing, silently (as Step.init refuses it)
            check_units_exist(units, paths, api=API)
        unit_of = by_container_child if units is None else by_prefixes(units, api=API)
        by_name: dict[str, list[int]] = {}
        # in the order of the params pytree's flattening (sorted keys, as ``build_layout`` groups them)
        for i in sorted(range(len(paths)), key=lambda i: paths[i]) if isinstance(source, nn.Module) else range(len(paths)):
            by_name.setdefault(unit_of(paths[i]), []).append(i)
        groups = list(by_name.items())
    quantum = n * SHARD_ALIGN
    out = []
    for name, idx in groups:
        numel = sum(leaves[i].numel() for i in idx)
        # a size bucket of several params is lent at its first gradient, so it is alive beside the pieces and their sum
        more = 1 if len(idx) > 1 and _rules.accepts("unit_elements", stages) else 0
        tie = max(((2 + more) * leaves[i].numel() for i in idx if uses.get(id(leaves[i]), 1) > 1), default=0)
        out.append(_Unit(name, numel, math.ceil(numel / quantum) * quantum, tie, max(leaves[i].numel() for i in idx)))
    return out
