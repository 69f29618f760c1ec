"""What a step is given: the global batch split across the ranks of a local mesh, and a rank's batch
split into micro-batches for gradient accumulation; ``loss_fn`` run on it with the batch named when it fails; and
the gradient of a micro-batch.

How a batch is split (on a ``local_mesh`` and with ``grad_accum > 1``): every tensor leaf of dim >= 1 holds rows
of the batch on dim 0, and all of them must have one row count, which is split; a 0-d tensor (a temperature, a
loss weight) is given whole to every rank and micro-batch, as are leaves that are not tensors. A list or tuple
of strings with one item per row (what ``torch.utils.data.default_collate`` makes of a string field: the texts, ids
or file names of the rows), or of one list per row (a custom collate's variable-length field), is split as rows, as the per-rank loaders of a torchrun job and a DeepSpeed engine's
micro-batches give each their own; a list of numbers is not (``default_collate`` makes those tensors; such a list
is a constant: an image size, per-class weights). Containers are looked into: dicts, lists, tuples, named tuples,
and also dataclasses and mappings that are not dicts (Hugging Face's ``BatchEncoding``), which optree takes as leaves. Each rank of a local mesh gets tensors of its own, as a
torchrun process does. A tensor that is not
per row, such as a per-class weight, cannot be told from rows by its shape: it belongs in ``loss_fn``'s closure,
not in the batch, and a row count of its own is refused rather than split silently.

``gradient`` (at the end of this module) is the gradient of one micro-batch: ``loss_fn`` differentiated with
respect to the flat unit inputs, by ``torch.func.grad`` or plain autograd, with the loss and aux it returned and
the buffers its forward left (see ``fzero.step._module``).

What the step says when ``loss_fn`` or its backward fails (the batch named, and a cause and fix where fzero can name
them) is in ``fzero.step._hints``; the first forward's refusals (``check_own_params``, ``agree_structure``) are in
``fzero.step._refusals``. Both run only on a failure or at the first step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import optree
import torch

from fzero.mesh import backward_context, current_context, with_context
from fzero.layout import pytrees as _tree
from fzero.step._module import Buffers, lift_for
from fzero.step._module_refusals import check_module_features
from fzero.step._refusals import agree_structure, check_no_trained_buffers, check_own_params
from fzero.step._hints import (_BACKWARD_IN_LOSS_FN, _FREED, _FREED_HOW, _FUNC_REFUSALS, _META, _SECOND_BACKWARD, UNIT_FREED,
                               UNIT_OUTSIDE_ITS_CALL, _func_refusal, _traceback_files, loss_fn_failure)
from fzero.step._context import per_tensor, step_buffers, step_scope
from fzero.step._reentrant import REENTRANT_HINT, holds_reentrant_checkpoint
from fzero.step._stale import StaleWatch


_NOT_PER_ROW = ("a tensor that is not per row (a per-class weight, a lookup table) goes into loss_fn's closure, "
                "where every rank and micro-batch sees it whole, not into the batch; a 0-d tensor in the batch is "
                "given whole to every rank")


def split_batch(batch: Any, n: int, *, api: str = "fzero.Step.__call__", grad_accum: int = 1,
                generators: list[tuple[torch.Generator, list[torch.Generator]]] | None = None,
                held: Any = None) -> list[Any]:
    """Split the global ``batch`` into n equal per-rank batches on its rows (see the module's docstring). Each rank
    gets tensors of its own (copies): the ranks of a local mesh run at once, and views of one tensor share its version
    counter, so one rank's in-place write (labels masked with ``y[y == 0] = -100``) would break another's backward, or
    (a 0-d leaf) change what the other rank reads, as no two torchrun processes can. A ``torch.Generator`` in the
    batch (noise drawn in ``loss_fn`` with ``generator=batch["gen"]``) is each rank's own copy too, in the state the
    caller's is in: shared, the rank threads drew from one stream in the order they ran (other numbers at every run),
    where each torchrun process draws from its own generator, seeded alike. ``generators``: where each such
    generator is noted beside its per-rank copies, for the caller to give it rank 0's state once the step has
    succeeded (``keep_rank0_generators``), as a module's own generator is kept; ``held``: the mesh's
    ``fzero.layout.HeldStreams`` (every local mesh of its size shares it), from which rank r's copy starts in the state rank r's copy ended the last step in,
    where the caller's generator still holds what that step left (a torchrun process's goes on from its own, so
    ranks that draw other amounts go on apart). ``api``: whose batch it is, for
    the errors (a step's, or ``evaluate``'s); ``grad_accum``: the micro-batches each rank's share is split into next,
    so that rows that do not divide by ``n * grad_accum`` are named as the global batch the caller passed, not as a
    rank's share the caller never saw."""
    if n > 1:
        batch = _own_generators(batch, n, [] if generators is None else generators, held)
    parts = n * grad_accum
    accum = f", and each rank's share into grad_accum={grad_accum} micro-batches" if grad_accum > 1 else ""
    return _split_rows(batch, n, api, f"under local_mesh({n}) the global batch is split on dim 0 across {n} ranks", lambda path, size: (
        f"{api}: under local_mesh({n}) the global batch is split on dim 0 across {n} ranks{accum}, but "
        f"batch leaf {path!r} has {size}, which does not divide by {parts}. Pass a batch whose dim 0 "
        f"is a multiple of {parts} (e.g. drop the last partial batch)."
    ), copy=True, multiple=parts)


class _PerRank:
    """A batch leaf that is a different object on each rank (a ``torch.Generator``'s copies): ``_split_tree`` gives
    part ``i`` the ``i``-th."""

    def __init__(self, items: list[Any]):
        self.items = items


def _own_generators(batch: Any, n: int, noted: list[tuple[torch.Generator, list[torch.Generator]]], held: Any = None) -> Any:
    """``batch`` with each ``torch.Generator`` leaf (inside dataclasses and mappings too) replaced by n copies of it,
    one per rank (``_PerRank``), each noted beside the original in ``noted``. A generator the batch names twice
    (``{"gen": g, "aug": {"gen": g}}``) is one stream, as on a torchrun process: each rank gets one copy for both."""
    def own(x: Any) -> Any:
        if isinstance(x, torch.Generator):
            for original, copies in noted:
                if original is x:
                    return _PerRank(copies)
            copies = []
            for r in range(n):
                g = torch.Generator(device=x.device)
                g.set_state(x.get_state() if held is None else held.start(x, rank=r, n=n))
                copies.append(g)
            noted.append((x, copies))
            return _PerRank(copies)
        children = _children(x)
        if children is not None:
            owned = {name: _own_generators(child, n, noted, held) for name, child in children.items()}
            if all(owned[name] is child for name, child in children.items()):
                return x  # no generator inside: the container as given (its __post_init__ not run again)
            return _rebuilt(x, owned)
        return x

    if not any(isinstance(x, torch.Generator) or _children(x) is not None for x in _tree.tree_leaves(batch)):
        return batch
    return _tree.tree_map(own, batch)


def keep_rank0_generators(generators: list[tuple[torch.Generator, list[torch.Generator]]], held: Any = None) -> None:
    """Give each ``torch.Generator`` of the caller's batch the state its rank-0 copy ended the step in (what a torchrun
    job's rank 0 holds after it), once the step has succeeded (``split_batch``); ``held`` (the mesh's
    ``fzero.layout.HeldStreams``, shared by every local mesh of its size) notes where every rank's copy ended, for the next step's copies to go on from."""
    for original, copies in generators:
        original.set_state(copies[0].get_state())
        if held is not None:
            held.record(original, [g.get_state() for g in copies])


def split_micro(batch: Any, k: int) -> list[Any]:
    """This rank's batch as k micro-batches, split on its rows (see the module's docstring)."""
    if k == 1:
        return [batch]
    api = "fzero.Step.__call__"
    return _split_rows(batch, k, api, f"grad_accum={k} splits each rank's batch into {k} micro-batches on dim 0", lambda path, size: (
        f"{api}: grad_accum={k} splits each rank's batch into {k} micro-batches on dim 0, but "
        f"batch leaf {path!r} has {size} on this rank. Pass a per-rank batch whose dim 0 is a multiple of {k}."
    ))


def row_leaves(batch: Any, prefix: str = "", *, records: bool = False) -> list[tuple[str, int]]:
    """(path, rows) of every tensor leaf of dim >= 1: the leaves whose dim 0 is the batch's rows (inside dataclasses
    and mappings that are not dicts too: see ``_children``). ``records``: a list of one record per row
    (``record_list``) counts as one leaf of ``len`` rows, its tensors' own dim 0 (an image's channels, its boxes) not
    being rows."""
    if batch is None:
        return []
    paths, leaves, _ = _tree.flatten_with_paths(batch, is_leaf=record_list if records else None)
    out = []
    for p, x in zip(paths, leaves):
        path = _joined(prefix, p)
        children = _children(x)
        if children is not None:
            for name, child in children.items():
                out += row_leaves(child, _joined(path, name), records=records)
        elif records and record_list(x):
            out.append((path or "<root>", len(x)))
        elif isinstance(x, torch.Tensor) and x.dim() > 0:
            out.append((path or "<root>", x.shape[0]))
    return out


def record_list(x: Any) -> bool:
    """Whether ``x`` is a list or tuple that may hold one record per row with tensors of its own sizes: every item a
    tensor of dim >= 1 (torchvision detection's images, ``[3, H_i, W_i]``; Mask2Former's ``mask_labels``), or every
    item a dict holding a tensor (torchvision's targets, ``{"boxes": [n_i, 4], "labels": [n_i]}``; DETR's ``labels``).
    What a detection collate (``tuple(zip(*samples))``) gives. Taken as rows only where the tensors' own dim 0 cannot
    be (``batch_rows``): ``default_collate``'s ``[x, y]`` of batched tensors is a list of tensors too."""
    if type(x) not in (list, tuple) or not x:
        return False
    if all(isinstance(item, torch.Tensor) and item.dim() > 0 for item in x):
        # records are alike (images of one dim and dtype, token lists): ``(x, y)`` of batched tensors whose row counts
        # differ (per-token labels of [B * T] beside inputs of [B, T]) is a batch to refuse, not two records
        return len({(item.dim(), item.dtype) for item in x}) == 1
    return all(type(item) is dict and _holds_tensor(item) for item in x)


def _holds_tensor(record: Any) -> bool:
    leaves: list[Any] = optree.tree_leaves(record, namespace=_tree.NAMESPACE)
    return any(isinstance(leaf, torch.Tensor) for leaf in leaves)


def batch_rows(batch: Any) -> tuple[list[tuple[str, int]], bool]:
    """The batch's row leaves (``row_leaves``) and whether lists of one record per row are rows (``record_list``).

    Every tensor's dim 0 is a row first, as ``default_collate`` makes them; where that gives leaves of different row
    counts and taking each record list as ``len`` rows gives one count, the batch is one of per-row records (a
    detection batch: images of their own sizes and targets of their own box counts, beside a ``pixel_values`` of as
    many rows, or alone). Split on the tensors' dim 0, every rank would get a part of each image's channels and
    boxes; refused, a detection model could not be trained on a local mesh or with ``grad_accum``. A list of one dict
    per row is the rows also where every tensor gives one count, if counting the dicts gives that count too (every
    image with as many boxes as the batch has images). Where neither
    gives one count and the batch has such lists, they are counted by ``len``, which is what the error then names."""
    rows = row_leaves(batch)
    counts = {n for _, n in rows}
    # the batch itself a list of tensors is default_collate's ``[x, y]`` (a tuple of inputs and targets), never one
    # image per row: records would give each rank some of the batch's fields (rank 0 ``x``, rank 1 ``y``)
    if record_list(batch) and isinstance(batch[0], torch.Tensor):
        return rows, False
    if len(counts) > 1:
        by_record = row_leaves(batch, records=True)
        if len(by_record) < len(rows):
            return by_record, True
    elif counts and _holds_dict_records(batch):
        # one count, and a list of one dict per row beside it: every image has as many boxes as the batch has images
        # (images stacked in one [B, 3, H, W] tensor, DETR's pixel_values). Read on the tensors' dim 0, every part would
        # get all B target dicts cut to its own rows' boxes, and a detector pairs image i with targets[i]: it trained
        # on other images' boxes, silently. Where the dicts, counted by their number, give that same count, they are
        # the rows, as in every other batch of the run whose box counts differ.
        by_record = row_leaves(batch, records=True)
        if len(by_record) < len(rows) and {n for _, n in by_record} == counts:
            return by_record, True
    return rows, False


def _holds_dict_records(batch: Any) -> bool:
    """Whether the batch holds a list of one dict of tensors per row (``record_list``: torchvision's targets, DETR's
    ``labels``), inside dataclasses and mappings that are not dicts too."""
    if batch is None:
        return False
    _, leaves, _ = _tree.flatten_with_paths(batch, is_leaf=record_list)
    for x in leaves:
        children = _children(x)
        if children is not None:
            if any(_holds_dict_records(child) for child in children.values()):
                return True
        elif record_list(x) and isinstance(x[0], dict):
            return True
    return False


def _joined(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _children(x: Any) -> dict[str, Any] | None:
    """The fields of a batch container that optree takes as one leaf but that holds rows: a dataclass instance, or a
    ``Mapping`` that is not a ``dict`` (Hugging Face's ``BatchEncoding``, what a tokenizer returns, is a ``UserDict``).
    Taken whole, every rank and micro-batch would get all its rows, silently. None: not such a container."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
    if isinstance(x, Mapping) and not isinstance(x, dict):
        return dict(x.items())
    return None


def _rebuilt(x: Any, children: dict[str, Any]) -> Any:
    """``x`` (a container ``_children`` reads) with those children: ``dataclasses.replace``, or a shallow copy whose
    items are set (a ``UserDict`` copies its data, so the original is left as it was)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **children)
    new = copy.copy(x)
    for key, value in children.items():
        new[key] = value
    return new


def rows_listed(rows: list[tuple[str, int]], limit: int = 8) -> str:
    more = f", ... {len(rows) - limit} more" if len(rows) > limit else ""
    return ", ".join(f"{p!r} has {n}" for p, n in rows[:limit]) + more


def _split_rows(batch: Any, k: int, api: str, why: str, message: Callable[[str, str], str], *, copy: bool = False,
                multiple: int | None = None) -> list[Any]:
    rows, records = batch_rows(batch)
    if len({n for _, n in rows}) > 1:  # split as they are, the ranks would pair rows of one leaf with others'
        lists = (" (a list of one tensor or one dict of tensors per row, as a detection batch's images and targets, "
                 "counted by its length)") if records else ""
        raise ValueError(
            f"{api}: {why}, so every tensor leaf of dim >= 1 must hold the batch's rows on dim 0, but their "
            f"row counts differ{lists}: {rows_listed(rows)}. Pass leaves of one row count; {_NOT_PER_ROW}. A tensor "
            f"with the batch on dim 1 (nn.LSTM's and nn.Transformer's default (seq, batch, ...) layout) belongs in the "
            f"batch as (batch, seq, ...), transposed inside loss_fn: on dim 0 it would be split along its time steps. A "
            f"ragged batch, flat values with offsets (nn.EmbeddingBag's 1-D input with offsets, sequences of several "
            f"lengths concatenated), has no rows to split: pass it padded, (batch, max_len), with a mask or weights of 0 "
            f"on the padding (nn.EmbeddingBag takes 2-D input with per_sample_weights), or as a list of one tensor per row."
        )
    if not records:
        message = _with_list_hint(batch, message)
    return _split_tree(batch, k, message, copy=copy, rows=rows[0][1] if rows else None, multiple=multiple or k,
                       records=records)


def _with_list_hint(batch: Any, message: Callable[[str, str], str]) -> Callable[[str, str], str]:
    """``message`` with, where the leaf that does not divide is an item of a list of tensors (``record_list``), why its
    own dim 0 was taken as the rows and how to say that the list's items are. A list of same-size images (an eval
    batch of ``[3, H, W]`` tensors) beside no tensor of another dim 0 reads as 3 rows, every image's channels: it is
    one count (``batch_rows``), so nothing tells it from ``default_collate``'s ``[x, y]`` of batched tensors."""
    paths, leaves, _ = _tree.flatten_with_paths(batch, is_leaf=record_list)
    lists = {p: len(x) for p, x in zip(paths, leaves) if record_list(x) and all(isinstance(t, torch.Tensor) for t in x)}
    if not lists:
        return message

    def hinted(path: str, size: str) -> str:
        owner = next((p for p in lists if not p or path == p or path.startswith(p + ".")), None)
        if owner is None:
            return message(path, size)
        n, where = lists[owner], repr(owner) if owner else "the batch"
        return (f"{message(path, size)} Leaf {path!r} is an item of {where}, a list of {n} tensors, and every tensor of "
                f"the batch has one dim 0, so it was read as the rows. If the list holds one image per row (images "
                f"of [C, H, W]), its items are the rows: stack them into one [{n}, C, H, W] tensor, or pass a per-row "
                f"tensor beside the list (e.g. image ids, torch.arange({n})), beside which the step reads the list's "
                f"items as its rows and splits it image by image.")

    return hinted


def per_row_items(x: Any, rows: int | None) -> bool:
    """Whether ``x`` is a list or tuple of one item per row whose leaves are all strings (``default_collate``'s list
    of the rows' strings): split as rows, where given whole every rank and micro-batch would read every row's item
    (each rank's texts paired with another rank's tensors), unlike a torchrun process with its own loader. Only a row
    count that the batch's tensors give is trusted; a list of another length is given whole, as any leaf that is not a
    tensor. Numbers are not taken as rows: ``default_collate`` makes a number field a tensor, so a list of numbers in
    a batch is the caller's constant (an image size ``(224, 224)``, per-class weights), which split on a batch of as
    many rows gave each rank a part of it, silently. A list of one list (tuple, dict) per row is a record per row, as a
    custom collate makes of variable-length fields (``[[1], [2, 2], ...]``): split, as its rows' tensors are."""
    if rows is None or type(x) not in (list, tuple) or len(x) != rows:
        return False
    leaves = optree.tree_leaves(x, namespace=_tree.NAMESPACE)
    if any(isinstance(leaf, torch.Tensor) or _children(leaf) is not None for leaf in leaves):
        return False
    # strings, or one record per row (a custom collate's variable-length tags, [[1], [2, 2], ...]), of no tensor
    return bool(leaves) and (all(isinstance(item, (str, bytes)) for item in x)
                             or all(type(item) in (list, tuple, dict) for item in x))


def _split_tree(batch: Any, k: int, message: Callable[[str, str], str], *, copy: bool, rows: int | None = None,
                multiple: int | None = None, prefix: str = "", records: bool = False) -> list[Any]:
    """``batch`` as k parts on its rows; ``copy``: each part's tensors its own (see ``split_batch``); ``rows``: the
    tensors' row count, by which lists of one item per row are told (``per_row_items``); ``multiple``: what the rows
    must divide by (k, or more where each part is split again); ``records``: lists of one record per row
    (``record_list``) are rows (``batch_rows``)."""
    multiple = multiple or k
    paths, leaves, spec = _tree.flatten_with_paths(
        batch, is_leaf=lambda x: per_row_items(x, rows) or (records and record_list(x)))
    parts: list[list[Any]] = [[] for _ in range(k)]
    for path, leaf in zip(paths, leaves):
        path = _joined(prefix, path)
        children = _children(leaf)
        if children is not None:  # a dataclass or a BatchEncoding: its fields split, the container rebuilt per part
            split = {name: _split_tree(child, k, message, copy=copy, rows=rows, multiple=multiple, prefix=_joined(path, name),
                                       records=records)
                     for name, child in children.items()}
            chunks: Any = [_rebuilt(leaf, {name: pieces[i] for name, pieces in split.items()}) for i in range(k)]
        elif isinstance(leaf, _PerRank):  # a generator's copies (split_batch): each rank its own
            chunks = leaf.items
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % multiple:
                raise ValueError(message(path or "<root>", f"dim 0 of size {leaf.shape[0]}"))
            chunks = [c.clone() for c in leaf.chunk(k)] if copy else leaf.chunk(k)
        elif isinstance(leaf, torch.Tensor) and copy:  # a 0-d tensor: the same value, a tensor of its own per rank
            chunks = [leaf.clone() for _ in range(k)]
        elif records and record_list(leaf):  # one image (its targets) per row: each part its own records, in a list of its own
            if len(leaf) % multiple:
                raise ValueError(message(path or "<root>", f"{len(leaf)} items"))
            n = len(leaf) // k
            own = (lambda t: t.clone() if isinstance(t, torch.Tensor) else t) if copy else (lambda t: t)
            chunks = [type(leaf)(_tree.tree_map(own, item) for item in leaf[i * n:(i + 1) * n]) for i in range(k)]
        elif per_row_items(leaf, rows):  # the rows' strings (ids, texts): each part its own rows, in a list of its own
            if len(leaf) % multiple:
                raise ValueError(message(path or "<root>", f"{len(leaf)} items"))
            n = len(leaf) // k
            chunks = [type(leaf)(leaf[i * n:(i + 1) * n]) for i in range(k)]
        else:  # a 0-d tensor or a leaf that is not a tensor: the same for every rank and micro-batch
            chunks = (leaf,) * k
        for i in range(k):
            parts[i].append(chunks[i])
    return [spec.unflatten(p) for p in parts]


def check_rows(batch: Any, *, where: str, expected: int | None = None, setting: str = "", short: str = "") -> None:
    """Refuse a batch that holds no rows, or (``expected``) another number of rows than the step was set up for.

    An empty batch gives a NaN loss (a mean over nothing), which the step would average into every rank's update;
    rows that do not match the DeepSpeed config's batch sizes train with another batch than the config says, and
    the learning rate tuned for it. ``where``: whose batch ("the global batch", "rank 1's batch"); ``setting``:
    what ``expected`` comes from, for the message; ``short``: said too when a batch has fewer rows. A detection
    batch's rows are its images (``batch_rows``): an image without objects (``boxes`` of 0 rows) is a row, not an
    empty batch."""
    rows, _ = batch_rows(batch)
    empty = [(p, n) for p, n in rows if n == 0]
    if empty:
        raise ValueError(
            f"fzero.Step.__call__: {where} is empty: batch leaf {empty[0][0]!r} has 0 rows. A step needs at least one row "
            f"on every rank (the loss of no rows is NaN, and every rank would apply it). Give every rank rows (e.g. "
            f"drop_last=True, or a DistributedSampler that shards evenly), or skip the step on every rank together."
        )
    wrong = [(p, n) for p, n in rows if expected is not None and n != expected]
    if wrong and expected is not None:
        raise ValueError(
            f"fzero.Step.__call__: {setting} make {expected} rows for {where}, but {rows_listed(wrong)}. Pass "
            f"batches of {expected} rows, or change the config's batch sizes to the batches you pass; {_NOT_PER_ROW}."
            + (short if any(n < expected for _, n in wrong) else "")
        )


# Errors of plain Python and torch that loss_fn (the user's code, or the model it runs) raises on a batch it
# cannot take: re-raised with the batch named. Exact types only: subclasses (torch.OutOfMemoryError, fzero's own
# RanksDisagree) and the user's own exception types pass unchanged.
_PLAIN_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError)


class LossFnInContext:
    """``loss_fn``, whose plain errors on a batch say which batch: a raw "mat1 and mat2 shapes cannot be multiplied"
    from deep inside the model becomes the same exception type with the batch's leaves, shapes and dtypes and, where
    the message tells, what the model expected; the original stays as ``__cause__``, so no user error is hidden.
    Errors that already name fzero's API pass unchanged. ``split``: the batch was split (mesh ranks, micro-batches).

    Its first call with a graph (the first micro-batch of the first step) also checks what only a forward shows:
    that the modules run hold nothing a step cannot train (``check_module_features``: a ``torch.compile`` wrapper,
    sparse gradients; at stages 0-1, state params that name a module's buffer: ``check_no_trained_buffers``), that the
    loss depends on no parameter of a module's own (``check_own_params``), that ``loss_fn`` uses no value read off a
    module after the forward replaced it (``fzero.step._stale``: an auxiliary loss kept on the module) and, under
    ``dist_mesh``, that every rank ran modules of the same structure (``agree_structure``). Later calls pay nothing
    for it."""

    __slots__ = ("fn", "split", "units", "checked")

    def __init__(self, fn: Callable[..., Any], *, split: bool, units: bool = False) -> None:
        self.fn = fn
        self.split = split
        self.units = units  # the step runs units (stages 2-3): their params are meta tensors outside their calls
        self.checked = False

    def __call__(self, params: Any, batch: Any) -> Any:
        if self.checked or not torch.is_grad_enabled():  # checked already, or an evaluation (no graph to check)
            return self._run(params, batch)
        from fzero.step._context import watching_apply

        stale = StaleWatch()
        try:
            with watching_apply() as modules, with_context(stale=stale):
                out = self._run(params, batch)
        finally:
            stale.restore()  # the user's modules hold their own tensors again (fzero.step._stale)
        check_module_features(modules)  # first: a compiled submodule would be blamed on its own params below
        if not self.units and isinstance(params, Mapping):  # stages 2-3 refuse it as their copy of the module is made
            check_no_trained_buffers(params, modules)
        loss = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            check_own_params(loss, modules)
        comm = current_context().comm
        if comm is not None:  # every rank reaches this at its first step's first forward, so the calls pair up
            agree_structure(comm, modules)
        # once per step object (ranks of a local mesh run one module, checked alike), and only once passed: a rank
        # that comes to its first forward after another has begun (or failed) the checks must check too, or it runs
        # on past a refusal into torch's own error, which, on a lower rank, is the one raised
        self.checked = True
        return out

    def _run(self, params: Any, batch: Any) -> Any:
        trained = current_context().trained
        if trained is not None and getattr(type(params), "run_module", None) is None:  # stages 0-1: which modules
            trained.give(params)  # fzero.apply runs with these (Trained)
        try:
            return self.fn(params, batch)
        except _PLAIN_ERRORS as e:
            if type(e) not in _PLAIN_ERRORS or str(e).startswith("fzero"):
                raise
            raise type(e)(loss_fn_failure(e, batch, split=self.split, units=self.units, params=params)) from e


def gradient(loss_fn: Callable, as_params: Callable, inputs: list[torch.Tensor], batch: Any, scale: float, autodiff: str,
             buffers: dict[str, torch.Tensor], dtype: torch.dtype | None = None, into: Callable | None = None,
             on_written: Callable[[list[int]], list[str]] | None = None, reader: Any = None):
    """Gradient of ``loss_fn(as_params(inputs), batch) * scale`` with respect to ``inputs``; and the loss, aux
    and the buffers after the forward (``buffers``: their values before it, never written; ``dtype``: the
    compute dtype floating buffers meet the params in; ``into``: under plain autograd, a function that gives the
    leaves ``.grad`` buffers to accumulate into, in place, returning True if it did: see
    ``fzero.step._parts.ParamView``; ``on_written``: called with the indices of the inputs the forward wrote in
    place, if it wrote any (under plain autograd before the backward, under torch.func after the transform; before
    the update either way): it raises where the write would be lost, else returns the names of the params written,
    which a backward that fails on the write then names; ``reader``: the state's record of what it read of the
    module's buffers, ``StateMeta.reader``).

    By ``torch.func.grad`` or by plain ``torch.autograd.grad`` on leaf aliases of ``inputs``. torch.func
    unwraps only tensors out of aux, so the non-tensor leaves of aux are kept aside and put back.
    """
    box: dict[str, Any] = {}

    def objective(xs):
        bank = Buffers(buffers, lift=lift_for(autodiff, xs[0].detach() if xs else None), dtype=dtype, reader=reader)
        with step_buffers(bank):
            loss, aux = split_loss(loss_fn(as_params(xs), batch))
        leaves, box["spec"] = optree.tree_flatten(aux)
        box["leaves"] = leaves
        scaled = loss if scale == 1.0 else loss.float() * scale  # fp16: the loss scale, in fp32
        return box["bind"](scaled), (loss, [x for x in leaves if isinstance(x, torch.Tensor)], bank.result())

    with backward_context() as box["bind"]:  # its backward finds this rank's context in autograd's device thread
        return _gradient(objective, box, inputs, autodiff, into, on_written, loss_fn)


def _gradient(objective: Callable, box: dict, inputs: list[torch.Tensor], autodiff: str, into: Callable | None,
              on_written: Callable | None, loss_fn: Callable):
    if autodiff == "func":
        versions = [x._version for x in inputs] if on_written is not None else []
        try:
            with step_scope(), _named_freed_failure(getattr(loss_fn, "units", False), autodiff):
                grads, (loss, tensors, new_buffers) = torch.func.grad(objective, has_aux=True)(inputs)
        except RuntimeError as e:
            if "backward() called inside a functorch transform" in str(e):
                raise RuntimeError(_BACKWARD_IN_LOSS_FN.format(error=str(e).splitlines()[0].split("raised RuntimeError: ")[-1])) from e
            if any(m in str(e) for m in _FUNC_REFUSALS):
                raise RuntimeError(_func_refusal(str(e).splitlines()[0], frames=_traceback_files(e))) from e
            raise
        # torch.func writes through to the inputs as plain autograd does: refused alike where the write would be lost
        # (before: not looked for, so on 2 ranks each rank's write landed in its own copy, 2e-4 off DDP, silently)
        written = [i for i, (x, v) in enumerate(zip(inputs, versions)) if x._version != v]
        if written and on_written is not None:
            on_written(written)
    else:
        leaves = [x.detach().requires_grad_() for x in inputs]  # aliases of the state's buffers, as leaves
        versions = [x._version for x in leaves] if on_written is not None else []  # (a detached alias shares the counter)
        with torch.enable_grad(), step_scope():  # modules keep their params until backward is done (checkpoint)
            # (under enable_grad: the hooks note usage only where a gradient is being built, fzero.step._context.active)
            in_place = into is not None and into(leaves)
            scaled, (loss, tensors, new_buffers) = objective(leaves)
            written = [i for i, (x, v) in enumerate(zip(leaves, versions)) if x._version != v]
            kept = on_written(written) if written and on_written is not None else []
            with _named_meta_failure(getattr(loss_fn, "units", False)), _named_reentrant_failure(), \
                    _named_freed_failure(getattr(loss_fn, "units", False), autodiff), _named_second_backward(), \
                    _named_kept_write_failure(kept):
                if in_place:  # each param's gradient added to its .grad as soon as it exists, then freed
                    if scaled.requires_grad:
                        torch.autograd.backward(scaled, inputs=leaves)
                    grads = [leaf.grad for leaf in leaves]
                elif scaled.requires_grad:
                    grads = list(torch.autograd.grad(scaled, leaves, allow_unused=True, materialize_grads=True))
                else:  # a loss that does not depend on the params: a zero gradient, as torch.func.grad gives
                    grads = [torch.zeros_like(x) for x in leaves]
            _refuse_skipped_reentrant_checkpoint(scaled)
            del leaves
        loss, tensors = loss.detach(), [t.detach() for t in tensors]
        new_buffers = per_tensor(new_buffers, lambda k, v: v.detach())
    it = iter(tensors)
    aux = box["spec"].unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in box["leaves"]])
    return grads, loss, aux, new_buffers


def _refuse_skipped_reentrant_checkpoint(loss: torch.Tensor) -> None:
    """After a micro-batch's backward: refuse a reentrant checkpoint whose backward autograd skipped (see
    ``REENTRANT_HINT``). The graph is walked only where some param has had no gradient yet in this step, which
    such a skip always leaves (the params inside the block), so a step that used every param pays nothing."""
    usage = current_context().usage
    unused = usage.unused() if usage is not None else None
    if unused == [] or loss.grad_fn is None or not holds_reentrant_checkpoint(loss.grad_fn):
        return
    names = f": {', '.join(unused[:3])}{f' and {len(unused) - 3} more' if len(unused) > 3 else ''}" if unused else ""
    raise RuntimeError(REENTRANT_HINT.format(what=f", so these params got no gradient{names}"))


@contextlib.contextmanager
def _named_second_backward() -> Iterator[None]:
    """torch's "Trying to backward through the graph a second time" from the step's backward: what a ``loss_fn``
    written as a plain PyTorch step (``loss.backward()`` inside it) meets, named with its cause and fix."""
    try:
        yield
    except RuntimeError as e:
        if "backward through the graph a second time" not in str(e) or str(e).startswith("fzero"):
            raise
        raise RuntimeError(_SECOND_BACKWARD.format(error=str(e).splitlines()[0])) from e


@contextlib.contextmanager
def _named_kept_write_failure(written: list[str]) -> Iterator[None]:
    """torch's "one of the variables needed for gradient computation has been modified by an inplace operation" from
    the backward of a forward that wrote ``written`` (params, by name) in place where the write is kept (one rank,
    stages 0-1): the params of a unit are views of one flat buffer and share its version counter, so a write into one
    marks every param of the unit that the backward saved as changed, where PyTorch tracks each param on its own (a
    weight clamped under no_grad in the second block failed the first block's backward; before: torch's message alone)."""
    try:
        yield
    except RuntimeError as e:
        if not written or "modified by an inplace operation" not in str(e) or str(e).startswith("fzero"):
            raise
        raise RuntimeError(_KEPT_WRITE.format(names=written[:6], more=" ..." if len(written) > 6 else "",
                                              error=str(e).splitlines()[0])) from e


_KEPT_WRITE = """fzero.Step: the forward wrote a param in place, one of {names}{more} (nn.Embedding(max_norm=...) renormalizes
the rows it looks up in place; so does a weight clamped under torch.no_grad()), and the backward then found a tensor
it had saved changed (torch: {error}).
At stages 0-1 the params of one unit are views of one flat buffer and share its version counter, so a write into one
param marks every param of its unit that the backward saved as changed; plain PyTorch tracks each param on its own
(where the written param itself was saved before the write, plain PyTorch fails the same way).
Fix: give each param a buffer of its own, compile(..., unit_elements=1), with which the write is kept as in PyTorch;
or train without the in-place write."""


@contextlib.contextmanager
def _named_reentrant_failure() -> Iterator[None]:
    """The backward of a graph with a reentrant checkpoint that autograd reached: torch's own refusal, with fzero's
    cause and fix (``REENTRANT_HINT``), the original error as its cause."""
    try:
        yield
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e) or str(e).startswith("fzero"):
            raise
        raise RuntimeError(REENTRANT_HINT.format(what="") + f"\n(torch: {str(e).splitlines()[0]})") from e


@contextlib.contextmanager
def _named_meta_failure(units: bool) -> Iterator[None]:
    """The backward of a step that runs units: an error on a meta tensor gets its likely cause (a unit's layers called
    again outside the unit, from an autograd Function's backward), the original error as its cause."""
    try:
        yield
    except RuntimeError as e:
        if not units or type(e) is not RuntimeError or not _META.search(str(e)) or str(e).startswith("fzero"):
            raise
        raise RuntimeError(f"fzero.Step: the backward raised RuntimeError: {e}\n{UNIT_OUTSIDE_ITS_CALL}") from e


@contextlib.contextmanager
def _named_freed_failure(units: bool, autodiff: str) -> Iterator[None]:
    """A backward at stage 3 that read a unit's freed buffer (torch's bare "setStorage: ... out of bounds for storage
    of size 0"): its cause and fixes (``UNIT_FREED``), the original error as its cause."""
    try:
        yield
    except RuntimeError as e:
        if not units or type(e) is not RuntimeError or not _FREED.search(str(e)) or str(e).startswith("fzero"):
            raise
        raise RuntimeError(f"fzero.Step: the backward raised RuntimeError: {str(e).splitlines()[0]}\n"
                           + UNIT_FREED.format(how=_FREED_HOW.get(autodiff, ""))) from e


def split_loss(out: Any, *, api: str = "fzero.train_step") -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` of what ``loss_fn`` returned, checked; ``api``: who called it (a step, or ``step.evaluate``)."""
    loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{api}: loss_fn must return a scalar tensor or a (loss, aux) pair; got {type(out).__name__}. "
            f"Return e.g. F.cross_entropy(logits, y), or (loss, {{'acc': acc}})."
        )
    if loss.dim() != 0 or not loss.is_floating_point():
        why = "(an integer loss has no gradient)" if api == "fzero.train_step" else "(the ranks' losses are averaged)"
        raise ValueError(
            f"{api}: loss_fn must return a 0-d floating-point loss; got a {loss.dtype} tensor of shape "
            f"{tuple(loss.shape)}. " + ("Reduce it to a scalar, e.g. loss.mean()." if loss.is_floating_point() else
                                         f"Compute it in floating point {why}, e.g. loss.float().")
        )
    return loss, aux
