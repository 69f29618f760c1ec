"""What ``offload="cpu"`` holds on the host: ZeRO-Offload's arithmetic and nothing O(model) more (issue 27).

The host holds the fp32 masters, Adam's m and v and one fp32 gradient: 16 bytes per parameter, and on a CPU-only
machine, where device and host are one memory, the bf16 params too: 18. Everything else is bounded by a unit.
Counted here by category with ``fzero.memory`` (state by what it is, the step's live bytes by dtype), and as a
whole process's peak RSS in a subprocess (``benchmarks/offload_rss.py``), so the test's own memory does not count.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

import fzero
from fzero.memory import resident_bytes_of_files_under
from fzero.memory import LiveBytes, state_categories
from fzero.zero import _pinned
from fzero.zero._policies import _kept, grad_homes_of, kept_of
from problems import gpt_problem
from fzero.models import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- page-locked buffers of exact size ------------------------------------------------------------------------------


def test_registered_bytes_are_whole_pages_not_a_power_of_two():
    page = _pinned.PAGE
    assert _pinned.registered_bytes(1) == _pinned.registered_bytes(0) == page
    assert _pinned.registered_bytes(page) == page and _pinned.registered_bytes(page + 1) == 2 * page
    shard = 5 * 2**30 + 12_345  # a 5 GiB unit shard: torch's pinned allocator reserves 8 GiB for it
    assert _pinned.caching_allocator_bytes(shard) == 8 * 2**30
    assert shard <= _pinned.registered_bytes(shard) < shard + page


def test_pinned_empty_registers_exactly_its_pages_and_unregisters_before_unmapping():
    calls = []

    def register(address, nbytes):
        calls.append(("register", address, nbytes))
        return lambda: calls.append(("unregister", address, nbytes))

    t = _pinned.pinned_empty(1000, torch.float32, register=register)
    assert t.shape == (1000,) and t.dtype == torch.float32
    (_, address, nbytes), = calls
    assert address % _pinned.PAGE == 0 and t.data_ptr() == address and nbytes == _pinned.registered_bytes(4000)
    t.fill_(3.0)  # the memory is usable
    view = t[10:20]
    del t
    gc.collect()
    assert len(calls) == 1  # a view keeps the mapping
    assert float(view.sum()) == 30.0
    del view
    gc.collect()
    assert calls[1] == ("unregister", address, nbytes)


def test_host_buffers_are_kept_per_unit_only_where_a_device_is(tmp_path):
    owner, other = torch.zeros(8), torch.zeros(8)
    assert _kept({"u": owner}, {"u": torch.zeros(8)}, "grad", True) is None  # host and device are one memory: no copy
    on_device = {"u": torch.empty(8, device="meta")}  # stands for a CUDA gradient: only its shape and dtype are read
    first = _kept({"u": owner}, on_device, "grad", True)["u"]
    assert first.device.type == "cpu" and first.shape == (8,)
    assert _kept({"u": owner}, on_device, "grad", True)["u"] is first  # made once, reused by every step
    assert _kept({"u": other}, on_device, "grad", True)["u"] is not first  # per owner (unit master or shard)
    assert _kept({"u": owner}, on_device, "param", True)["u"] is not first  # per role
    flat = torch.zeros(16)  # stages 1-2: a fresh view of the unit's buffer at every step, one kept buffer
    assert _kept({"u": flat[8:]}, on_device, "grad", True)["u"] is _kept({"u": flat[8:]}, on_device, "grad", True)["u"]
    assert kept_of(owner)[("grad", "u")] is first  # kept for its owner (the state's master)
    # not in the owner's attributes, which torch.save and deepcopy carry: a saved master holds no gradient beside it,
    # and torch.load's default weights_only=True reads it back (an fzero object in its pickle made it refuse the file)
    torch.save({"u": owner}, tmp_path / "master.pt")
    assert torch.equal(torch.load(tmp_path / "master.pt")["u"], owner)
    assert not kept_of(torch.load(tmp_path / "master.pt")["u"]) and not kept_of(copy.deepcopy(owner))
    gone = weakref.ref(first)
    del owner, first
    gc.collect()
    assert gone() is None  # dropped with its owner: no registry keeps it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_on_cuda_holds_exact_page_locked_masters_and_one_kept_gradient():
    t = _pinned.pinned_empty(3 * 2**20 + 7, torch.float32)
    assert t.is_pinned()
    src = torch.arange(t.numel(), device="cuda", dtype=torch.float32)
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t, src.cpu())
    prob = gpt_problem(steps=2, batch=2)
    prob.model.to("cuda")
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(1), precision="bf16", offload="cpu")
    state = step.init(fzero.params_of(prob.model))
    masters = state[0].opt_state.master
    assert all(m.device.type == "cpu" and m.is_pinned() for m in masters.values())
    for b in prob.batches:
        state, _ = step(state, {k: v.cuda() for k, v in b.items()})
    def homes():  # stage 3: one host gradient per unit, which backward copies into, kept for the state's flat
        return [h for flat in state[0].params.values() for h in grad_homes_of(flat).values()]

    kept = homes()
    assert len(kept) == len(masters)
    state, _ = step(state, {k: v.cuda() for k, v in prob.batches[0].items()})
    assert [k.data_ptr() for k in homes()] == [k.data_ptr() for k in kept]  # reused by every step
    assert all(k.is_pinned() and k.dtype == torch.float32 for k in kept)
    # stage 1 copies the whole reduced gradient after the backward, into one host buffer per unit kept for its master
    step1 = fzero.compile(prob.loss_fn, stages=1, mesh=fzero.local_mesh(1), precision="bf16", offload="cpu")
    state1 = step1.init(fzero.params_of(prob.model))
    state1, _ = step1(state1, {k: v.cuda() for k, v in prob.batches[0].items()})
    masters1 = state1[0].opt_state.master

    def kept_grads():
        return [kept_of(m if m._base is None else m._base)[("grad", u)] for u, m in masters1.items()]

    kept = kept_grads()
    state1, _ = step1(state1, {k: v.cuda() for k, v in prob.batches[0].items()})
    assert [k.data_ptr() for k in kept_grads()] == [k.data_ptr() for k in kept]
    assert all(k.is_pinned() and k.dtype == torch.float32 for k in kept)


# -- the state and the step's live bytes, by category ---------------------------------------------------------------


@pytest.fixture(scope="module")
def offloaded_gpt():
    """A stage-3, bf16, cpu-offloaded GPT on one rank after two steps, with the live bytes of its second step."""
    cfg = GPTConfig(n_layer=4, d_model=128, n_head=4, seq_len=32)
    prob = gpt_problem(steps=2, batch=1, cfg=cfg)
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(1), precision="bf16", remat=True, offload="cpu")
    state = step.init(fzero.params_of(prob.model))
    state, _ = step(state, prob.batches[0])
    with LiveBytes() as lb:
        state, _ = step(state, prob.batches[1])
    return state[0], lb, step.pool.held_bytes


def test_offloaded_state_is_params_masters_and_moments(offloaded_gpt):
    state, _, _ = offloaded_gpt
    owned = sum(t.numel() for t in state.params.values())  # one rank: it owns every (padded) element
    got = state_categories(state)
    assert got["params"] == 2 * owned, got  # bf16 shards
    assert got["masters"] == 4 * owned, got  # fp32 masters
    assert got["moments"] == 8 * owned, got  # Adam's m and v
    assert got["other"] < 4 * len(state.meta.layout.paths) + 64, got  # step counts


def test_offloaded_step_holds_one_fp32_gradient_and_units_beside_the_state(offloaded_gpt):
    state, lb, pooled = offloaded_gpt
    owned = sum(t.numel() for t in state.params.values())
    unit = max(u.padded for u in state.meta.layout.units)
    fp32 = lb.peak_by_dtype.get(torch.float32, 0)
    bf16 = lb.peak_by_dtype.get(torch.bfloat16, 0)
    # the gradient the host optimizer reads: one fp32 copy, plus at most a unit of fp32 temporaries
    assert fp32 <= 4 * owned + 4 * unit, ("gradients/transient fp32 grew", fp32, 4 * owned)
    # bf16 at the fp32 peak: at most what a unit's conversion has not yet freed, and gathered units
    assert bf16 <= 2 * 3 * unit, ("bf16 transient grew", bf16, unit)
    assert lb.live <= 4 * unit, ("the step kept memory beyond its state", lb.live)
    # between steps the step's pool keeps buffers for reuse, at most a couple of bf16 units: not the fp32 gradient
    # (it kept it before issue 27: 3.1 B/param here, 2.7 at 133M params, unused by the next step)
    assert pooled <= 2 * 2 * unit, ("the pool kept the gradient", pooled, unit)


# -- the whole process: peak RSS of an offloaded step at 100M+ params ------------------------------------------------


@pytest.mark.slow
def test_peak_rss_of_an_offloaded_step_is_the_state_plus_units(tmp_path):
    """Stage 3, ``offload="cpu"``, bf16, remat, one rank, 133M params, two steps: peak RSS over the steps at most
    18 bytes per parameter (the state and one fp32 gradient) + activations + two units' fp32 gradient. glibc's
    dynamic mmap threshold is fixed (``MALLOC_MMAP_THRESHOLD_``), as docs/benchmarks.md reports it, so that what
    is measured is fzero's, not the heap's; without it glibc keeps freed unit buffers resident (recorded there)."""
    out = tmp_path / "rss.json"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "offload_rss.py"), "--one-process", "--layers", "12",
           "--width", "960", "--heads", "15", "--seq", "64", "--steps", "2", "--offload", "cpu", "--precision", "bf16",
           "--remat", "--json-out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    got = json.loads(out.read_text())
    psi = got["params"]
    assert psi >= 100e6
    units = 2 * 4 * got["largest_unit"] / psi  # two units' fp32 gradient, per parameter
    activations = 0.05  # batch 1 x 64 tokens under remat: measured well under 1 MB per block
    assert got["init_bytes_per_param"] <= 14 + units, got  # bf16 params 2 + masters 4 + m, v 8
    assert got["train_peak_bytes_per_param"] <= 18 + activations + units, got
    # and fzero.estimate_memory predicts that peak within 5 % (device and host as one memory, as here)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=12, d_model=960, n_head=15, seq_len=64))
    est = fzero.estimate_memory(model, stages=3, world_size=1, precision="bf16", offload="cpu")
    assert est.num_params == psi
    assert got["train_peak_bytes_per_param"] == pytest.approx(est.one_memory.total / psi, rel=0.05), est.one_memory


def test_each_host_operation_of_the_offloaded_update_allocates_nothing_on_the_cpu(tmp_path):
    """``benchmarks/offload_host_ops.py``, the instrument for the 12 B/param an H200 showed inside ``apply_update``:
    on this CPU torch's fused AdamW over page-locked-style masters and fzero's in-place update add no host memory
    (what offload's 16 B/param rests on); its CUDA rows run on a GPU. A subprocess, so the test's own memory does
    not count; 64 MiB per tensor, so the sampler's noise is far below a byte per element."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "offload_host_ops.py"), "--elements", str(1 << 24)],
                         check=True, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [line for line in out.stdout.splitlines() if "B/elem" in line]
    assert len(rows) == (7 if torch.cuda.is_available() else 3), out.stdout
    for line in rows[:3]:  # the host's own operations (the CUDA rows are what a GPU run reads from the benchmark)
        peak = float(line.split("peak +")[1].split()[0])
        assert peak < 0.5, line


# -- disk offload: RAM bounded by its buffers --------------------------------------------------------------------------


def test_disk_offload_holds_masters_in_files_from_the_start(tmp_path):
    """``Step.init`` makes the fp32 masters unit by unit before the rank's store exists: ``DiskOffload.hold`` puts
    each in an unlinked file at once (held in RAM until then, they were the model's size: init peaked at 7.4 B/param
    of a 133M GPT in bf16, 3.4 now; docs/benchmarks.md)."""
    from fzero.zero._offload import _SPILLED, unspill

    policy = fzero.DiskOffload(str(tmp_path))
    t = torch.randn(1 << 18)
    held = policy.hold(t)
    assert held.untyped_storage().data_ptr() in _SPILLED and held.data_ptr() != t.data_ptr()
    assert resident_bytes_of_files_under(tmp_path) == 0  # written through the page cache, nothing resident
    assert torch.equal(held, t)
    assert resident_bytes_of_files_under(tmp_path) == 4 * t.numel()  # read: resident until given back
    unspill(held)
    assert resident_bytes_of_files_under(tmp_path) == 0
    assert os.listdir(tmp_path) == []  # the file is unlinked: it goes with the last tensor using it
