"""The collectives of ``save`` and ``load`` under torchrun, waited for on the job's fault board.

Why: ``save`` and ``load`` are collectives (every rank calls them with its own state). A ``save`` called on rank
0 alone used to wait in a raw gloo all-reduce for a rank that never came: no progress until torchrun killed the
job (or gloo's "Timed out waiting 20000ms for send operation" with ``dist_mesh(timeout=20)``). So each call
starts, as a step does, with the check that every rank starts the same call (``DistComm.begin``: one all-reduce of
two integers), waited for in slices on the fault board (``fzero.mesh._faults``): a rank that is in another fzero
call is named at once (``RanksDisagree``), one that ended its program or died within seconds (``RankFailed``),
one that stays in its own code at the mesh timeout (``MeshTimeout``); each message then says that the call is a
collective and to make it on every rank. The small exchanges that follow (rank 0's verdict, the checksums, the
fingerprint of the checkpoint each rank loads) go through the same waits.
"""

from __future__ import annotations

from typing import Any

import torch

COLLECTIVE_FIX = ("{api} is a collective under torchrun: call it on every rank, each with its own state (not under "
                  "`if rank == 0`), at the same point of the program.")


class Ranks:
    """This process's part in one ``save`` or ``load`` call: ``comm`` is None on one process or a local mesh."""

    def __init__(self, api: str, distributed: bool) -> None:
        self.api = api
        self.comm = _enter(api) if distributed else None

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.rank

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on any rank (this one's alone without a comm)."""
        if self.comm is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)  # reduced on the GPU where the group has no gloo (``host_stage``)
        self.comm.all_reduce(t, tag=what)
        return bool(int(t))

    def gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        if self.comm is None:
            return [obj]
        return self.comm._all_gather_objects(obj, what=what)


    def failed_elsewhere(self, error: BaseException, what: str) -> Exception | None:
        """The fault board's account of ``error``, raised inside torch.distributed.checkpoint's own collectives (its
        plan exchange and barriers, which run outside fzero's comm), when another rank raised or its process vanished;
        None otherwise (this rank's own failure: a full disk is named by ``_oserrors``).

        Why: a rank killed while the data files were written left the others with gloo's raw "Connection closed by
        peer ... GLHF!" wrapped as "could not write the checkpoint", which named neither the rank nor that it was gone,
        where every other collective of a save names it (``RankFailed``)."""
        board = getattr(self.comm, "board", None)
        if board is None:
            return None
        from fzero.mesh import RankFailed, failure_elsewhere

        found = failure_elsewhere(board, what, error)
        if not isinstance(found, RankFailed) or found.rank is None:  # no rank named: the error is this rank's own
            return None
        found.args = (f"{self.api}: {found}",)
        return found


def _enter(api: str) -> Any:
    """A ``DistComm`` for this call, after checking that every rank makes it (see the module docstring)."""
    import torch.distributed as dist

    from fzero.mesh import hooks as _hooks
    from fzero.mesh import MeshTimeout, RanksDisagree
    from fzero.mesh import DistComm
    from fzero.mesh import RankFailed
    from fzero.mesh import fault_board

    current = _hooks.current()
    board = fault_board(current.timeout if current is not None else 300.0)  # dist_mesh made it, with the mesh's timeout
    if board is not None:
        board.enter(api)
    comm = DistComm(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, None, board, collectives="native")
    try:
        comm.begin()
    except (RanksDisagree, RankFailed, MeshTimeout) as e:  # the same error, with what to do about a collective
        how = "a rank failed before it joined the call" if isinstance(e, RankFailed) else "not every rank called it"
        e.args = (f"{api}: {how}. {e} {COLLECTIVE_FIX.format(api=api)}",)
        raise
    return comm
