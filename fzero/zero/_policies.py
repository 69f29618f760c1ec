"""Offload policies: where a sharded optimizer state and its fp32 masters live, as types.

As FSDP2 takes ``CPUOffloadPolicy`` rather than a flag, ``fzero.offload`` attaches one of these to
``OptStateSharded``, which hands it the three things that differ by place: making the state at init
(``init``), holding a master copy (``hold``), and running the optimizer (``apply``). Nothing branches on
a place name.

- ``CPUOffload`` (ZeRO-Offload): the optimizer state and masters in host memory, pinned when the params
  are on CUDA so that copies can overlap; the optimizer runs on the host (torch's fused CPU AdamW). On a
  CPU-only machine host and device are one memory: the copies are the tensors themselves, so the path
  run there is the one run on a GPU machine, minus the copies.
- ``DiskOffload`` (ZeRO-Infinity): every param-shaped leaf of the state in a mapped file under ``dir``,
  updated in sub-groups (``fzero.zero._offload``).

With ``params=True`` (stage 3) the param shards live there too, copied to the device before each gather.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from typing import Any, Callable, ClassVar

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from fzero.layout import SHARD_ALIGN
from fzero.zero._offload import DiskOptState, disk_update, gather_master, init_disk, spill
from fzero.zero._pinned import pinned_empty

DEFAULT_SUB_GROUP = 1 << 24  # elements per sub-group (DeepSpeed's sub_group_size default is 1e9; RAM here is small)
KINDS = {"cpu": "cpu", "disk": "disk", "nvme": "disk"}


def host_empty(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor like ``t``: page-locked where CUDA is and ``pin``, in memory of exact size
    (``fzero.zero._pinned``: not torch's pinned allocator, which rounds each block up to a power of two)."""
    if pin and torch.cuda.is_available():
        return pinned_empty(t.numel(), t.dtype).view(t.shape)
    return torch.empty(t.shape, dtype=t.dtype)


def to_host(t: torch.Tensor, *, pin: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host copy of ``t`` (pinned where CUDA is, so the copy is asynchronous: wait on the stream before the host
    reads it), into ``out`` when given; ``t`` itself when it is on the host."""
    if t.device.type == "cpu":
        return t
    return (host_empty(t, pin=pin) if out is None else out).copy_(t, non_blocking=True)


def _host_params(params: dict[str, torch.Tensor], pin: bool, *, into: dict | None = None) -> dict[str, torch.Tensor]:
    """Host copies of every tensor, issued together and waited for once: the host reads them next. ``into``: the
    host buffers to copy into, by key (``_kept``); fresh ones without."""
    out = {k: to_host(p, pin=pin, out=None if into is None else into[k]) for k, p in params.items()}
    for k, p in params.items():
        if out[k] is not p:  # some copy came from CUDA: it is asynchronous into pinned memory until waited for
            torch.cuda.current_stream(p.device).synchronize()
            break
    return out


# Host buffers a CPU-offloaded state copies into at every step (the gradient; without masters, the params), one per
# unit, made at the first step and kept for as long as the tensor they belong to (the unit's master or param shard)
# lives: so the host holds one gradient, of exact size, and no step allocates or page-locks memory again. Held in a
# weak registry keyed by that tensor (``_owned``), as the gradient homes below are, not in the tensor's ``__dict__``:
# ``torch.save`` and ``copy.deepcopy`` carry a tensor's ``__dict__``, so a saved state would hold a gradient-sized
# buffer beside each master, and ``torch.load``'s default ``weights_only=True`` would refuse the file.
_KEPT: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_REGISTRY_LOCK = threading.Lock()  # the ranks of a local mesh make theirs at once, on their own tensors


def _owned(registry: WeakTensorKeyDictionary, owner: torch.Tensor) -> dict:
    """``owner``'s entry in ``registry`` (made empty on first use), under the lock that the ranks of a local mesh share."""
    with _REGISTRY_LOCK:
        held = registry.get(owner)
        if held is None:
            held = registry[owner] = {}
        return held


def _kept(owners: dict[str, torch.Tensor], like: dict[str, torch.Tensor], role: str, pin: bool) -> dict[str, torch.Tensor] | None:
    """For each key, the host buffer of ``role`` kept for ``owners[key]`` (for a view, for the tensor it views:
    stages 1-2 hand the optimizer fresh views of the units' buffers at every step), shaped like ``like[key]``;
    None when nothing is on a device (host and device are one memory: no copies are made)."""
    if all(t.device.type == "cpu" for t in like.values()):
        return None
    out = {}
    for k, t in like.items():
        base = owners[k]._base
        owner = owners[k] if base is None else base  # a shard's view: its unit's buffer
        kept = _owned(_KEPT, owner)  # one rank's tensors: no other thread reaches this entry
        buf = kept.get((role, k))  # by unit too: units could view one buffer
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = kept[(role, k)] = host_empty(t, pin=pin)
        out[k] = buf
    return out


def kept_of(owner: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
    """The host buffers kept for ``owner`` (a master or param shard, or the buffer it views), by (role, unit)."""
    with _REGISTRY_LOCK:
        return dict(_KEPT.get(owner) or {})


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives apart from the host (a GPU's memory): only then has a gradient a way to go to the host.
    A function of its own so that tests can route a CPU step's gradients through the host buffers as well."""
    return t.device.type != "cpu"


# The gradient homes of each state's flat buffer (``grad_home``): (lo, hi) -> host buffer, by flat, held weakly, so
# that they live as long as the flat and go with it (as ``_KEPT``'s, and for the same reason). A copy of a flat,
# pickled or deep-copied, starts with none and makes its own.
_HOMES: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def grad_home(owner: torch.Tensor, lo: int, hi: int, *, pin: bool) -> torch.Tensor:
    """The host buffer a unit's gradient shard goes to as backward makes it: fp32, ``hi - lo`` elements, page-locked
    where CUDA is, made at the first step and kept for ``owner`` (the state's flat of the unit: its whole buffer at
    stage 2, the rank's shard at stage 3) for as long as it lives, so no step allocates or page-locks one again."""
    homes = _owned(_HOMES, owner)
    buf = homes.get((lo, hi))
    if buf is None:
        buf = homes[(lo, hi)] = host_empty(torch.empty(hi - lo, dtype=torch.float32, device="meta"), pin=pin)
    return buf


def grad_homes_of(owner: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """The gradient homes kept for ``owner`` (a state's flat), by range; empty before its first routed step."""
    with _REGISTRY_LOCK:
        return dict(_HOMES.get(owner) or {})


def _copy_back(params: dict[str, torch.Tensor], host: dict[str, torch.Tensor]) -> None:
    """The updated host params into the device params (nothing where they are the same tensors)."""
    with torch.no_grad():
        for k, p in params.items():
            if host[k] is not p:
                p.copy_(host[k], non_blocking=True)


def _check_params_flag(params: Any, api: str) -> None:
    if not isinstance(params, bool):
        raise TypeError(f"{api}: params (offload_params) must be True or False, got {params!r}.")


@dataclasses.dataclass(frozen=True)
class CPUOffload:
    """ZeRO-Offload: this rank's optimizer state and fp32 masters in host memory; the optimizer runs there.

    ``params``: stage 3 keeps the param shards on the host too. ``pin_memory``: pinned host buffers
    (only where CUDA is; page-locked memory is what lets host<->device copies overlap with compute).
    """

    params: bool = False
    pin_memory: bool = True
    where: ClassVar[str] = "cpu"

    def __post_init__(self) -> None:
        _check_params_flag(self.params, "fzero.CPUOffload")
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"fzero.CPUOffload: pin_memory must be True or False, got {self.pin_memory!r}.")

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """A master copy of ``t`` in host memory (always a new tensor)."""
        held = _host_params({"t": t}, self.pin_memory)["t"]
        return held.clone() if held is t else held

    def init(self, optimizer: Any, owned: dict[str, torch.Tensor], master: dict | None, flats: dict[str, torch.Tensor], rank: int):
        from fzero.step import MasterState

        if master is not None:  # already on the host (``hold``)
            opt_state = MasterState(master, optimizer.init(master))
        else:  # the state is made over host copies, so it lives on the host: the buffers the steps will use
            opt_state = optimizer.init(_host_params(owned, self.pin_memory, into=_kept(owned, owned, "param", self.pin_memory)))
        if self.params:
            flats = _host_params(flats, self.pin_memory)
        return opt_state, flats

    def apply(self, optimizer: Any, grads: dict, opt_state: Any, params: dict, segments: Any) -> Any:
        from fzero.step import apply_update

        # each unit's gradient into the host buffer kept for it: one gradient on the host, not one more per step
        owners = opt_state.master if opt_state_has_masters(opt_state) else params
        grads = _host_params(grads, self.pin_memory, into=_kept(owners, grads, "grad", self.pin_memory))
        if opt_state_has_masters(opt_state):
            host = params
        else:
            host = _host_params(params, self.pin_memory, into=_kept(params, params, "param", self.pin_memory))
        opt_state = apply_update(optimizer, grads, opt_state, host, segments)
        _copy_back(params, host)
        return opt_state

    def grad_homes(self, shards: dict[str, tuple[torch.Tensor, int, int]]) -> dict[str, torch.Tensor] | None:
        """Where each unit's gradient shard goes as backward makes it (stages 2-3, plain autograd): a host buffer per
        unit (``grad_home``), so that the device never holds the whole gradient: ZeRO-Offload copies each reduced
        partition to the host during the backward, and the device keeps the params alone. ``shards``: unit ->
        (the state's flat that keeps the buffer, the rank's range in it). None where the params are on the host
        already (a CPU machine, ``params=True``): the gradient is there as it is made."""
        if not any(_on_device(flat) for flat, _, _ in shards.values()):
            return None
        return {name: grad_home(flat, lo, hi, pin=self.pin_memory) for name, (flat, lo, hi) in shards.items()}

    def release(self, opt_state: Any) -> Callable[[torch.Tensor], None] | None:
        return None

    def has_masters(self, opt_state: Any) -> bool:
        return opt_state_has_masters(opt_state)  # masters are a MasterState on the host

    def masters(self, opt_state: Any, layout: Any) -> dict[str, torch.Tensor]:
        return opt_state.master


@dataclasses.dataclass(frozen=True)
class DiskOffload:
    """ZeRO-Infinity: this rank's optimizer state (and masters) in mapped files under ``dir``, updated in
    sub-groups of ``sub_group_size`` elements (rounded up to a multiple of the shard alignment).

    ``params``: stage 3 keeps the param shards in mapped files too.
    """

    dir: str
    params: bool = False
    sub_group_size: int = DEFAULT_SUB_GROUP
    where: ClassVar[str] = "disk"

    def __post_init__(self) -> None:
        api = "fzero.DiskOffload"
        _check_params_flag(self.params, api)
        size = self.sub_group_size
        if isinstance(size, bool) or not isinstance(size, int) or size < SHARD_ALIGN:
            raise ValueError(f"{api}: sub_group_size must be an int >= {SHARD_ALIGN} (elements per sub-group), got {size!r}.")
        if size % SHARD_ALIGN:
            object.__setattr__(self, "sub_group_size", math.ceil(size / SHARD_ALIGN) * SHARD_ALIGN)
        if self.dir is None:
            raise ValueError(f"{api}: needs dir=, a directory for the optimizer-state files (e.g. a local NVMe mount); "
                             f"with compile or fzero.offload, pass offload_dir=.")
        path = os.fspath(self.dir)
        if not os.path.isdir(path):
            raise ValueError(f"{api}: dir={path!r} does not exist or is not a directory; create it first.")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"{api}: dir={path!r} is not writable by this process; pick a directory it can write.")
        object.__setattr__(self, "dir", path)

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """A master copy of ``t`` in a temporary file under ``dir`` (``spill``): no RAM until ``init`` moves it into
        the rank's store, whatever the model's size."""
        return spill(t, self.dir)

    def init(self, optimizer: Any, owned: dict[str, torch.Tensor], master: dict | None, flats: dict[str, torch.Tensor], rank: int):
        opt_state = init_disk(optimizer, self, _host_params(owned, False), master, rank)
        if self.params:  # stage 3: the shards become files, mapped (see _offload.py)
            flats = {name: opt_state.store.map(f"param/{name}", t.cpu()) for name, t in flats.items()}
        return opt_state, flats

    def apply(self, optimizer: Any, grads: dict, opt_state: DiskOptState, params: dict, segments: Any) -> DiskOptState:
        # sub-group by sub-group to and from the device (``disk_update``): RAM holds sub-groups, whatever the model
        return disk_update(optimizer, opt_state, grads, params, self, segments)

    def release(self, opt_state: DiskOptState) -> Callable[[torch.Tensor], None]:
        return opt_state.store.release

    def grad_homes(self, shards: dict[str, tuple[torch.Tensor, int, int]]) -> None:
        """None: the gradient stays where backward makes it; the update takes it sub-group by sub-group (``disk_update``),
        so RAM holds sub-groups, whatever the model's size."""
        return None

    def has_masters(self, opt_state: DiskOptState) -> bool:
        return opt_state.master  # the fp32 masters are files of the store, or there are none

    def masters(self, opt_state: DiskOptState, layout: Any) -> dict[str, torch.Tensor]:
        if not opt_state.master:
            raise ValueError("fzero.DiskOffload: this state keeps no fp32 masters (its params are in fp32, and are the masters).")
        return gather_master(opt_state, [u.name for u in layout.units])

    def mapped_masters(self, opt_state: DiskOptState, layout: Any) -> tuple[dict[str, torch.Tensor], int, Callable]:
        """The fp32 masters as their mapped files (nothing read yet), the elements to read at a time (a sub-group) and
        the store's ``release``: for the first step's comparison of the params with their masters
        (``check_params_hold_masters``), which ``masters`` would read whole into RAM (why it was not made here, and a
        forward's ``.data`` write was lost under disk offload, silently)."""
        store = opt_state.store
        found = {u.name: store.tensor(f"master/{u.name}") for u in layout.units if store.sizes.get(f"master/{u.name}")}
        return found, self.sub_group_size, store.release


POLICIES = (CPUOffload, DiskOffload)


def opt_state_has_masters(opt_state: Any) -> bool:
    from fzero.step import MasterState

    return isinstance(opt_state, MasterState)


def make_policy(where: Any, *, params: bool = False, dir: Any = None, sub_group_size: Any = DEFAULT_SUB_GROUP, api: str) -> CPUOffload | DiskOffload:
    """The policy for ``where``: a policy object as it is, or "cpu" / "disk" / "nvme" with the keyword settings."""
    if isinstance(where, POLICIES):
        given = {k: v for k, v in (("params", params), ("offload_dir", dir), ("sub_group_size", sub_group_size))
                 if v not in (False, None, DEFAULT_SUB_GROUP)}
        if given:
            raise ValueError(f"{api}: where={where!r} is a policy object, which carries its own settings; {sorted(given)} "
                             f"would be ignored. Set them on the policy (e.g. fzero.DiskOffload(dir, params=True)).")
        return where
    if where not in KINDS:
        raise ValueError(f"{api}: where must be one of {sorted(KINDS)}, got {where!r}. A policy object "
                         f"(fzero.CPUOffload(...), fzero.DiskOffload(dir)) is taken too.")
    _check_params_flag(params, api)
    if KINDS[where] == "cpu":
        if dir is not None:
            raise ValueError(f"{api}: offload_dir={dir!r} only applies to offload='disk'/'nvme', not {where!r}.")
        # sub_group_size is accepted (DeepSpeed configs carry it with cpu offload) and changes no number:
        # cpu offload updates each shard whole, so it has nothing to size.
        return CPUOffload(params=params)
    if dir is None:
        raise ValueError(f"{api}: offload={where!r} needs offload_dir=, a directory for the optimizer-state files (e.g. a local NVMe mount).")
    try:
        return DiskOffload(dir, params=params, sub_group_size=sub_group_size)
    except (ValueError, TypeError, PermissionError) as e:  # the same check, named after the caller's keywords
        raise type(e)(str(e).replace("fzero.DiskOffload", api).replace("dir=", "offload_dir=")) from None
