"""``offload``: the sharded optimizer state and fp32 masters off the device (ZeRO-Offload, ZeRO-Infinity).

It sets ``OptStateSharded.offload`` to a policy, ``CPUOffload`` or ``DiskOffload``
(``fzero.zero._policies``), which says where the state lives and runs the optimizer there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fzero._rules import check_disk_donate
from fzero.step import Step, as_step
from fzero.zero._policies import DEFAULT_SUB_GROUP, CPUOffload, DiskOffload, make_policy


def offload(step: Step, where: "str | CPUOffload | DiskOffload", *, params: bool = False, dir: str | None = None,
            sub_group_size: int = DEFAULT_SUB_GROUP) -> Step:
    """Optimizer state and fp32 master weights off the device: ``"cpu"`` (ZeRO-Offload) or ``"disk"``/``"nvme"``
    (ZeRO-Infinity: files under ``dir``, updated in sub-groups of ``sub_group_size`` elements), or a policy
    object with those settings on it (``fzero.CPUOffload(params=True)``, ``fzero.DiskOffload(dir)``).

    ``params=True`` (stage 3): the param shards live there too: on the host with ``"cpu"``, in mapped
    files with ``"disk"``, read in when a unit is gathered and released after. Needs a sharded optimizer
    (stages 1-3), as DeepSpeed's offload does. A model larger than memory also needs a streaming init:
    build it on the meta device and pass ``materialize=`` to ``step.init``.
    """
    step = as_step(step, "fzero.offload")
    if not step.opt_state.sharded:
        raise ValueError(
            "fzero.offload: needs fzero.shard_optimizer inside it (each rank offloads its shard of the optimizer state), "
            "but the step is stage 0. Write fzero.offload(fzero.shard_optimizer(step, mesh), 'cpu'), or compile(stages>=1, offload=...)."
        )
    if step.offload is not None:
        raise ValueError(f"fzero.offload: the step already offloads to {step.offload.where!r}; apply offload once.")
    policy = make_policy(where, params=params, dir=dir, sub_group_size=sub_group_size, api="fzero.offload")
    if policy.params and not step.params.sharded:
        raise ValueError(f"fzero.offload: params=True offloads param shards, which exist at stage 3 only; the step is {step.stage_name}.")
    check_disk_donate(policy.where, step.donate, api="fzero.offload")
    opt_state: Any = step.opt_state  # a frozen dataclass (OptStateSharded), typed by its Protocol
    return dataclasses.replace(step, opt_state=dataclasses.replace(opt_state, offload=policy))
