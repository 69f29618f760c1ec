"""Offload: optimizer state and master weights in host memory (ZeRO-Offload) or in files (ZeRO-Infinity).

The policies (``CPUOffload``, ``DiskOffload``) are in ``_policies.py``; ``fzero.offload`` attaches one.
This module holds what the disk policy runs on: the store of mapped files and the sub-group update.

- ``"cpu"``: the optimizer state and fp32 masters are allocated on the host and the optimizer runs
  there (torch's fused CPU AdamW); gradients go to the host and updated params come back. On a CPU-only
  machine host and device are the same memory, so the copies are no-ops and the code path is the
  same one, tested; on CUDA the host buffers are pinned so the copies can be asynchronous.
- ``"disk"`` (alias ``"nvme"``): every param-shaped leaf of the optimizer state (Adam's m and v, the
  fp32 master) lives in a file under ``offload_dir``, one file per unit and leaf, created fresh for the
  run in its own directory and removed when no state refers to it any more. Each file is mapped into
  memory (``MAP_SHARED``) and updated in place through the mapping. The update walks each unit in
  sub-groups of ``sub_group_size`` elements: the kernel reads the next sub-group ahead
  (``MADV_WILLNEED``) while the optimizer updates the current one, whose pages are then given back
  (``MADV_DONTNEED``; dirty pages go to the file, nothing is lost), so about one sub-group is resident
  at a time. The optimizer runs on each sub-group as on any leaf, so element-wise optimizers give the
  same numbers as without offload (sub-groups start on multiples of ``SHARD_ALIGN``); a layer-wise
  one (LAMB) cannot see whole parameters there and is refused.
- ``"disk"`` with ``params=True`` (stage 3): each param shard is a mapped file too. Its pages come in
  when a gather reads the shard (the prefetch of the next unit reads ahead) and are given back as soon
  as the gather or the unit's update is done, so the shard costs no resident memory between uses.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from typing import Any, NamedTuple

import optree
import torch

from fzero.zero import _offload_dir


# -- files ------------------------------------------------------------------------------------------


class DiskStore:
    """One directory of flat files for one rank, ``key -> file``, each mapped into memory (``MAP_SHARED``).

    A mapped file is used as an ordinary tensor: the kernel reads its pages in when they are touched
    (``prefetch`` asks for them ahead of time) and writes dirty ones back to the file; ``release``
    unmaps resident pages from this process, so they stop counting as its memory without losing data.
    Updating in place through the mapping saves the two copies a read()/write() round trip would make
    (measured 4.3x faster for AdamW's m and v with the page cache warm). Removed with the last state using it.
    """

    def __init__(self, root: str, rank: int) -> None:
        self.dir, lock = _offload_dir.make(root, rank)  # held while this process lives (see _offload_dir)
        self.sizes: dict[str, int] = {}
        self.tensors: dict[str, torch.Tensor] = {}  # key -> the mapped tensor (optimizer state, masters: fp32)
        self.maps: dict[int, mmap.mmap] = {}  # storage address -> the mapping of its file
        self._finalizer = weakref.finalize(self, _remove, self.dir, self.maps, lock)  # also at interpreter exit

    def __reduce__(self) -> tuple:
        """Refused: a pickle (``torch.save(state, f)``, ``copy.deepcopy``) of a disk-offloaded state would need this
        store's mappings, which pickle cannot hold (it failed with "cannot pickle 'mmap.mmap' object", naming neither
        the state nor a fix), and its files are removed with the last state using them: a copy could not have them."""
        raise TypeError(
            f"fzero.DiskOffload: a disk-offloaded state cannot be pickled (torch.save, pickle, copy.deepcopy): its "
            f"optimizer state (and, with params=True, its param shards) lives in files under {self.dir}, which are removed "
            f"with the last state using them. Save it with fzero.checkpoint.save(path, state) and resume with "
            f"fzero.checkpoint.load(path, like=step), which loads it with or without offload."
        )

    def close(self) -> None:
        """Remove the files now (an ``init`` that failed half-way); otherwise the last state using them does."""
        self._finalizer()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is one of this store's files (mapped), not RAM."""
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self.maps

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key.replace("/", "__") + ".bin")

    def map(self, key: str, source: torch.Tensor) -> torch.Tensor:
        """``source`` written to a fresh file, and a tensor of its dtype whose memory is that file."""
        if source.numel() == 0:  # a unit with no trainable slot (frozen params alone): an empty file cannot be mapped
            self.sizes[key] = 0
            return torch.empty(0, dtype=source.dtype)
        path = self.path(key)
        with open(path, "wb") as f:
            f.write(_bytes(source.detach().contiguous()))
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), 0)
        t = torch.frombuffer(mapping, dtype=source.dtype)  # keeps the mapping alive as long as the tensor lives
        self.maps[t.untyped_storage().data_ptr()] = mapping
        mapping.madvise(mmap.MADV_DONTNEED)  # written through the page cache; nothing resident in this process
        self.sizes[key] = t.numel()
        return t

    def create(self, key: str, source: torch.Tensor) -> None:
        """A file of fp32 values (optimizer state, master weights)."""
        self.tensors[key] = self.map(key, source.detach().to(torch.float32))

    def tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def read(self, key: str, start: int, out: torch.Tensor) -> torch.Tensor:
        t = self.tensors[key]
        out.copy_(t[start : start + out.numel()])
        self.release(t, start, start + out.numel())
        return out

    def write(self, key: str, start: int, data: torch.Tensor) -> None:
        t = self.tensors[key]
        t[start : start + data.numel()].copy_(data)
        self.release(t, start, start + data.numel())

    def load(self, key: str) -> torch.Tensor:
        return self.read(key, 0, torch.empty(self.sizes[key], dtype=torch.float32))

    def release(self, t: torch.Tensor, start: int = 0, stop: int | None = None) -> None:
        """Give the resident pages of a mapped tensor (elements ``start:stop``) back; no-op for other tensors."""
        self._advise(t, start, stop, mmap.MADV_DONTNEED)

    def prefetch(self, key: str, start: int, stop: int) -> None:
        """Ask the kernel to read elements ``start:stop`` of a file ahead, while the caller computes."""
        self._advise(self.tensors[key], start, stop, mmap.MADV_WILLNEED)

    def _advise(self, t: torch.Tensor, start: int, stop: int | None, option: int) -> None:
        mapping = self.maps.get(t.untyped_storage().data_ptr())
        if mapping is None:
            return
        size = t.element_size()
        stop = t.numel() if stop is None else stop
        first = (t.storage_offset() + start) * size // mmap.PAGESIZE * mmap.PAGESIZE  # madvise wants page-aligned starts
        length = (t.storage_offset() + stop) * size - first
        if length > 0:
            mapping.madvise(option, int(first), int(length))


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor of any dtype (numpy has no bfloat16, so through uint8)."""
    array: Any = t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()
    return memoryview(array).cast("B")


# -- masters before the store exists ---------------------------------------------------------------------------------

_SPILLED: dict[int, mmap.mmap] = {}  # storage address -> the mapping of a spilled tensor's unlinked file


def spill(t: torch.Tensor, root: str) -> torch.Tensor:
    """A copy of ``t`` whose memory is an unlinked temporary file under ``root``, mapped, with nothing resident.

    Why: ``Step.init`` makes the fp32 masters unit by unit and hands them all to ``init_disk`` at the end, before
    which the rank's store does not exist; held in RAM meanwhile they would cost 4 bytes per owned parameter, the
    size of the model, where disk offload is used because RAM is short. The file is freed with the last tensor
    using it (``init_disk`` reads each unit once, into the store's file, and gives its pages back: ``unspill``)."""
    src = t.detach().contiguous().cpu()
    if src.numel() == 0:
        return src.clone()
    try:
        with tempfile.TemporaryFile(dir=root, prefix="fzero-master-") as f:
            f.write(_bytes(src))
            f.flush()
            mapping = mmap.mmap(f.fileno(), 0)  # the mapping keeps the unlinked file; its descriptor can close
    except OSError as e:
        raise OSError(
            f"fzero.offload('disk'): writing an fp32 master ({_mib(src.numel() * src.element_size())}) to a temporary "
            f"file under offload_dir={root!r} at init failed ({e}). Free space there (init needs about 16 bytes per "
            f"parameter a rank owns: masters, Adam's m and v, and the masters' temporary copy), or point offload_dir "
            f"at a larger disk."
        ) from e
    mapping.madvise(mmap.MADV_DONTNEED)  # written through the page cache; nothing resident in this process
    out = torch.frombuffer(mapping, dtype=src.dtype).view(src.shape)
    address = out.untyped_storage().data_ptr()
    _SPILLED[address] = mapping
    weakref.finalize(out.untyped_storage(), _SPILLED.pop, address, None)
    return out


def unspill(t: torch.Tensor) -> None:
    """Give back the resident pages of a spilled tensor (read since); no-op for any other tensor."""
    mapping = _SPILLED.get(t.untyped_storage().data_ptr())
    if mapping is not None:
        mapping.madvise(mmap.MADV_DONTNEED)


def _remove(path: str, maps: dict[int, mmap.mmap], lock: int | None) -> None:
    maps.clear()  # the mappings themselves close when the tensors viewing them are gone
    _offload_dir.release(path, lock)


class DiskOptState(NamedTuple):
    """The optimizer state of a rank under disk offload. Param-shaped leaves are in ``store``'s files."""

    store: DiskStore
    small: Any  # the optimizer state's other leaves (step counts), one copy: every sub-group's are equal
    master: bool  # the fp32 master weights are in the files too (key "master/<unit>")


def _is_param_leaf(path: tuple) -> bool:
    return len(path) > 0 and path[-1] == "g"


def init_disk(optimizer: Any, policy: Any, owned: dict[str, torch.Tensor], masters: dict | None, rank: int) -> DiskOptState:
    """Write the initial optimizer state (and masters) of what this rank owns into fresh files."""
    store = DiskStore(policy.dir, rank)
    try:
        return _fill(store, optimizer, policy, owned, masters, rank)
    except BaseException:  # a failed init leaves nothing in offload_dir (the state it was making is lost anyway)
        store.close()
        raise


def _fill(store: DiskStore, optimizer: Any, policy: Any, owned: dict[str, torch.Tensor], masters: dict | None, rank: int) -> DiskOptState:
    small: Any = None
    for i, (name, t) in enumerate(owned.items()):
        source = masters[name] if masters is not None else t
        state = optimizer.init({"g": source})
        paths, leaves, _ = optree.tree_flatten_with_path(state)
        if i == 0:  # before anything is written: the files must fit
            _check_space(policy, owned, sum(map(_is_param_leaf, paths)) + (masters is not None), rank)
        for path, leaf in zip(paths, leaves):
            if _is_param_leaf(path):
                store.create(_key(path, name), leaf)
        small = optree.tree_map(lambda x: x, state)  # structure + the small leaves; param leaves are dropped on use
        if masters is not None:
            store.create(f"master/{name}", source)
            unspill(source)  # DiskOffload.hold's temporary file: its pages, read just now, go back
    small = optree.tree_map_with_path(lambda p, x: None if _is_param_leaf(p) else x, small, none_is_leaf=True)
    return DiskOptState(store, small, masters is not None)


def _check_space(policy: Any, owned: dict[str, torch.Tensor], fp32_files_per_unit: int, rank: int) -> None:
    """A clear error up front instead of running out of disk space while writing (or, mapped, on first touch)."""
    need = sum(t.numel() for t in owned.values()) * 4 * fp32_files_per_unit
    if policy.params:
        need += sum(t.numel() * t.element_size() for t in owned.values())
    free = shutil.disk_usage(policy.dir).free
    if need > free:
        what = "optimizer state" + (" and param shards" if policy.params else "")
        raise OSError(
            f"fzero.offload('disk'): rank {rank} needs {_mib(need)} in offload_dir={policy.dir!r} for its {what}, "
            f"but only {_mib(free)} are free there. Free space, point offload_dir at a larger disk, or shard "
            f"over more ranks (each rank writes only its share)."
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 else f"{nbytes:,} bytes"


def _key(path: tuple, unit: str) -> str:
    return "opt/" + "/".join(str(p) for p in path[:-1]) + f"/{unit}"


def disk_update(optimizer: Any, state: DiskOptState, grads: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                policy: Any, segments_guard: Any) -> DiskOptState:
    """One optimizer step over the files, sub-group by sub-group, in place through their mappings.

    While a sub-group is updated the kernel reads the next one ahead (``MADV_WILLNEED``); once updated,
    its pages are released, so only about one sub-group of the state is resident at a time. ``grads`` and
    ``params`` may be on a device: each sub-group's gradient (and, without masters, its params) comes to the host
    alone and the updated params go back, so the host holds sub-groups, never a whole gradient or param copy.
    """
    from fzero.optim import apply_inplace
    from fzero.optim import use_segments

    paths, _, _ = optree.tree_flatten_with_path(state.small, none_is_leaf=True)
    param_paths = [p for p in paths if _is_param_leaf(p)]
    keys_of = lambda unit: [_key(p, unit) for p in param_paths] + ([f"master/{unit}"] if state.master else [])  # noqa: E731
    groups = [(u, a, min(a + policy.sub_group_size, g.numel())) for u, g in grads.items() for a in range(0, g.numel(), policy.sub_group_size)]
    store = state.store
    small = new_small = state.small
    for i, (unit, a, b) in enumerate(groups):
        if i + 1 < len(groups):
            next_unit, next_a, next_b = groups[i + 1]
            for k in keys_of(next_unit):
                store.prefetch(k, next_a, next_b)
        keys = keys_of(unit)
        views = [store.tensor(k)[a:b] for k in keys]
        opt_leaves = iter(views[: len(param_paths)])
        group_state = optree.tree_map_with_path(
            lambda p, x: next(opt_leaves) if _is_param_leaf(p) else (x.clone() if isinstance(x, torch.Tensor) else x),
            small, none_is_leaf=True,
        )
        param = params[unit][a:b]
        # the sub-group's params (without masters) and gradient on the host: a sub-group at a time, never whole
        target = views[-1] if state.master else param.to("cpu")
        grad = grads[unit][a:b].to("cpu", target.dtype)
        # a layout's Segments narrowed to this sub-group (which params it holds, which skip the step)
        guard = segments_guard.sub_group(unit, a, b) if hasattr(segments_guard, "sub_group") else segments_guard
        with use_segments(guard):
            group_state = apply_inplace(optimizer, {"g": grad}, group_state, {"g": target})
        del grad
        g_paths, g_leaves, _ = optree.tree_flatten_with_path(group_state, none_is_leaf=True)
        for view, new in zip(views, [x for p, x in zip(g_paths, g_leaves) if _is_param_leaf(p)]):
            if new.data_ptr() != view.data_ptr():  # an optimizer that returned new tensors rather than updating in place
                view.copy_(new)
        if target is not param:
            param.copy_(target)  # the low-precision params follow the fp32 master; a device's, its host copy
        new_small = optree.tree_map_with_path(lambda p, x: None if _is_param_leaf(p) else x, group_state, none_is_leaf=True)
        for k in keys:
            store.release(store.tensor(k), a, b)
        if b == params[unit].numel():  # the unit's last sub-group: a mapped param shard goes back to its file
            store.release(params[unit])
    return DiskOptState(store, new_small, state.master)


def gather_master(state: DiskOptState, units: list[str]) -> dict[str, torch.Tensor]:
    """The fp32 masters back from the files (for ``Step.gather``)."""
    return {u: state.store.load(f"master/{u}") for u in units}

