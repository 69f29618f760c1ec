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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import optree
import torch
from torch import nn

from fzero.mesh import current_context, with_context
from fzero.layout import pytrees as _tree
from fzero.step._module import Buffers, check_module_features, lift_for
from fzero.step._refusals import check_no_trained_buffers
from fzero.step._context import per_tensor, step_buffers, step_scope
from fzero.step._reentrant import REENTRANT_HINT, holds_reentrant_checkpoint
from fzero.step._stale import StaleWatch


_NOT_PER_ROW = ("a tensor that is not per row (a per-class weight, a lookup table) goes into loss_fn's closure, "
                "where every rank and micro-batch sees it whole, not into the batch; a 0-d tensor in the batch is "
                "given whole to every rank")


def split_batch(batch: Any, n: int, *, api: str = "fzero.Step.__call__", grad_accum: int = 1,
                generators: list[tuple[torch.Generator, list[torch.Generator]]] | None = None) -> list[Any]:
    """Split the global ``batch`` into n equal per-rank batches on its rows (see the module's docstring). Each rank
    gets tensors of its own (copies): the ranks of a local mesh run at once, and views of one tensor share its version
    counter, so one rank's in-place write (labels masked with ``y[y == 0] = -100``) would break another's backward, or
    (a 0-d leaf) change what the other rank reads, as no two torchrun processes can. A ``torch.Generator`` in the
    batch (noise drawn in ``loss_fn`` with ``generator=batch["gen"]``) is each rank's own copy too, in the state the
    caller's is in: shared, the rank threads drew from one stream in the order they ran (other numbers at every run),
    where each torchrun process draws from its own generator, seeded alike. ``generators``: where each such
    generator is noted beside its per-rank copies, for the caller to give it rank 0's state once the step has
    succeeded (``keep_rank0_generators``), as a module's own generator is kept. ``api``: whose batch it is, for
    the errors (a step's, or ``evaluate``'s); ``grad_accum``: the micro-batches each rank's share is split into next,
    so that rows that do not divide by ``n * grad_accum`` are named as the global batch the caller passed, not as a
    rank's share the caller never saw."""
    if n > 1:
        batch = _own_generators(batch, n, [] if generators is None else generators)
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


def _own_generators(batch: Any, n: int, noted: list[tuple[torch.Generator, list[torch.Generator]]]) -> Any:
    """``batch`` with each ``torch.Generator`` leaf (inside dataclasses and mappings too) replaced by n copies of it,
    one per rank (``_PerRank``), each noted beside the original in ``noted``. A generator the batch names twice
    (``{"gen": g, "aug": {"gen": g}}``) is one stream, as on a torchrun process: each rank gets one copy for both."""
    def own(x: Any) -> Any:
        if isinstance(x, torch.Generator):
            for original, copies in noted:
                if original is x:
                    return _PerRank(copies)
            copies = []
            for _ in range(n):
                g = torch.Generator(device=x.device)
                g.set_state(x.get_state())
                copies.append(g)
            noted.append((x, copies))
            return _PerRank(copies)
        children = _children(x)
        if children is not None:
            owned = {name: _own_generators(child, n, noted) for name, child in children.items()}
            if all(owned[name] is child for name, child in children.items()):
                return x  # no generator inside: the container as given (its __post_init__ not run again)
            return _rebuilt(x, owned)
        return x

    if not any(isinstance(x, torch.Generator) or _children(x) is not None for x in _tree.tree_leaves(batch)):
        return batch
    return _tree.tree_map(own, batch)


def keep_rank0_generators(generators: list[tuple[torch.Generator, list[torch.Generator]]]) -> None:
    """Give each ``torch.Generator`` of the caller's batch the state its rank-0 copy ended the step in (what a torchrun
    job's rank 0 holds after it), once the step has succeeded (``split_batch``)."""
    for original, copies in generators:
        original.set_state(copies[0].get_state())


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
            f"batch as (batch, seq, ...), transposed inside loss_fn: on dim 0 it would be split along its time steps."
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
_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


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
        try:
            return self.fn(params, batch)
        except _PLAIN_ERRORS as e:
            if type(e) not in _PLAIN_ERRORS or str(e).startswith("fzero"):
                raise
            raise type(e)(loss_fn_failure(e, batch, split=self.split, units=self.units)) from e


def check_own_params(loss: torch.Tensor, modules: list[nn.Module]) -> None:
    """Refuse a loss whose graph reaches a module's own ``nn.Parameter`` (an autograd leaf of its own).

    Inside ``fzero.apply`` the module holds the step's params; outside it, its own tensors, which the step neither
    differentiates nor updates. An L2 term summed over ``model.parameters()`` after ``fzero.apply`` returned would
    count in the loss but add nothing to the gradient (measured: grad norm 0.955 instead of 40.3), silently. One walk
    of the first step's graph finds such leaves; the step's own leaves are plain tensors, never ``nn.Parameter``."""
    found: dict[int, nn.Parameter] = {}
    # Visited nodes by id, each kept alive: a node's Python object can be made on demand and freed once the walk
    # moves on (torch 2.11 does), and a new one could then take its address, so a set of ids alone would skip
    # nodes never visited (on the H100 machine with torch 2.11 the walk saw 3 nodes of this check's own test).
    seen: dict[int, Any] = {}
    todo = [loss.grad_fn]
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(loss):  # under torch.func.grad the module's leaves are in the level below
        loss = functorch.get_unwrapped(loss)
        todo.append(loss.grad_fn)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the graph reaches this leaf
        if isinstance(leaf, nn.Parameter):
            found[id(leaf)] = leaf
        todo.extend(fn for fn, _ in node.next_functions)
    if not found:
        return
    named = {id(p): name for m in modules for name, p in m.named_parameters(remove_duplicate=False)}
    described = [repr(n) for i, n in named.items() if i in found]  # in the module's order
    described += [f"a parameter of shape {tuple(p.shape)}" for i, p in found.items() if i not in named]
    more = f", ... {len(described) - 4} more" if len(described) > 4 else ""
    raise ValueError(
        f"fzero.Step: the loss depends on the module's own parameters ({', '.join(described[:4])}{more}), not on the "
        f"params loss_fn was given: outside fzero.apply(model, params, ...) the module holds its own tensors, which this "
        f"step neither differentiates nor updates, so such a term would count in the loss but not in the gradient. "
        f"(Inside a method that fzero.apply runs, self.parameters() at stage 3 holds a unit's params only while that "
        f"unit runs; read elsewhere, they are not the step's.) Compute it from params, e.g. an L2 term as "
        f"sum((p ** 2).sum() for p in params.values()) (or weight decay in the optimizer: fzero.optim.adamw(lr, "
        f"weight_decay=...)); a tensor that should not train goes in as a constant (.detach())."
    )


def agree_structure(comm: Any, modules: list[nn.Module]) -> None:
    """Under ``dist_mesh``, check that every rank ran modules of one structure: each submodule's path, type and
    settings (``extra_repr``), in order. Parameter names and shapes are agreed at ``Step.init``; a parameter-free
    op (GELU on one rank, Tanh on another) changes neither, and the ranks would average gradients of different
    models."""
    fields = []
    for i, module in enumerate(modules):
        model = f" of model #{i} fzero.apply ran" if len(modules) > 1 else ""
        fields += [(f"the module at {path or '<root>'!r}{model}", f"{type(m).__qualname__}({m.extra_repr()})")
                   for path, m in module.named_modules()]
    comm.agree(fields, api="fzero.Step.__call__ (the first step's fzero.apply)", fix=(
        "Every rank must run the same model: build it from the same code and config on every rank, and keep "
        "rank-dependent choices out of it."))


# torch's messages for operands of two dtypes ("mat1 and mat2 must have the same dtype, but got Double and Float",
# "expected scalar type Float but found Double", "Input type (double) and bias type (float) should be the same")
_DTYPES = re.compile(r"same dtype|expected scalar type|found dtype|type \(\w+\) and \w+ type \(\w+\) should be the same")
DTYPE_MISMATCH = (
    "  Two dtypes met in one op. The state's params keep the dtype step.init made them in (the precision policy's "
    "compute dtype, else the params' own); the batch and the module's own tensors (frozen params, buffers) meet them "
    "there. A module cast after step.init (model.half(), model.double(), model.to(dtype)) does not change the state, "
    "so its params are still the old dtype: make a state from the cast model (step.init(fzero.params_of(model))), or "
    "leave the model as it was and train in low precision with compile(precision='bf16' or 'fp16').")
_META = re.compile(r"\bmeta\b")  # "Tensor on device meta is not on the expected device", "... meta tensor(s)"
UNIT_OUTSIDE_ITS_CALL = (
    "  A meta tensor (a shape without a value) was used. At stages 2-3 a unit's params are meta tensors except while "
    "the unit itself is called (fzero.units_of(model) lists the units), so a module inside a unit that runs without "
    "its unit's own call reads them: a forward that calls a unit's submodule directly (self.blocks[0][0](x) where "
    "the unit is 'blocks.0'), an autograd Function that calls a unit's layers again in its backward (reversible "
    "layers), or a method fzero.apply runs that reads params outside their unit's call (self.parameters() for an L2 "
    "term, self.blocks[0][0].weight). Choose units the model calls as a whole (units=fzero.units_of(model, "
    "module_types=...)), leave that module in the root unit (units=... without it), compute such a term from the "
    "params loss_fn was given, or train at stage 1."
)


# what a forward that writes a param in place does instead (the step's refusal, ``fzero.step._step``, and the hint below)
PARAM_WRITE_FIX = (
    "Train without the in-place write (nn.Embedding(max_norm=None), and renormalize in the loss or on the params "
    "between steps), or on one rank at stage 0 or 1 with fp32 params and no offload, where it lands in the train state "
    "itself."
)
PARAM_WRITTEN_AT_STAGE_2_3 = (
    "  The view written is most likely a param: at stages 2-3 a unit's params are views that fzero's Functions make "
    "for the unit's call, and the forward wrote one in place (nn.Embedding(max_norm=...) renormalizes the rows it looks "
    "up in place; so does a model that edits a weight under torch.no_grad()). Cloning is not the fix here: the write "
    "would go to the unit's buffer, which is dropped after the call, so the train state would never see it. "
    + PARAM_WRITE_FIX
)


# an attribute read from the user's module in loss_fn, which a forward sets on self (an auxiliary loss kept on the module)
MODULE_ATTRIBUTE_IN_A_STEP = (
    "  If the forward sets {cls}.{name} (an auxiliary loss kept on the module, as MoE layers keep theirs) and loss_fn "
    "reads it after fzero.apply: within a step fzero.apply runs fzero's copy of the module, and what its forward writes "
    "on self reaches your module only when the step returns. So loss_fn reads your module's value from before the step "
    "(none here; a value set in __init__ or by an earlier step is read silently, without a gradient). Return it from "
    "forward (return out, self.{name}), or call through a method that returns it: fzero.apply(model.method, params, "
    "x) runs `method` on the module holding the params, so `self` there is the copy the forward wrote."
)


def loss_fn_failure(error: BaseException, batch: Any, *, split: bool = False, units: bool = False) -> str:
    """The message for ``error`` raised by ``loss_fn(params, batch)``: the original first, then the batch, then a hint.
    ``units``: the step runs units (stages 2-3), where a meta tensor in the error has a cause fzero can name."""
    original = repr(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    which = "this rank's share of the batch" if split else "the batch"
    lines = [f"fzero.Step: loss_fn(params, batch) raised {type(error).__name__}: {original}",
             f"  on {which}: {describe_batch(batch)}."]
    if batch is None:
        lines.append("  The batch is None: step(state, batch) hands it to loss_fn as it is; pass the batch loss_fn reads "
                     "(e.g. a dict of tensors from your loader).")
    match = _MATMUL.search(str(error))
    if match is not None:
        got, want = int(match.group(2)), int(match.group(3))
        leaves = [f"{(p or '<root>')!r} has shape {tuple(x.shape)}" for p, x in _tensor_leaves(batch) if x.dim() and x.shape[-1] == got]
        lines.append(f"  A matmul of the model (an nn.Linear?) expects {want} features in the last dim and got {got}"
                     + (f": batch leaf {', '.join(leaves[:3])}." if leaves else ".") + " Pass inputs of the size the model was built for.")
    elif isinstance(error, KeyError) and isinstance(batch, dict):
        lines.append(f"  The batch has keys {sorted(map(str, batch))[:8]}.")
    elif _DTYPES.search(str(error)):
        lines.append(DTYPE_MISMATCH)
    elif units and _META.search(str(error)) and any(x.is_meta for _, x in _tensor_leaves(batch)):
        lines.append("  The batch holds meta tensors (shapes without values): pass a batch with values, on the device "
                     "the model runs on.")
    elif units and _META.search(str(error)):
        lines.append(UNIT_OUTSIDE_ITS_CALL)
    elif units and "created inside a custom Function" in str(error) and "modified inplace" in str(error):
        lines.append(PARAM_WRITTEN_AT_STAGE_2_3)
    elif (isinstance(error, AttributeError) and isinstance(getattr(error, "obj", None), nn.Module)
          and isinstance(missing := getattr(error, "name", None), str) and not missing.startswith("_")):
        lines.append(MODULE_ATTRIBUTE_IN_A_STEP.format(cls=type(getattr(error, "obj")).__name__, name=missing))
    lines.append("  The error is in loss_fn or the model it runs; its own traceback is the cause above.")
    if isinstance(error, KeyError):  # KeyError shows its message as a repr: one line reads better
        return " ".join(line.strip() for line in lines)
    return "\n".join(lines)


def _tensor_leaves(batch: Any) -> list[tuple[str, torch.Tensor]]:
    if batch is None:
        return []
    paths, leaves, _ = _tree.flatten_with_paths(batch)
    return [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]


def describe_batch(batch: Any, *, limit: int = 8) -> str:
    """``{x: float32 (8, 5), y: float32 (8, 2)}``: each leaf's path with its dtype and shape (or its type)."""
    if batch is None:
        return "None"
    try:
        paths, leaves, _ = _tree.flatten_with_paths(batch)
    except Exception:  # noqa: BLE001 - a batch optree cannot flatten is described by its type
        return f"a {type(batch).__name__}"
    parts = [f"{p or '<root>'}: " + (f"{str(x.dtype).replace('torch.', '')} {tuple(x.shape)}"
                                     + (f" on {x.device}" if x.device.type != "cpu" else "") if isinstance(x, torch.Tensor)
                                     else type(x).__name__) for p, x in zip(paths, leaves)]
    more = f", ... {len(parts) - limit} more" if len(parts) > limit else ""
    return "{" + ", ".join(parts[:limit]) + more + "}" if parts else f"a {type(batch).__name__} without tensors"


def gradient(loss_fn: Callable, as_params: Callable, inputs: list[torch.Tensor], batch: Any, scale: float, autodiff: str,
             buffers: dict[str, torch.Tensor], dtype: torch.dtype | None = None, into: Callable | None = None,
             on_written: Callable[[list[int]], None] | None = None, reader: Any = None):
    """Gradient of ``loss_fn(as_params(inputs), batch) * scale`` with respect to ``inputs``; and the loss, aux
    and the buffers after the forward (``buffers``: their values before it, never written; ``dtype``: the
    compute dtype floating buffers meet the params in; ``into``: under plain autograd, a function that gives the
    leaves ``.grad`` buffers to accumulate into, in place, returning True if it did: see
    ``fzero.step._parts.ParamView``; ``on_written``: under plain autograd, called before the backward with the
    indices of the inputs the forward wrote in place, if it wrote any; ``reader``: the state's record of what it
    read of the module's buffers, ``StateMeta.reader``).

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
        return scaled, (loss, [x for x in leaves if isinstance(x, torch.Tensor)], bank.result())

    if autodiff == "func":
        try:
            with step_scope(), _named_freed_failure(getattr(loss_fn, "units", False), autodiff):
                grads, (loss, tensors, new_buffers) = torch.func.grad(objective, has_aux=True)(inputs)
        except RuntimeError as e:
            if "backward() called inside a functorch transform" in str(e):
                raise RuntimeError(_BACKWARD_IN_LOSS_FN.format(error=str(e).splitlines()[0].split("raised RuntimeError: ")[-1])) from e
            if any(m in str(e) for m in _FUNC_REFUSALS):
                raise RuntimeError(_func_refusal(str(e).splitlines()[0])) from e
            raise
    else:
        leaves = [x.detach().requires_grad_() for x in inputs]  # aliases of the state's buffers, as leaves
        versions = [x._version for x in leaves] if on_written is not None else []  # (a detached alias shares the counter)
        with torch.enable_grad(), step_scope():  # modules keep their params until backward is done (checkpoint)
            # (under enable_grad: the hooks note usage only where a gradient is being built, fzero.step._context.active)
            in_place = into is not None and into(leaves)
            scaled, (loss, tensors, new_buffers) = objective(leaves)
            written = [i for i, (x, v) in enumerate(zip(leaves, versions)) if x._version != v]
            if written and on_written is not None:
                on_written(written)
            with _named_meta_failure(getattr(loss_fn, "units", False)), _named_reentrant_failure(), \
                    _named_freed_failure(getattr(loss_fn, "units", False), autodiff), _named_second_backward():
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


# What torch.func.grad says when the model does what only plain autograd supports: torch.utils.checkpoint's
# saved-tensor hooks, requires_grad_() inside the transform (Hugging Face's enable_input_require_grads hook).
_FUNC_REFUSALS = ("functorch transform", "saved tensor hooks", "saved_tensors_hooks", "torch.func transforms don't yet support")
_FUNC_HINT = """fzero.Step (autodiff="func"): torch.func.grad refused what the model does in its forward: {error}
{cause} Build the step with plain autograd, which
supports it: fzero.compile(..., autodiff="autograd"){alternative}."""
_CHECKPOINT_CAUSE = """This is what a model with torch.utils.checkpoint inside it does (Hugging Face's gradient_checkpointing_enable() /
activation_checkpointing_enable(), or requires_grad_() on an activation), and a tensor made a leaf inside loss_fn
for torch.autograd.grad(..., create_graph=True) (a gradient penalty, WGAN-GP, R1)."""
_CHECKPOINT_ALTERNATIVE = """; or turn the model's checkpointing off and recompute with
fzero's own (compile(..., remat=True) per unit at every stage, or fzero.remat around any function)"""
_OLD_FUNCTION_CAUSE = """This is what a custom torch.autograd.Function written in the old style does (a static forward(ctx, ...)
with no setup_context staticmethod), as straight-through estimators, gradient reversal layers and fused kernels
in research code are written."""
_OLD_FUNCTION_ALTERNATIVE = """; or give the Function a setup_context staticmethod (forward without
ctx; https://pytorch.org/docs/stable/notes/extending.func.html)"""


def _func_refusal(error: str) -> str:
    """The message for torch.func.grad's refusal ``error`` (its first line): the model code that usually causes it,
    read from torch's words (only the cause differs), and the step setting that runs it."""
    if "setup_context" in error:
        cause, alternative = _OLD_FUNCTION_CAUSE, _OLD_FUNCTION_ALTERNATIVE
    else:
        cause, alternative = _CHECKPOINT_CAUSE, _CHECKPOINT_ALTERNATIVE
    return _FUNC_HINT.format(error=error, cause=cause, alternative=alternative)


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


_BACKWARD_IN_LOSS_FN = """fzero.Step: loss_fn (or the model) ran a backward over the loss already, as `loss.backward()` at the end of a
plain PyTorch training step does. fzero takes the gradient of what loss_fn returns and applies the update itself:
return the loss (or (loss, aux)) without calling backward(), zero_grad() or an optimizer. A gradient loss_fn needs
for itself (an input's gradient for an adversarial example) is taken with torch.autograd.grad(inner_loss, x) on a
forward of its own, or with retain_graph=True where it shares the loss's graph (plain autograd, the default).
(torch: {error})"""
_SECOND_BACKWARD = _BACKWARD_IN_LOSS_FN.replace("fzero.Step: loss_fn", "fzero.Step: the graph of the loss loss_fn "
                                                "returned was freed before the step's backward: loss_fn", 1)


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


_FREED = re.compile(r"out of bounds for storage of size 0")  # torch's setStorage error on a view of freed memory
UNIT_FREED = """  At stage 3 a unit's gathered params are freed after its forward and gathered again when the gradient reaches
the unit's return value. Here a tensor made inside a unit reached the loss another way while that return value
reached nothing in it{how}, so the backward read the freed params. Let the unit return that tensor (or use
what it returns), keep that module out of the units (units=... without it), or train at stage 2."""
_FREED_HOW = {
    "autograd": (" (a tensor stored on a module; what a forward hook or pre-hook on the unit or inside it keeps of its module's"
                 " output or inputs is refilled for)"),
    "func": (' (a tensor stored on a module, or kept by a forward hook, as Hugging Face\'s output capture keeps the hidden'
             ' state Llava\'s vision_feature_layer picks: under autodiff="func" no hook can gather in the backward;'
             ' autodiff="autograd" trains that as PyTorch does)'),
}


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
