"""The random number generators a checkpoint saves and ``load`` restores, so a resumed run draws what the straight
run would have drawn (as the Hugging Face Trainer's ``rng_state_<rank>.pth`` does for Python's, NumPy's, torch's CPU
and every CUDA device's generator, per process).

Keys, one set per process ``p`` of the job that saved (``fzero.checkpoint._state``'s key list):

- ``rng/<p>``: torch's CPU generator (``torch.get_rng_state()``, uint8), as it always was;
- ``rng_python/<p>``: Python's global ``random`` (int64: the version, the 625 Mersenne Twister words, whether a
  Gaussian is cached and its float64 bits);
- ``rng_numpy/<p>``: NumPy's legacy global ``RandomState`` (``np.random``; int64: the 624 words, the position,
  whether a Gaussian is cached and its bits), where the program has imported NumPy;
- ``rng_cuda/<p>``: ``torch.cuda.get_rng_state_all()`` stacked (uint8, one row per device), where CUDA is
  initialized (a process that never touched CUDA has drawn nothing there);
- ``rng_ranks/<p>/cpu``, ``/python``, ``/numpy``: on a ``local_mesh`` of several ranks, each rank's own stream (one
  row per rank), where the ranks' next step would go on from them (``fzero.mesh._rank.Carry``: nothing drew from the
  global generators since the mesh's last run). The global keys above hold rank 0's, which the process takes after
  every run.

A checkpoint without a key (saved before it existed, or where there was nothing to save) leaves that generator as
it is, except a local mesh's per-rank streams: those are reset, so the ranks start from the restored global state
(rank 0's), as every rank of a job restarted from a checkpoint without them would.

Where the per-rank streams live: a rank thread is made again for every step call, so the process keeps where each
rank's streams ended, one record per mesh size (``LocalMesh.carry``, ``fzero.mesh._rank.carry_of``): every
``local_mesh(n)`` of the process stands for the same n processes, whose generators a checkpoint saves whichever of
the steps ran last. ``save`` reads it through the step that made the state (``Marks.made_by``: its mesh's size),
``load`` writes it through the ``like=`` step (or the step that made ``like``): the step the run resumes with. No new
argument is needed: the state names its step already.
"""

from __future__ import annotations

import importlib
import random
import struct
import sys
from typing import Any, Callable

import torch

from fzero.checkpoint import _dcp


def _numpy(*, load: bool = False) -> Any:
    """NumPy where the program imported it (``load``: importable), else None."""
    np = sys.modules.get("numpy")
    if np is None and load:
        try:
            np = importlib.import_module("numpy")
        except ImportError:
            return None
    return np


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def py_encode(state: tuple) -> torch.Tensor:
    version, words, gauss = state
    return torch.tensor([version, *words, gauss is not None, 0 if gauss is None else _bits(gauss)], dtype=torch.int64)


def py_decode(t: torch.Tensor) -> tuple:
    v = t.tolist()
    return v[0], tuple(v[1:-2]), _float(v[-1]) if v[-2] else None


def np_encode(state: tuple) -> torch.Tensor:
    _, keys, pos, has_gauss, gauss = state
    return torch.tensor([*keys.tolist(), pos, has_gauss, _bits(gauss)], dtype=torch.int64)


def np_decode(t: torch.Tensor, np: Any) -> tuple:
    v = t.tolist()
    return "MT19937", np.array(v[:-3], dtype=np.uint32), v[-3], v[-2], _float(v[-1])


def _local_carry(step: Any) -> Any:
    """The per-rank stream carry of ``step``'s mesh (every local mesh of its size) where it is a local mesh of several
    ranks, else None."""
    from fzero.mesh import LocalMesh

    mesh = getattr(step, "mesh", None)
    return mesh.carry if isinstance(mesh, LocalMesh) and mesh.size > 1 else None


def tensors(process: int, step: Any) -> dict[str, torch.Tensor]:
    """The RNG states this process saves, by key (``step``: the step that made the state saved, or None)."""
    out = {f"rng/{process}": torch.get_rng_state(), f"rng_python/{process}": py_encode(random.getstate())}
    np = _numpy()
    if np is not None:
        out[f"rng_numpy/{process}"] = np_encode(np.random.get_state())
    if torch.cuda.is_initialized():
        out[f"rng_cuda/{process}"] = torch.stack(torch.cuda.get_rng_state_all())
    carry = _local_carry(step)
    if carry is not None:
        n = step.mesh.size
        if carry.resumes(n, out[f"rng/{process}"]):
            out[f"rng_ranks/{process}/cpu"] = torch.stack(carry.cpu)
        if carry.py_resumes(n, random.getstate()):
            out[f"rng_ranks/{process}/python"] = torch.stack([py_encode(s) for s in carry.py])
        if np is not None and carry.np_resumes(n, np.random.get_state()):
            out[f"rng_ranks/{process}/numpy"] = torch.stack([np_encode(s) for s in carry.np])
    return out


def restore(metadata: Any, process: int, step: Any) -> tuple[list[_dcp.Dest], Callable[[], None]]:
    """What to read of the RNG keys this checkpoint holds for ``process``, and a function that sets the generators
    from it once read (``step``: the step the run resumes with, whose local mesh takes the per-rank streams)."""
    keys = {name: f"{name}/{process}" for name in ("rng", "rng_python", "rng_numpy", "rng_cuda")}
    keys.update({f"rng_ranks/{name}": f"rng_ranks/{process}/{name}" for name in ("cpu", "python", "numpy")})
    got, dests = _reader(metadata, keys)  # by name (the key less the process), once read

    def apply() -> None:
        if "rng" in got:
            torch.set_rng_state(got["rng"])
        if "rng_python" in got:
            random.setstate(py_decode(got["rng_python"]))
        np = _numpy(load="rng_numpy" in got)
        if np is not None and "rng_numpy" in got:
            np.random.set_state(np_decode(got["rng_numpy"], np))
        _set_cuda(got.get("rng_cuda"))
        carry = _local_carry(step)
        if carry is None:
            return
        n = step.mesh.size
        rows = {name: got.get(f"rng_ranks/{name}") for name in ("cpu", "python", "numpy")}
        _fill_carry(carry, np, **{k: None if r is None or r.shape[0] != n else list(r) for k, r in rows.items()})

    return dests, apply


def _reader(metadata: Any, keys: dict[str, str]) -> tuple[dict[str, torch.Tensor], list[_dcp.Dest]]:
    """Where to read each of ``keys`` (``{name: checkpoint key}``) the checkpoint holds: ``got[name]`` is filled once
    the returned destinations are read."""
    saved = metadata.state_dict_metadata
    got: dict[str, torch.Tensor] = {}
    dests = []
    for name, key in keys.items():
        if key in saved:
            md = saved[key]
            t = got[name] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            dests.append(_dcp.Dest(key, (0,) * t.dim(), tuple(t.shape), t.dtype, view=t))
    return got, dests


def _set_cuda(cuda: torch.Tensor | None) -> None:
    """Every CUDA device's generator, where the checkpoint has them for as many devices as there are."""
    if cuda is not None and torch.cuda.device_count() == cuda.shape[0]:
        torch.cuda.set_rng_state_all([r.clone() for r in cuda])


def _fill_carry(carry: Any, np: Any, *, cpu: list | None, python: list | None, numpy: list | None) -> None:
    """A local mesh's per-rank streams from saved rows (torch's states; Python's and NumPy's encoded), each family
    that has rows; the global generators must hold the restored state (rank 0's) already. No stream of the mesh's
    last run goes on: a family without rows starts every rank from the global state. The random streams the modules
    hold (``carry.held``) stay: a checkpoint saves no module attribute but its tensors, and a load leaves those
    objects, as it leaves each torchrun process's own, where they are (so each rank goes on from its own state)."""
    held = carry.held
    carry.__init__()
    carry.held = held
    if cpu is not None:
        carry.cpu, carry.left, carry.cuda = [r.clone() for r in cpu], torch.get_rng_state(), [{} for _ in cpu]
    if python is not None:
        carry.py, carry.py_left = [py_decode(r) for r in python], random.getstate()
    if numpy is not None and np is not None:
        carry.np, carry.np_left = [np_decode(r, np) for r in numpy], np.random.get_state()


def restore_across(metadata: Any, saved: int, world: int | None, process: int, processes: int,
                   step: Any) -> tuple[list[_dcp.Dest], Callable[[], None]] | None:
    """The per-rank streams between a ``local_mesh(n)`` and ``n`` torchrun processes, which are the same ``n`` ranks:
    a checkpoint of a local mesh (1 process, ``rng_ranks/0/*`` of n rows) loaded by n processes gives process p row p;
    a checkpoint of n processes (``rng/<p>``...) loaded into a ``local_mesh(n)`` gives rank p process p's generators
    (the global ones rank 0's). Without this, a resume across mesh kinds drew other dropout masks than the straight
    run, silently (3e-3 off it on GPT-2 after two steps). None where the ranks do not correspond.

    Each generator the local mesh saved no per-rank rows for (something drew from the global generator between the
    mesh's last step and the save, or a checkpoint from before the rows existed) goes on in every process from the
    global state the checkpoint holds (rank 0's), as every rank of the local mesh would have; CUDA's device state is
    rank 0's either way (a local mesh's per-rank CUDA streams are not saved), as ``restore`` sets it."""
    md = metadata.state_dict_metadata
    carry = _local_carry(step)
    if saved == 1 and processes > 1:  # local_mesh(n) -> n processes: process p takes rank p's streams
        if world != processes:
            return None
        got, dests = _reader(metadata, {k: k for k in ("rng/0", "rng_python/0", "rng_numpy/0", "rng_cuda/0",
                                                        "rng_ranks/0/cpu", "rng_ranks/0/python", "rng_ranks/0/numpy")})

        def own(name: str, whole: str) -> torch.Tensor | None:
            """Rank ``process``'s row of ``rng_ranks/0/<name>``, else the global state (rank 0's), else None."""
            rows = got.get(f"rng_ranks/0/{name}")
            if rows is not None and rows.shape[0] == processes:
                return rows[process].clone()
            return got.get(whole)

        def apply() -> None:
            cpu, py, nps = own("cpu", "rng/0"), own("python", "rng_python/0"), own("numpy", "rng_numpy/0")
            if cpu is not None:
                torch.set_rng_state(cpu)
            if py is not None:
                random.setstate(py_decode(py))
            np = _numpy(load=nps is not None)
            if np is not None and nps is not None:
                np.random.set_state(np_decode(nps, np))
            _set_cuda(got.get("rng_cuda/0"))

        return dests, apply
    if saved > 1 and processes == 1 and carry is not None and step.mesh.size == saved:  # n processes -> local_mesh(n)
        if any(f"rng/{p}" not in md for p in range(saved)):
            return None
        got, dests = _reader(metadata, {f"{name}/{p}": f"{name}/{p}" for p in range(saved)
                                        for name in ("rng", "rng_python", "rng_numpy")} | {"rng_cuda/0": "rng_cuda/0"})

        def apply() -> None:
            _set_cuda(got.get("rng_cuda/0"))
            torch.set_rng_state(got["rng/0"])
            rows = {}
            for key, name in (("rng", "cpu"), ("rng_python", "python"), ("rng_numpy", "numpy")):
                every = [got.get(f"{key}/{p}") for p in range(saved)]
                rows[name] = None if any(r is None for r in every) else every
            if rows["python"] is not None:
                random.setstate(py_decode(got["rng_python/0"]))
            np = _numpy(load=rows["numpy"] is not None)
            if np is not None and rows["numpy"] is not None:
                np.random.set_state(np_decode(got["rng_numpy/0"], np))
            _fill_carry(carry, np, **rows)

        return dests, apply
    return None
