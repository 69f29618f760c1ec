"""Memory of model states: what the ZeRO formula predicts, and what a rank really holds.

The formula is the ZeRO paper's (``fzero/estimate/_formula.py``): with Ψ parameters, N ranks, P bytes per
parameter, G per gradient and K optimizer bytes per parameter,

    stage 0: (P + G + K)Ψ      stage 1: (P + G)Ψ + KΨ/N      stage 2: PΨ + (G + K)Ψ/N      stage 3: (P + G + K)Ψ/N

fp32 Adam(W) is P = G = 4, K = 8 (m and v; no master copy). ``LiveBytes`` measures: torch has no CPU
allocator statistic, so it counts the bytes of every tensor storage created while it is active (in the
thread that activated it, which is what makes per-rank counts possible on a ``local_mesh``) and
subtracts them when the storage is freed.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fzero.mesh import events as _events
from fzero.estimate import zero_model_state_bytes  # noqa: F401 - public here; one formula, with the estimator's
from fzero.layout import pytrees as _tree


def _storage_bytes(tensors: Any, files: Any = None) -> int:
    """Bytes of the distinct storages of ``tensors``; ``files``: the state's disk-offload store, whose mapped files'
    pages are not RAM the state holds."""
    seen, total = set(), 0
    for t in _tree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and not (files is not None and files.holds(t)):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def state_bytes(state: Any) -> dict[str, int]:
    """Bytes that one rank's ``TrainState`` holds in memory: params, optimizer state and (stage 3, ``init(...,
    frozen=...)``) its shards of the frozen params (distinct storages; the files of disk offload, mapped param shards
    included, are not counted)."""
    files = getattr(state.opt_state, "store", None)
    return {"params": _storage_bytes(state.params, files), "optimizer": _storage_bytes(state.opt_state, files),
            "frozen": _storage_bytes(state.frozen)}


def state_categories(state: Any) -> dict[str, int]:
    """Bytes one rank's ``TrainState`` holds in memory by what they are: ``params`` (the shards the step computes
    with), ``masters`` (fp32 master weights), ``moments`` (the optimizer's param-shaped state: Adam's m and v) and
    ``other`` (step counts, schedules). Under offload the last three are what ZeRO-Offload puts on the host; a
    test that checks each names the one that grew. Files of disk offload are not memory and are not counted."""
    opt = state.opt_state
    masters = getattr(opt, "master", None) if type(opt).__name__ == "MasterState" else None
    inner = opt.inner if masters is not None else opt
    sizes = {t.numel() for t in _tree.tree_leaves(state.params) if isinstance(t, torch.Tensor)}
    leaves = [t for t in _tree.tree_leaves(inner) if isinstance(t, torch.Tensor)]
    moments = [t for t in leaves if t.numel() in sizes and t.numel() > 1]
    other = [t for t in leaves if not any(t is m for m in moments)]
    files = getattr(opt, "store", None)
    return {"params": _storage_bytes(state.params, files), "masters": _storage_bytes(masters, files) if masters is not None else 0,
            "moments": _storage_bytes(moments, files), "other": _storage_bytes(other, files)}


class _Tally:
    """Live and peak bytes over storages, each counted at the size it holds now: stage 3 frees a gathered
    unit's storage (``resize_(0)``) and refills it while the tensor lives on, so a storage's bytes change."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage (its StorageImpl address) -> bytes it holds now
        self._dtypes: dict[int, torch.dtype] = {}  # storage -> the dtype of the tensor that made it
        self._live_by: dict[torch.dtype, int] = {}
        self.peak_by_dtype: dict[torch.dtype, int] = {}  # live bytes by dtype at the moment of ``peak``
        self._lock = threading.RLock()  # re-entrant: a finalizer may run (on GC) while the lock is held

    def _set(self, key: int, nbytes: int, dtype: torch.dtype | None = None) -> None:
        with self._lock:
            if dtype is not None:
                self._dtypes.setdefault(key, dtype)
            d = self._dtypes.get(key)
            delta = nbytes - self._sizes.get(key, 0)
            self.live += delta
            self._live_by[d] = self._live_by.get(d, 0) + delta
            self._sizes[key] = nbytes
            if self.live > self.peak or not self.peak_by_dtype:
                self.peak = self.live
                self.peak_by_dtype = {k: v for k, v in self._live_by.items() if v}

    def _drop(self, key: int) -> None:
        with self._lock:
            nbytes = self._sizes.pop(key, 0)
            self.live -= nbytes
            d = self._dtypes.pop(key, None)
            self._live_by[d] = self._live_by.get(d, 0) - nbytes

    def on_returned(self, buffer: torch.Tensor) -> None:
        """A buffer was given back to a step's pool (``fzero.step._pool``): no longer in use, as if freed."""
        self._drop(buffer.untyped_storage()._cdata)

    def on_resized(self, buffer: torch.Tensor) -> None:
        """A counted storage was freed (``resize_(0)``) or given its memory back (stage 3, between a unit's
        forward and its backward): count its new size."""
        storage = buffer.untyped_storage()
        if storage._cdata in self._sizes:
            self._set(storage._cdata, storage.nbytes())


class LiveBytes(TorchDispatchMode, _Tally):
    """Counts live tensor bytes created under it (this thread only), and their peak.

    ``with LiveBytes() as lb: ...`` then ``lb.peak`` and ``lb.live``; ``lb.peak_by_dtype``: the live bytes at the
    peak by the dtype of the tensor that allocated them (a mixed-precision step's fp32 gradient against its bf16
    buffers). Storages that existed before are not
    counted, nor are views and in-place results of any storage; ``lb.reset_peak()`` starts a new peak from
    the current live count.
    """

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self)
        _Tally.__init__(self)

    def reset_peak(self) -> None:
        self.peak = self.live
        self.peak_by_dtype = {k: v for k, v in self._live_by.items() if v}

    def __enter__(self) -> "LiveBytes":
        self._watch = _events.watching(self)  # stage 3's storage resizes are no dispatched op: it reports them
        self._watch.__enter__()
        return TorchDispatchMode.__enter__(self)

    def __exit__(self, *exc: Any) -> None:
        TorchDispatchMode.__exit__(self, *exc)
        self._watch.__exit__(*exc)

    def on_gathered(self, buffer: torch.Tensor) -> None:
        """Counted already: the allocation went through this dispatch mode."""

    def on_lent(self, buffer: torch.Tensor) -> None:
        """A step's pool lends a buffer it held (``fzero.step._pool``): in use, as a new one would be."""
        storage = buffer.untyped_storage()
        if storage._cdata not in self._sizes:
            self._set(storage._cdata, storage.nbytes(), buffer.dtype)
            weakref.finalize(storage, self._drop, storage._cdata)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A storage is new when no input shares it: views and in-place results are not allocations.
        inputs = {t.untyped_storage()._cdata for t in _tree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in _tree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage._cdata, storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._sizes:
                continue
            self._set(key, nbytes, t.dtype)
            weakref.finalize(storage, self._drop, key)
        return out


class GatheredBytes(_Tally):
    """Live and peak bytes of gathered stage-3 parameter buffers (whole units) in this thread.

    ``with GatheredBytes() as g: ...`` then ``g.peak``. fzero reports each buffer it gathers a unit into
    (``fzero.mesh._comm``); the count drops when the buffer is freed. On a ``local_mesh``, enter one per
    rank with ``rank_context``.
    """

    def __enter__(self) -> "GatheredBytes":
        self._watch = _events.watching(self)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._watch.__exit__(*exc)

    def on_gathered(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        self._set(storage._cdata, storage.nbytes(), buffer.dtype)
        weakref.finalize(storage, self._drop, storage._cdata)


def resident_bytes_of_files_under(path: Any) -> int:
    """Resident bytes of this process's mappings of files under ``path`` (unlinked ones too), from
    ``/proc/self/smaps`` (Linux): what disk offload's mapped files hold in RAM at this moment."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = len(fields) >= 6 and fields[5].startswith(str(path))
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total
