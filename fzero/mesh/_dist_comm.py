"""The comm of ``dist_mesh``: one rank per process, every collective a ``torch.distributed`` call.

No per-call matching across ranks here (it would cost a round trip per collective): ``Step.init`` checks
once, with ``agree``, that every rank runs the same layout and settings (see ``fzero.mesh._comm``).

Every collective is issued asynchronously and waited for through ``fzero.mesh._waiting``, which ends the
wait when another rank fails, vanishes or does not arrive within the mesh timeout, with an error that names
that rank and this collective (its number on the mesh, op, tag, unit, and the step call it belongs to), read
from the job's fault board (``fzero.mesh._faults``). ``agree`` moves its descriptions the same way (two
all-gathers of bytes) rather than with ``all_gather_object``, which would wait without a bound.
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import torch
import torch.distributed as dist

from fzero.mesh import _p2p
from fzero.mesh._comm import Counter, Pending, RanksDisagree, Recording, disagreement, ranged
from fzero.mesh._faults import Board, Call
from fzero.mesh._waiting import Together, issued, wait

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The collectives that "auto" runs as exchanges on gloo: measured faster at every size a step moves (2-4x for the
# reduce-scatter, 1.3-1.7x for the all-gather on 64K-3.3M elements, benchmarks/gloo_collectives.py), whereas gloo's
# ring all-reduce beats an exchange's two rounds (0.75-0.95x).
AUTO_EXCHANGES = ("all_gather", "reduce_scatter")

CALLS_FIX = ("Under fzero.dist_mesh every rank makes the same fzero calls in the same order: Step.__call__, "
             "Step.evaluate, Step.gather and Step.state_dict are collectives, so call them on every rank (keep only "
             "printing and writing your own files on rank 0; fzero.checkpoint.save and load are collectives too), with "
             "the same number of steps on every rank.")


def host_stage(group: Any) -> torch.device | None:
    """Where a host tensor goes for a collective over ``group``: nowhere (None: it is reduced on the host) where gloo
    serves the group, and this process's CUDA device on a torch.distributed group without gloo. Why: NCCL alone
    (``dist.init_process_group("nccl")`` before ``fzero.dist_mesh()``, as ``deepspeed.init_distributed()`` makes it, or
    Lightning's ``process_group_backend="nccl"``) takes CUDA tensors only, and every host tensor fzero reduces (a flag:
    "did any rank fail?", a count, an offloaded optimizer's norms) failed there with torch's bare "No backend type
    associated with device type cpu" (every ``fzero.checkpoint.save`` under torchrun did). A local mesh's comm (no
    ``group``) sums any tensor: the host."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend(group))
    if "gloo" in backend or "nccl" not in backend or not torch.cuda.is_available():  # mpi, ucc, a custom one: the host
        return None
    return torch.device("cuda", torch.cuda.current_device())


class DistComm(Recording):
    def __init__(self, rank: int, size: int, group, counter: Counter | None, board: Board | None = None, *,
                 collectives: str = "auto") -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self.counter = counter
        self.board = board  # None: plain waits, raw backend errors
        # "auto": the exchanges of fzero.mesh._p2p for the all-gathers and reduce-scatters of CPU tensors on gloo,
        # torch.distributed's collectives elsewhere; "native": torch.distributed's everywhere; "p2p": every collective
        # of CPU tensors on gloo as exchanges (sums in rank order, as local_mesh takes them)
        self.collectives = collectives
        self._gloo = size > 1 and "gloo" in str(dist.get_backend(group))
        self.stage = host_stage(group)  # where host tensors go for a collective (None: they stay)

    def _staged(self, tensor: torch.Tensor, *, read: bool = True) -> torch.Tensor:
        """``tensor`` where the group can reduce it: a copy on ``stage`` for a host tensor on a group without gloo
        (``read=False``: a buffer of its shape there, for what the collective only writes), ``tensor`` itself
        elsewhere. The caller writes a staged buffer's result back (``_back``)."""
        if self.stage is None or tensor.device.type != "cpu":
            return tensor
        return tensor.to(self.stage, copy=True) if read else torch.empty_like(tensor, device=self.stage)

    @staticmethod
    def _back(tensor: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
        if staged is not tensor:
            tensor.copy_(staged)  # after the wait: the current stream is ordered after the collective's
        return tensor

    def _exchanges(self, op: str, tensor: torch.Tensor) -> bool:
        """Whether collective ``op`` of ``tensor`` runs as direct exchanges (``fzero.mesh._p2p``) rather than torch.distributed's."""
        if self.collectives == "native" or not self._gloo or tensor.device.type != "cpu":
            return False
        return self.collectives == "p2p" or op in AUTO_EXCHANGES

    def _wait_works(self, works: list, call: Call | None, tensor: torch.Tensor) -> None:
        self._wait(Together(works), call, tensor)

    def _issue(self, op: str, tag: str, label: str | None, tensor: torch.Tensor, numel: int, src: int | None = None) -> Call | None:
        if self.board is None:
            return None
        unit = "" if label is None else f" {label!r}"
        source = "" if src is None else f" from rank {src}"
        return self.board.issue(f"{op} {tag}{unit}{source}, {numel} x {str(tensor.dtype).removeprefix('torch.')}")

    def _post(self, post, call: Call | None):
        """Issue a collective through ``post()``; a peer already gone is named (see ``fzero.mesh._waiting.issued``)."""
        return issued(post, call, self.board)

    def _wait(self, work, call: Call | None, tensor: torch.Tensor) -> None:
        # gloo (CPU tensors) is waited for in slices; a CUDA wait only orders streams (see fzero.mesh._waiting)
        wait(work, call, self.board, bounded=tensor.device.type == "cpu")

    def begin(self) -> None:
        """Check that every rank starts the same call (the same API, its same count in each process), before its
        first collective: a rank that calls ``Step.evaluate`` or ``Step.gather`` while the others step would pair
        collectives of different sizes, which gloo answers by aborting the process in C++. One all-reduce of two
        integers (not counted: it moves no training data); the names are gathered only when they differ."""
        if self.board is None or self.size == 1 or "gloo" not in str(dist.get_backend(self.group)):
            return
        phase = self.board.phase
        code = zlib.crc32(phase.encode())
        both = torch.tensor([code, -code], dtype=torch.int64)  # max and -min in one all-reduce
        call = self.board.issue("check that every rank starts the same call")
        self._wait(self._post(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True), call),
                   call, both)
        if int(both[0]) == -int(both[1]):
            return
        phases = self._all_gather_objects(phase, what="gather the calls the ranks start")
        first = next(r for r in range(self.size) if phases[r] != phases[0])
        raise RanksDisagree(
            f"fzero.dist_mesh: ranks start different calls: rank 0 starts its {phases[0]}, rank {first} its "
            f"{phases[first]}. {CALLS_FIX}")

    def agree(self, fields, *, api, fix):
        if self.size == 1:
            return
        described = self._all_gather_objects(list(fields), what=f"agree: compare the layout and settings of {api}")
        error = disagreement(described, api=api, fix=fix)
        if error is not None:
            raise error

    def _all_gather_objects(self, obj: Any, *, what: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order: its length, then its bytes, each a waited all-gather.

        Outside ``torch.func``'s transforms: the first step's structure check (``agree``) runs inside the forward, which
        ``autodiff="func"`` runs under ``torch.func.grad``, where the byte tensors made here would be the transform's
        wrappers, without storage (``.numpy()`` raised "Cannot access data pointer of Tensor that doesn't have
        storage" at every first step under torchrun)."""
        with torch._C._DisableFuncTorch():
            return self._gather_objects(obj, what=what)

    def _gather_objects(self, obj: Any, *, what: str) -> list[Any]:
        if self.board is None or "gloo" not in str(dist.get_backend(self.group)):
            described: list[Any] = [None] * self.size
            dist.all_gather_object(described, obj, group=self.group)
            return described
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(self.size, dtype=torch.int64)
        call = self.board.issue(f"{what} (sizes)")
        self._wait(self._post(lambda: _ALL_GATHER(sizes, torch.tensor([data.numel()]), group=self.group, async_op=True), call),
                   call, sizes)
        longest = int(sizes.max())
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: data.numel()] = data
        everyone = torch.empty(longest * self.size, dtype=torch.uint8)
        call = self.board.issue(f"{what} ({longest} bytes per rank)")
        self._wait(self._post(lambda: _ALL_GATHER(everyone, mine, group=self.group, async_op=True), call), call, everyone)
        return [pickle.loads(everyone[r * longest : r * longest + int(sizes[r])].numpy().tobytes()) for r in range(self.size)]

    # Each collective is issued asynchronously (``*_async``, a ``Pending``); the plain form waits for it at once.

    def all_gather(self, out, shard, *, tag, label=None):
        return self.all_gather_async(out, shard, tag=tag, label=label).wait()

    @ranged
    def all_gather_async(self, out, shard, *, tag, label=None):
        self._note("all_gather", tag, out.numel(), out, label)
        call = self._issue("all_gather", tag, label, out, out.numel())
        if self._exchanges("all_gather", out):
            sent = self._post(lambda: _p2p.all_gather(out, shard, rank=self.rank, size=self.size, group=self.group), call)
            return Pending(lambda: (self._wait_works(sent.works, call, out), sent.finish())[1])
        # gloo may not accept an input that aliases the output; a shard-sized copy is cheap.
        staged, piece = self._staged(out, read=False), self._staged(shard)
        piece = piece.clone() if piece is shard else piece
        work = self._post(lambda: _ALL_GATHER(staged, piece, group=self.group, async_op=True), call)
        return Pending(lambda: (self._wait(work, call, staged), self._back(out, staged))[1])

    def reduce_scatter(self, full, *, tag, label=None, out=None):
        return self.reduce_scatter_async(full, tag=tag, label=label, out=out).wait()

    @ranged
    def reduce_scatter_async(self, full, *, tag, label=None, out=None):
        self._note("reduce_scatter", tag, full.numel(), full, label)
        call = self._issue("reduce_scatter", tag, label, full, full.numel())
        if self._exchanges("reduce_scatter", full):
            sent = self._post(lambda: _p2p.reduce_scatter(full, rank=self.rank, size=self.size, group=self.group, out=out), call)
            return Pending(lambda: (self._wait_works(sent.works, call, full), sent.finish())[1])
        out = torch.empty(full.numel() // self.size, dtype=full.dtype, device=full.device) if out is None else out
        staged, whole = self._staged(out, read=False), self._staged(full)
        work = self._post(lambda: _REDUCE_SCATTER(staged, whole, op=dist.ReduceOp.SUM, group=self.group, async_op=True), call)
        return Pending(lambda: (self._wait(work, call, whole), self._back(out, staged))[1])

    def all_reduce(self, tensor, *, tag, label=None):
        return self.all_reduce_async(tensor, tag=tag, label=label).wait()

    @ranged
    def all_reduce_async(self, tensor, *, tag, label=None):
        self._note("all_reduce", tag, tensor.numel(), tensor, label)
        call = self._issue("all_reduce", tag, label, tensor, tensor.numel())
        if self._exchanges("all_reduce", tensor):
            sent = self._post(lambda: _p2p.all_reduce(tensor, rank=self.rank, size=self.size, group=self.group,
                                                      wait=lambda works: self._wait_works(works, call, tensor)), call)
            # its finish posts the second round's messages
            return Pending(lambda: (self._wait_works(sent.works, call, tensor), self._post(sent.finish, call))[1])
        staged = self._staged(tensor)
        work = self._post(lambda: dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=self.group, async_op=True), call)
        return Pending(lambda: (self._wait(work, call, staged), self._back(tensor, staged))[1])

    @ranged
    def broadcast(self, tensor, *, src, tag, label=None):
        self._note("broadcast", tag, tensor.numel(), tensor, label)
        call = self._issue("broadcast", tag, label, tensor, tensor.numel(), src)
        staged = self._staged(tensor, read=self.rank == src)
        self._wait(self._post(lambda: dist.broadcast(staged, src=src, group=self.group, async_op=True), call), call, staged)
        return self._back(tensor, staged)
