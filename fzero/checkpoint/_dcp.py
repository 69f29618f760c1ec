"""torch.distributed.checkpoint (DCP) glue for ``fzero.checkpoint``: planners over ranged 1-D chunks, a
bounded-memory writer, and a metadata reader that unpickles nothing but DCP's own metadata classes.

Why custom planners rather than DTensors: a rank's piece of a flat unit buffer is, for every parameter
it touches, one contiguous range of that parameter's flattened elements. DCP stores chunks of a
logical tensor with explicit offsets and reshards by overlapping saved chunks with requested ones, so
each rank can *write* the ranges it holds and *read* the ranges it needs directly: no all-gather on save
or load, no whole unit in memory, and a local mesh (every rank in one process) or a single process
uses the same code. DCP's ``Shard(0)`` DTensor chunking would force the parameter-aligned chunk layout,
which ZeRO's unit-aligned shards do not have. The files are standard DCP files: any DCP reader sees
1-D tensors ``params/<name>`` etc.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import warnings
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fzero.checkpoint import _interrupts

FILE_BYTES = 64 << 20  # a rank's data files are cut at about this size: DCP keeps a file's tensors alive until it closes


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit the state it is loaded into."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """A chunk of one logical tensor that this process writes; ``get()`` returns its data (lazily)."""

    fqn: str
    size: tuple[int, ...]  # the logical tensor's shape
    offset: tuple[int, ...]  # where the chunk starts in it
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Dest:
    """A chunk of one logical tensor that this process reads: into ``view``, or into ``write(offset, data)``."""

    fqn: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: torch.Tensor | None = None
    write: Callable[[int, torch.Tensor], None] | None = None  # (element offset inside this chunk, data): offloaded state


class _SavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(p.fqn, torch.Size(p.offset)): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(p.fqn, torch.Size(p.offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.offset), sizes=torch.Size(p.shape)),
                    properties=TensorProperties(dtype=p.dtype),
                    size=torch.Size(p.size),
                ),
            )
            for p in self.pieces.values()
        ]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        _interrupts.check()  # a Ctrl-C held back while torch.save ran C++: raised here, between two tensors
        return self.pieces[(index.fqn, index.offset)].get()


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self, dests: list[Dest]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.dests: dict[str, list[Dest]] = {}
        for d in dests:
            self.dests.setdefault(d.fqn, []).append(d)

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, dests in self.dests.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(d.offset), sizes=torch.Size(d.shape)) for d in dests]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)  # index = list position
        return LoadPlan(items)

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        d = self.dests[read_item.dest_index.fqn][read_item.dest_index.index]
        if d.view is None:  # into a file: a buffer the size of this read, written out in commit_tensor
            return torch.empty(tuple(read_item.lengths), dtype=d.dtype)
        view = d.view
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        d = self.dests[read_item.dest_index.fqn][read_item.dest_index.index]
        if d.view is None:
            d.write(int(read_item.dest_offsets[0]) if read_item.dest_offsets else 0, tensor)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer with a rank's items cut into files of about ``FILE_BYTES``.

    DCP's writer keeps every tensor of a file referenced until the file is done, and it copies each
    chunk that is a view of a larger buffer (ours are views of flat unit buffers). With one file per
    rank that briefly doubles the rank's state in memory; with files of bounded size it costs one file.
    """

    def write_data(self, plan: SavePlan, planner: Any):
        write = getattr(self, "_write_data", None)
        prefix = getattr(plan.storage_data, "prefix", None)
        if write is None or prefix is None:  # another torch: its own grouping (correct, more memory)
            return super().write_data(plan, planner)
        files: queue.Queue = queue.Queue()
        bucket: list[WriteItem] = []
        size = 0
        for item in plan.items:
            bucket.append(item)
            size += item.tensor_storage_size() or 0
            if size >= FILE_BYTES:
                _put(self, files, prefix, bucket)
                bucket, size = [], 0
        if bucket or files.empty():
            _put(self, files, prefix, bucket)
        return write(planner, files)


def _put(writer: Any, files: queue.Queue, prefix: str, bucket: list) -> None:
    name = f"{prefix}{files.qsize()}.distcp"
    files.put((writer.fs.concat_path(writer.path, name), name, bucket))


# -- reading DCP's metadata without running code --------------------------------------------------------

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only DCP's metadata dataclasses, ``torch.Size`` and dtypes: a crafted ``.metadata`` cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not a DCP metadata class")


def read_metadata(path: str) -> Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, unpickled with the allow-list above."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"fzero.checkpoint: {path} has no .metadata (DCP's index of the data files): incomplete or not a checkpoint.") from None
    except MemoryError as e:
        raise out_of_memory(e, file, "fzero.checkpoint") from None
    except OSError as e:  # the file could not be read (denied, an I/O error): nothing says what it holds is damaged
        raise CheckpointError(f"fzero.checkpoint: {file} could not be read ({type(e).__name__}: {e}); fix the access to it "
                              f"and call again.") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged or foreign file
        raise CheckpointError(f"fzero.checkpoint: {file} is corrupted or not DCP metadata ({type(e).__name__}: {e}).") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"fzero.checkpoint: {file} does not hold DCP metadata (got {type(md).__name__}).")
    return md


class _Reader(dcp.FileSystemReader):
    """DCP's file reader with the metadata already read (by the allow-list unpickler) and the data files checked
    (``check``) before the first byte of them is used."""

    def __init__(self, path: str, metadata: Metadata, check: Callable[[list[str]], None]) -> None:
        super().__init__(path)
        self._metadata, self._check = metadata, check

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: Any):
        self._check(sorted({self.storage_data[item.storage_index].relative_path for item in plan.items}))
        return super().read_data(plan, planner)


# -- save and load ------------------------------------------------------------------------------------


def save(path: str, pieces: list[Piece], *, distributed: bool, explain: Callable[[BaseException], Exception | None],
         rank: int = 0) -> None:
    """Write ``pieces`` as a DCP checkpoint into the directory ``path`` (a collective when ``distributed``; ``rank``:
    this process's).

    ``explain(error)`` may turn a failure into a clearer error (a full disk, a read-only filesystem): DCP and
    torch.save wrap those in errors that do not name them.
    """
    writer = _Writer(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    _call(lambda: dcp.save({}, storage_writer=writer, planner=_SavePlanner(pieces), no_dist=not distributed), "save", path, explain,
          rank=rank)


def load(path: str, metadata: Metadata, dests: list[Dest], *, check: Callable[[list[str]], None]) -> None:
    """Read ``dests`` from the checkpoint at ``path``. No collective: every process reads what it needs.

    ``check(names)`` is called with the data files this process is about to read, before it reads them (it
    verifies their checksums, and raises ``CheckpointError`` if one differs).
    """
    missing = sorted({d.fqn for d in dests} - set(metadata.state_dict_metadata))
    if missing:
        raise CheckpointError(f"fzero.checkpoint.load: {path} lacks the tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}.")
    _call(lambda: dcp.load({}, storage_reader=_Reader(path, metadata, check), planner=_LoadPlanner(dests), no_dist=True), "load", path, None)


def _call(fn: Callable[[], Any], what: str, path: str, explain: Callable[[BaseException], Exception | None] | None, *,
          rank: int = 0) -> Any:
    hint = "could not read the data (a data file is corrupted or was changed)" if what == "load" else "could not write the checkpoint"
    with warnings.catch_warnings():  # DCP warns that no_dist means one process: that is what we ask for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            return fn()
        except CheckpointException as e:  # a BaseException: catch it by name, re-raise as an Exception
            stop = _interrupts.stop_signal(e, rank=rank)
            if stop is not None:  # Ctrl-C (or SystemExit) of this process, which DCP wrapped: a request to stop, as itself
                raise stop from None
            memory = next((exc for exc, _tb in e.failures.values() if isinstance(exc, MemoryError)), None)
            if memory is not None and what == "load":
                raise out_of_memory(memory, path, "fzero.checkpoint.load") from None
            ours = [exc for exc, _tb in e.failures.values() if isinstance(exc, CheckpointError)]
            if ours:  # our own check failed inside DCP (a checksum): it says it best
                raise ours[0] from None
            better = explain(e) if explain else None
            if better is not None:
                raise better from None
            failures = "; ".join(f"rank {r}: {_first_line(exc)}" for r, (exc, _tb) in sorted(e.failures.items()))
            raise CheckpointError(f"fzero.checkpoint.{what}: {path}: {hint}: {failures or e}") from None
        except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, AssertionError, KeyError) as e:
            stop = _interrupts.stop_signal(e, rank=rank)
            if stop is not None:
                raise stop from None
            better = explain(e) if explain else None
            if better is not None:
                raise better from None
            raise CheckpointError(f"fzero.checkpoint.{what}: {path}: {hint}: {_first_line(e)}") from None


def out_of_memory(error: MemoryError, path: str, api: str) -> MemoryError:
    """The ``MemoryError`` of a read of the checkpoint at ``path``, as one that names it and says it is not damaged.

    Why: the host running out of memory while a load read ``.metadata`` or the data files was reported as a
    ``CheckpointError``, ".metadata is corrupted or not DCP metadata" or "a data file is corrupted or was changed",
    which tells the user to discard a good checkpoint, where freeing memory and loading again is the fix. Still a
    ``MemoryError``, so that what handles one (a loop that frees memory and retries) sees it as one."""
    return MemoryError(f"{api}: ran out of host memory while reading {path} ({_first_line(error).rstrip(': ')}); nothing says the "
                       f"checkpoint is damaged. Free host memory (another state or model, DataLoader workers) and load "
                       f"again; `python -m fzero.checkpoint verify` checks its files without loading them.")


def _first_line(e: BaseException) -> str:
    if isinstance(e, pickle.UnpicklingError):  # torch.load's long advice to retry with weights_only=False: never here
        return f"{type(e).__name__}: not a valid tensor record (torch.load(weights_only=True) refused it)"
    line = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {line[:300]}"
