"""The structure the code keeps (issue: one owner for a unit, one place for every collective): how many fzero
files one stage-3 step runs through, and that every collective is issued from the collectives package."""

import json
import os
import sys
import threading
from collections import Counter

import pytest
import torch

import fzero
from fzero.models import GPT, GPTConfig, gpt_loss
from launch import torchrun

MAX_FILES = 20


def _files_of_one_step(step, state, batch) -> Counter:
    """fzero's files (the model's aside) whose functions run during ``step(state, batch)``, in every thread."""
    files: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if f"{os.sep}fzero{os.sep}" in name and f"{os.sep}fzero{os.sep}models{os.sep}" not in name:
                files[name.split(f"{os.sep}fzero{os.sep}", 1)[1]] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)  # the ranks of a local mesh are threads started inside the step
    try:
        step(state, batch)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return files


def test_a_stage3_step_runs_functions_from_at_most_20_fzero_files():
    """docs/architecture.md lists this path as calls ("One batch at stage 3")."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=3, mesh=fzero.local_mesh(2))
    batch = {"x": torch.randint(0, 64, (4, 16)), "y": torch.randint(0, 64, (4, 16))}
    state, _ = step(step.init(fzero.params_of(model)), batch)  # the first step's checks are done once: the second is the path
    files = _files_of_one_step(step, state, batch)
    assert "zero/_unit.py" in files and "step/_update.py" in files  # the profile saw the rank threads' work
    assert len(files) <= MAX_FILES, sorted(files)


def test_the_thread_mesh_exchanges_only_inside_the_collectives_package(monkeypatch):
    """A local mesh's ranks meet only in ThreadComm's exchange and its Rendezvous: nothing outside fzero/mesh/
    calls them, so every collective of a local mesh is one of the comm's methods."""
    from fzero.mesh import Rendezvous, ThreadComm

    callers = Counter()
    for cls, name in ((ThreadComm, "_exchange"), (Rendezvous, "wait")):
        real = getattr(cls, name)

        def wrapper(*args, _real=real, **kwargs):
            callers[os.path.relpath(sys._getframe(1).f_code.co_filename, os.path.dirname(fzero.__file__))] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    batch = {"x": torch.randint(0, 64, (4, 16)), "y": torch.randint(0, 64, (4, 16))}
    for stages in (0, 1, 2, 3):
        step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=stages,
                             mesh=fzero.local_mesh(2), **({"bucket_elements": 10_000} if stages >= 2 else {}))
        state, _ = step(step.init(fzero.params_of(model)), batch)
        step.gather(state)
        step.evaluate(state, batch)
    assert callers and all(c.startswith(f"mesh{os.sep}") for c in callers), callers


@pytest.mark.torchrun
def test_every_torch_distributed_collective_is_issued_from_the_collectives_package(tmp_path):
    """Under torchrun every call of a torch.distributed collective (the entry points wrapped before fzero is imported)
    comes from fzero/mesh/, for stages 0-3 (init, steps, gather, evaluate), torch's own and fzero's exchanges, a
    checkpoint saved and loaded, and safetensors weights; torch.distributed.checkpoint issues its own, called by
    fzero/checkpoint/_dcp.py. A collective planted in the worker is found, so a caller elsewhere would be."""
    out = tmp_path / "callers.json"
    here = os.path.dirname(__file__)
    torchrun([os.path.join(here, "collectives_worker.py"), "--out", str(out), "--dir", str(tmp_path), "--plant"])
    callers = json.loads(out.read_text())
    planted = callers.pop(os.path.join("tests", "collectives_worker.py"))
    assert planted == ["all_reduce"]
    through_dcp = {k: v for k, v in callers.items() if k.endswith("(through torch.distributed.checkpoint)")}
    assert set(through_dcp) == {os.path.join("fzero", "checkpoint", "_dcp.py") + " (through torch.distributed.checkpoint)"}
    mine = {k: v for k, v in callers.items() if k not in through_dcp}
    assert all(k.startswith(os.path.join("fzero", "mesh", "")) for k in mine), mine
    issued = {name for names in mine.values() for name in names}
    assert {"all_reduce", "broadcast", "isend", "irecv"} <= issued  # fzero's exchanges and torch's own collectives
    assert issued & {"all_gather_single", "all_gather_into_tensor"} and issued & {"reduce_scatter_single", "reduce_scatter_tensor"}
