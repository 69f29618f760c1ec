"""``Step.init(..., donate=True)``: the given params' memory freed as their units are packed, their tensors turned
meta in place, and on a failed init their values put back (``Donated``).

``params_of(module, copy=False)`` notes on each view it gives the module's parameter it views (``DONATED_FROM``), so
that the parameter turns meta with it: left as they were, the module's parameters kept their shapes over freed memory,
and a read of their values crashed the process.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from fzero.layout import Layout, Unit
from fzero.mesh import events as _events
from fzero.step._state import TrainState

API = "fzero.Step.init"

# The module's parameter a tensor of ``params_of(module, copy=False)`` is the memory of: ``Step.init(..., donate=True)``
# frees that memory, then turns the parameter itself into a meta tensor of its shape (``torch.utils.swap_tensors``).
DONATED_FROM = "_fz_donated_from"


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of ``t``'s storage from its first element to the end of its last (a strided view spans its gaps)."""
    last = int(t.storage_offset()) + sum(int(size - 1) * int(stride) for size, stride in zip(t.shape, t.stride()) if size > 0)
    return int(t.storage_offset()) * t.element_size(), (last + 1) * t.element_size()


class Donated:
    """``Step.init(..., donate=True)``: the memory of the given params, freed as their units are packed.

    Why: a model built whole (not under ``fzero.empty_params()``) is held by its module while ``init`` makes the
    state, so the set-up peaks at the module plus the whole state (measured: 18.5 bytes per parameter above the
    built model for a bf16 stage-3 Llama at world 1, where FSDP2, which shards the module's own tensors, adds
    0.7). Donated, each storage is freed (``resize_(0)``, as FSDP frees a resharded parameter) once every leaf
    viewing it has been packed, so the module's memory goes down as the state's goes up. As with JAX's donated
    buffers, the tensors stay (shape and dtype) but their values are gone: the module runs only through
    ``fzero.apply`` with the state's params afterwards.

    Once freed, each tensor known to view that memory becomes a meta tensor of its shape (``torch.utils.swap_tensors``:
    the same Python object, so every holder sees it): the given params, and the module's own parameters they are
    views of (``params_of(module, copy=False)`` names them). Left as they were, a read of their values outside
    ``fzero.apply`` (``fzero.params_of(model)`` again, a notebook cell run twice, ``model(x)``, a print) read freed
    memory and crashed the process; now it gets torch's meta-tensor error, or fzero's, as a model built under
    ``fzero.empty_params()`` does. A tensor that cannot be swapped (one with a weak reference) keeps its shape with no
    memory, which fzero's own entry points refuse by name (``check_not_freed``). A storage that also holds values no
    given tensor covers (a frozen parameter cut from the same flat buffer) is not freed at all (``kept``)."""

    def __init__(self, paths: list, leaves: list) -> None:
        self.leaves = leaves
        self.paths = paths
        self.count: dict[int, int] = {}  # storage (its StorageImpl address) -> leaves viewing it not yet packed
        self.viewing: dict[int, list[int]] = {}  # storage -> the indices of the given tensors viewing it
        self.devices: dict[int, torch.device] = {}  # leaf index -> its device (a meta tensor forgets it)
        self.freed: list[int] = []  # the indices of the given tensors whose memory has been freed
        self.owners: dict[int, torch.Tensor] = {}  # leaf index -> the module's parameter it views (swapping drops the note)
        for j, (path, x) in enumerate(zip(paths, leaves)):
            if not isinstance(x, torch.Tensor) or x.is_meta:
                continue
            storage = x.untyped_storage()
            if not storage.resizable():
                raise ValueError(
                    f"{API}: donate=True, but the memory of params[{path or '<root>'!r}] cannot be freed (its storage is "
                    f"not resizable: a tensor made by torch.frombuffer or torch.from_numpy, or a file mapping). Pass "
                    f"donate=False, or params whose memory torch allocated (fzero.params_of(model, copy=False))."
                )
            self.count[storage._cdata] = self.count.get(storage._cdata, 0) + 1
            self.viewing.setdefault(storage._cdata, []).append(j)
            self.devices[j] = x.device
        # a storage the given tensors do not cover whole holds other values too (a frozen parameter cut from the same
        # flat buffer as trainable ones, which the step reads from the module): freed, reading those would read freed
        # memory, so such a storage is kept (its memory is not given back, its tensors keep their values)
        self.kept = {key for key, views in self.viewing.items() if not _covered(leaves[views[0]].untyped_storage(),
                                                                                    [leaves[i] for i in views])}

    def packed(self, indices: tuple[int, ...]) -> None:
        """The leaves at ``indices`` are in the state now: free each storage that no leaf still to be packed views."""
        for j in indices:
            x = self.leaves[j]
            if not isinstance(x, torch.Tensor) or x.is_meta:
                continue
            storage = x.untyped_storage()
            key = storage._cdata
            self.count[key] -= 1
            if self.count[key] == 0 and key not in self.kept:
                storage.resize_(0)
                _events.resized(x)  # a storage resize is no dispatched op: memory counters hear of it here
                for i in self.viewing.pop(key):
                    view = self.leaves[i]
                    owner = view.__dict__.get(DONATED_FROM)
                    if owner is not None:
                        self.owners[i] = owner
                        _to_meta(owner)
                    _to_meta(view)
                    self.freed.append(i)

    def give_back(self, error: BaseException, value: Callable[[int, torch.dtype], torch.Tensor | None]) -> None:
        """``init`` failed after some memory was freed: put each freed tensor's value back from what was packed
        (``value(leaf index, dtype)``, exact, or None where this process does not hold it), and say on ``error`` what
        became of them.

        Why: the values of a freed param lived only in the state being made, which the failure drops. Left as meta,
        a failed init (out of memory packing a unit, a full disk under disk offload, Ctrl-C) lost the module's
        weights, and the next ``init`` blamed a donation to a state that never existed."""
        lost, back = [], 0
        for j in self.freed:
            t = self.leaves[j]
            path = self.paths[j] or "<root>"
            try:
                v = value(j, t.dtype)
                if v is None:
                    lost.append(path)
                    continue
                _from_meta(t, v.reshape(t.shape), self.devices[j], self.owners.get(j))
                back += 1
            except Exception:  # noqa: BLE001 - the error being raised is the one to see; this one is named as a loss
                lost.append(path)
        if not lost:
            _note(error, f"{API}: donate=True had freed the memory of {back} of the given params when this error was "
                           f"raised; their values were put back (and into the module's parameters, where "
                           f"fzero.params_of(model, copy=False) gave them), so the model is as it was: init may be called "
                           f"again.")
        else:
            _note(error, f"{API}: donate=True had freed the memory of {len(lost)} of the given params when this error "
                           f"was raised, and their values, held only by the state being made, are lost: {lost[:4]}"
                           f"{' ...' if len(lost) > 4 else ''} are meta tensors now (this process holds their values "
                           f"{'only in part, a shard per rank' if value(-1, torch.float32) is None else 'only in a lower precision'}). "
                           f"Rebuild the model or reload its weights (a checkpoint, from_pretrained) before init again; "
                           f"init(..., donate=False) keeps the module's values through a failure." +
                           (f" The other {back} were put back." if back else ""))


def _note(error: BaseException, text: str) -> None:
    """``error.add_note(text)`` (Python 3.11+); on 3.10, which has no notes, the text as a warning beside the error."""
    add = getattr(error, "add_note", None)
    if add is not None:
        add(text)
    else:
        import warnings

        warnings.warn(text, RuntimeWarning, stacklevel=3)


def _covered(storage: Any, views: list[torch.Tensor]) -> bool:
    """Whether ``views`` together span every byte of ``storage`` (each view counted from its first to its last
    element, so a strided view spans its gaps too: what lies between its elements is its own padding)."""
    spans = [byte_span(v) for v in views if v.numel()]
    at = 0
    for lo, hi in sorted(spans):
        if lo > at:
            return False
        at = max(at, hi)
    return at >= storage.nbytes()


def _from_meta(t: torch.Tensor, value: torch.Tensor, device: torch.device, owner: torch.Tensor | None) -> None:
    """Undo ``_to_meta``: ``t`` (and ``owner``, the module's parameter it was taken from) holds ``value`` again, in place."""
    if not t.is_meta:  # one torch could not swap: its storage was only resized to 0; give it its bytes back
        # to its last element's end, and never smaller than another view of the same storage already made it (views at
        # higher offsets come later: resized to the first one's extent, the copy below wrote past the storage's end)
        storage = t.untyped_storage()
        storage.resize_(max(storage.nbytes(), byte_span(t)[1]))
        with torch.no_grad():
            t.copy_(value)
        return
    real = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    with torch.no_grad():
        real.copy_(value)
    if owner is not None and owner.is_meta:  # the module's parameter first; the given tensor views it again
        torch.utils.swap_tensors(owner, nn.Parameter(real, requires_grad=owner.requires_grad))
        real = owner.detach()
    torch.utils.swap_tensors(t, real)  # (swaps the Python attributes too: the note of the owner is set again below)
    if owner is not None:
        t.__dict__[DONATED_FROM] = owner


def packed_values(step: Any, layout: Layout, ranks: list[int], flats: dict[int, dict[str, torch.Tensor]],
                   masters: dict[int, dict[str, torch.Tensor]] | None, made: dict[int, TrainState]
                   ) -> Callable[[int, torch.dtype], torch.Tensor | None]:
    """``value(leaf index, dtype)``: a given param's value as ``init`` packed it (for ``_Donated.give_back``), read from
    the ranks' held buffers (or the states made already), or None where this process does not hold it whole and exact:
    under dist_mesh a rank holds a shard of a sharded unit; a buffer in a lower precision than the param (bf16 flats of
    fp32 params) is exact only through the fp32 masters. ``value(-1, ...)`` tells which of the two it is (None: shards)."""
    n = layout.world_size
    where = {j: (unit, slot) for unit in layout.units for j, slot in zip(layout.leaf_indices(unit), unit.slots)}
    cache: dict[tuple[str, str], torch.Tensor | None] = {}

    def held(kind: str, r: int) -> dict[str, torch.Tensor]:
        if r in made:
            s = made[r]
            if kind == "params":
                return s.params
            return step.opt_state.masters(s.opt_state, layout) if step.opt_state.has_masters(s.opt_state) else {}
        return (flats if kind == "params" else masters or {}).get(r, {})

    def whole(kind: str, unit: Unit) -> torch.Tensor | None:
        if (kind, unit.name) not in cache:
            sharded = step.params.sharded if kind == "params" else step.opt_state.sharded
            parts = [held(kind, r).get(unit.name) for r in (ranks[:1] if not sharded else ranks)]
            ok = all(p is not None for p in parts) and (not sharded or len(ranks) == n)
            got = [p for p in parts if p is not None]
            cache[kind, unit.name] = (got[0] if len(got) == 1 else torch.cat([p.to(got[0].device) for p in got])) if ok else None
        return cache[kind, unit.name]

    def exact(have: torch.dtype, want: torch.dtype) -> bool:
        return have == want or (have == torch.float32 and want in (torch.float16, torch.bfloat16))

    def value(j: int, dtype: torch.dtype) -> torch.Tensor | None:
        if j < 0:  # why a value is missing: this process holds the params only in shards (not: a unit not packed yet,
            # which held no freed value; read so, a failure midway through packing a single process's bf16 copy of fp32
            # params was blamed on shards), and nothing is read or made here, which would raise over the error itself
            return None if step.params.sharded and len(ranks) < n else torch.empty(0)
        unit, slot = where[j]
        for kind in ("params", "masters"):
            buf = whole(kind, unit)
            if buf is not None and buf.numel() >= slot.offset + slot.numel and exact(buf.dtype, dtype):
                return buf[slot.offset : slot.offset + slot.numel]
        return None

    return value


def _to_meta(t: torch.Tensor) -> None:
    """``t``, whose memory was freed, becomes a meta tensor of its shape and dtype in place (the same Python object: a
    module's parameter stays a parameter, with its ``requires_grad``, its class and its attributes: ``swap_tensors``
    swaps ``__class__`` and ``__dict__`` too, which would leave a ``nn.Parameter`` subclass a plain parameter and drop
    what code set on it, ``p.no_decay = True``). One that torch cannot swap stays as it is."""
    cls = type(t)
    attrs = {k: v for k, v in t.__dict__.items() if k != DONATED_FROM}  # (the note on a view: done with once freed)
    meta = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        meta = nn.Parameter(meta, requires_grad=t.requires_grad)
    try:
        torch.utils.swap_tensors(t, meta)
    except RuntimeError:  # a weak reference to it, or a subclass torch cannot swap: fzero's entry points refuse it by name
        return
    if type(t) is not cls and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:  # not a wrapper subclass
        try:
            t.__class__ = cls
        except TypeError:
            pass
    t.__dict__.update(attrs)
