"""The ZeRO transforms: pure functions from a ``Step`` to a ``Step``.

Each one checks what it needs from the step it wraps and says so in its error, so that the order of
composition is part of the API rather than a convention:

    s = fzero.train_step(loss_fn, opt)    # stage 0
    s = fzero.shard_optimizer(s, mesh)    # ZeRO-1
    s = fzero.shard_grads(s)              # ZeRO-2
    s = fzero.shard_params(s)             # ZeRO-3
"""

from __future__ import annotations

import dataclasses

from fzero.dist._mesh import DistMesh, LocalMesh, Mesh
from fzero.step._step import STAGE_NAMES, Step
from fzero.zero._offload import DEFAULT_SUB_GROUP, make_policy
from fzero.layout._units import by_prefixes


def _check_step(step: object, api: str) -> Step:
    if not isinstance(step, Step):
        raise TypeError(f"{api}: expected a Step from fzero.train_step(loss_fn, optimizer), got {type(step).__name__}.")
    return step


def _check_units(units: object, api: str) -> tuple[str, ...] | None:
    if units is None:
        return None
    if isinstance(units, str) or not isinstance(units, (tuple, list)) or not all(isinstance(u, str) for u in units):
        raise TypeError(f"{api}: units must be a tuple of module paths such as ('blocks.0', 'blocks.1'), got {units!r}.")
    by_prefixes(units, api=api)
    return tuple(units)


def shard_optimizer(step: Step, mesh: Mesh | None = None) -> Step:
    """ZeRO-1: each rank keeps and updates only its 1/N shard of the optimizer state.

    Gradients are reduce-scattered (not all-reduced), each rank updates its shard of the params, and the
    params are all-gathered back: the same 2Ψ·(N-1)/N elements per step as an all-reduce.
    ``mesh`` may be omitted when the step already has one; if both are given they must agree.
    """
    step = _check_step(step, "fzero.shard_optimizer")
    if step.stage != 0:
        raise ValueError(f"fzero.shard_optimizer: the step is already {STAGE_NAMES[step.stage]}; apply shard_optimizer once, to a stage-0 step from fzero.train_step.")
    if mesh is not None and not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.shard_optimizer: mesh must be fzero.local_mesh(n) or fzero.dist_mesh(), got {mesh!r}.")
    if mesh is not None and step.mesh is not None and mesh != step.mesh:
        raise ValueError(f"fzero.shard_optimizer: the step already runs on {step.mesh!r} and mesh={mesh!r} differs. Pass one mesh, once.")
    return dataclasses.replace(step, mesh=mesh if mesh is not None else step.mesh, stage=1)


def shard_grads(step: Step, *, units: tuple[str, ...] | None = None) -> Step:
    """ZeRO-2: each unit's gradient is reduce-scattered during backward, so no rank holds the whole gradient.

    Units are modules (``units``: module paths, see ``fzero.units_of``; default each child of a
    ``ModuleList``/``Sequential``), and ``loss_fn`` must run the model through ``fzero.apply`` (or read
    ``params[name]``) so that each unit's reduction is attached when the forward reaches it.
    """
    step = _check_step(step, "fzero.shard_grads")
    if step.stage != 1:
        raise ValueError(
            f"fzero.shard_grads: needs fzero.shard_optimizer inside it (gradient shards are only useful to a sharded "
            f"optimizer), but the step is {STAGE_NAMES[step.stage]}. Write fzero.shard_grads(fzero.shard_optimizer(step, mesh))."
        )
    return dataclasses.replace(step, stage=2, units=_check_units(units, "fzero.shard_grads"))


def shard_params(step: Step, *, units: tuple[str, ...] | None = None, prefetch: bool = True, remat: bool = False) -> Step:
    """ZeRO-3: each rank holds only its 1/N shard of the params; each unit is gathered just before it runs.

    Each unit's forward runs once, with its graph, as in plain PyTorch; its gathered params are freed
    after the forward and gathered again just before its backward, then its gradient is reduce-scattered.
    ``units``: module paths (see ``fzero.units_of``); default, each child of a ``ModuleList``/``Sequential``.
    ``prefetch``: gather the next unit while the current one computes, in forward and in backward (order
    recorded on the first step). ``remat=True``: recompute each unit in backward (``fzero.remat``, which
    gathers it again) instead of keeping its activations: less memory, one more forward per unit. As with
    ``torch.utils.checkpoint``, a forward with side effects then has them twice (a KV cache appended to
    twice, BatchNorm statistics updated twice, hooks run twice): turn them off (HF: ``use_cache=False``).
    """
    step = _check_step(step, "fzero.shard_params")
    if step.stage != 2:
        raise ValueError(
            f"fzero.shard_params: needs fzero.shard_grads inside it (sharded params need sharded gradients and optimizer "
            f"state), but the step is {STAGE_NAMES[step.stage]}. Write fzero.shard_params(fzero.shard_grads(fzero.shard_optimizer(step, mesh)))."
        )
    units = _check_units(units, "fzero.shard_params") if units is not None else step.units
    if not isinstance(prefetch, bool):
        raise TypeError(f"fzero.shard_params: prefetch must be True or False, got {prefetch!r}.")
    if not isinstance(remat, bool):
        raise TypeError(f"fzero.shard_params: remat must be True or False, got {remat!r}.")
    return dataclasses.replace(step, stage=3, units=units, prefetch=prefetch, remat=remat)


def offload(step: Step, where: str, *, params: bool = False, dir: str | None = None, sub_group_size: int = DEFAULT_SUB_GROUP) -> Step:
    """Optimizer state and fp32 master weights off the device: ``"cpu"`` (ZeRO-Offload) or ``"disk"``/``"nvme"``
    (ZeRO-Infinity: files under ``dir``, updated in sub-groups of ``sub_group_size`` elements).

    ``params=True`` (stage 3): the param shards live there too: on the host with ``"cpu"``, in mapped
    files with ``"disk"``, read in when a unit is gathered and released after. Needs a sharded optimizer
    (stages 1-3), as DeepSpeed's offload does. A model larger than memory also needs a streaming init:
    build it on the meta device and pass ``materialize=`` to ``step.init``.
    """
    step = _check_step(step, "fzero.offload")
    if step.stage == 0:
        raise ValueError(
            "fzero.offload: needs fzero.shard_optimizer inside it (each rank offloads its shard of the optimizer state), "
            "but the step is stage 0. Write fzero.offload(fzero.shard_optimizer(step, mesh), 'cpu'), or compile(stages>=1, offload=...)."
        )
    if step.offload is not None:
        raise ValueError(f"fzero.offload: the step already offloads to {step.offload.where!r}; apply offload once.")
    policy = make_policy(where, params=params, dir=dir, sub_group_size=sub_group_size, api="fzero.offload")
    if policy.params and step.stage != 3:
        raise ValueError(f"fzero.offload: params=True offloads param shards, which exist at stage 3 only; the step is {STAGE_NAMES[step.stage]}.")
    if policy.where == "disk" and not step.donate:
        raise ValueError("fzero.offload: offload='disk' keeps the optimizer state in files that each step updates, so an "
                         "old state cannot be kept (donate=False). Build the step with donate=True.")
    return dataclasses.replace(step, offload=policy)
