"""Offload of optimizer state and fp32 masters: to the host ("cpu") and to files ("disk"/"nvme").

Results equal the run without offload bitwise: the optimizer does the same element-wise arithmetic,
on the host or sub-group by sub-group (sub-groups start on multiples of SHARD_ALIGN)."""

import dataclasses
import gc
import os
import shutil

import pytest
import torch

import fzero
from fzero.memory import resident_bytes_of_files_under
from fzero.zero._offload import DiskOptState
from fzero.memory import LiveBytes, state_bytes
from fzero.testing import assert_trees_equal
from problems import PROBLEMS, mlp_problem


def run(prob, **kw):
    step = fzero.compile(prob.loss_fn, optimizer=kw.pop("optimizer", fzero.optim.adamw(1e-3)), **kw)
    state = step.init(fzero.params_of(prob.model))
    history = []
    for b in prob.batches:
        state, m = step(state, b)
        history.append(step.gather(state))
    return history, state


@pytest.mark.parametrize("where", ["cpu", "disk", "nvme"])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_offload_equals_no_offload_bitwise(tmp_path, where, stages, ranks):
    prob = PROBLEMS["gpt"]()
    base, _ = run(prob, stages=stages, mesh=fzero.local_mesh(ranks))
    kw = {"offload_dir": str(tmp_path), "sub_group_size": 1000} if where != "cpu" else {}
    got, state = run(prob, stages=stages, mesh=fzero.local_mesh(ranks), offload=where, **kw)
    for g, e in zip(got, base):
        assert_trees_equal(g, e)
    if where != "cpu":
        assert isinstance(state[0].opt_state, DiskOptState)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_offload_with_fp32_masters_equals_no_offload(tmp_path, precision):
    prob = PROBLEMS["any"]()
    base, _ = run(prob, stages=2, mesh=fzero.local_mesh(2), precision=precision)
    for where in ("cpu", "disk"):
        kw = {"offload_dir": str(tmp_path), "sub_group_size": 256} if where == "disk" else {}
        got, _ = run(prob, stages=2, mesh=fzero.local_mesh(2), precision=precision, offload=where, **kw)
        for g, e in zip(got, base):
            assert_trees_equal(g, e)


def test_offload_params_on_the_host_at_stage3():
    prob = PROBLEMS["gpt"]()
    base, _ = run(prob, stages=3, mesh=fzero.local_mesh(2))
    got, _ = run(prob, stages=3, mesh=fzero.local_mesh(2), offload="cpu", offload_params=True)
    for g, e in zip(got, base):
        assert_trees_equal(g, e)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_disk_offload_of_params_equals_no_offload_bitwise(tmp_path, precision, ranks):
    prob = PROBLEMS["gpt"]()
    base, _ = run(prob, stages=3, mesh=fzero.local_mesh(ranks), precision=precision)
    got, state = run(prob, stages=3, mesh=fzero.local_mesh(ranks), precision=precision, offload="disk",
                     offload_params=True, offload_dir=str(tmp_path), sub_group_size=1000)
    for g, e in zip(got, base):
        assert_trees_equal(g, e)
    assert state_bytes(state[0]) == {"params": 0, "optimizer": state_bytes(state[0])["optimizer"], "frozen": 0}
    assert state_bytes(state[0])["optimizer"] < 100  # step counts only


def test_disk_offload_of_params_keeps_the_shards_in_files_between_uses(tmp_path):
    prob = PROBLEMS["gpt"]()
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(2), offload="disk", offload_params=True,
                         offload_dir=str(tmp_path))
    state = step.init(fzero.params_of(prob.model))
    units = [u.name for u in state[0].meta.layout.units]
    rank_dir = next(d for d in os.listdir(tmp_path) if d.startswith("fzero-rank0-"))
    files = set(os.listdir(tmp_path / rank_dir))
    assert {f"param__{u}.bin" for u in units} <= files
    shard = state[0].params[units[1]]
    assert os.path.getsize(tmp_path / rank_dir / f"param__{units[1]}.bin") == shard.numel() * 4
    mapped = sum(t.numel() * 4 for s in state.states for t in s.params.values())
    assert resident_bytes_of_files_under(tmp_path) == 0  # written, then given back
    shard.sum()  # reading a shard brings its pages in
    assert resident_bytes_of_files_under(tmp_path) > 0
    for b in prob.batches:
        state, _ = step(state, b)
        # every gather and every update gives its pages back: nothing of the shards stays resident
        assert resident_bytes_of_files_under(tmp_path) == 0, mapped
    step.evaluate(state, prob.batches[0])  # an evaluation gathers unit by unit and gives the pages back too
    assert resident_bytes_of_files_under(tmp_path) == 0
    after = step.gather(state)
    assert resident_bytes_of_files_under(tmp_path) == 0
    with open(tmp_path / rank_dir / f"param__{units[1]}.bin", "rb") as f:  # the file holds the updated values
        on_disk = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    assert torch.equal(on_disk, state[0].params[units[1]])
    assert not torch.equal(on_disk, shard.new_zeros(shard.shape))
    assert after  # gathered from the files
    del state, shard
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_disk_offload_of_params_checkpoint_round_trip(tmp_path):
    prob = PROBLEMS["gpt"]()
    kw = dict(stages=3, mesh=fzero.local_mesh(2), offload="disk", offload_params=True, offload_dir=str(tmp_path / "off"))
    os.makedirs(kw["offload_dir"])
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), **kw)
    state = step.init(fzero.params_of(prob.model))
    state, _ = step(state, prob.batches[0])
    fzero.checkpoint.save(str(tmp_path / "ckpt"), state)
    loaded = fzero.checkpoint.load(str(tmp_path / "ckpt"), like=step)
    assert_trees_equal(step.gather(loaded), step.gather(state))
    for b in prob.batches[1:3]:  # both continue alike
        state, m1 = step(state, b)
        loaded, m2 = step(loaded, b)
        assert m1["loss"] == m2["loss"]
    assert_trees_equal(step.gather(loaded), step.gather(state))


def test_meta_params_are_refused_where_no_rank_0_gives_values():
    prob = mlp_problem(steps=1)
    params = {k: v.to("meta") for k, v in fzero.params_of(prob.model).items()}
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(2))
    with pytest.raises(ValueError, match=r"fzero.Step.init: params hold meta tensors .* on a local_mesh, and no materialize=.*dist_mesh"):
        step.init(params)


def test_disk_files_are_fresh_per_run_and_removed_with_the_state(tmp_path):
    prob = mlp_problem(steps=2)
    step = fzero.compile(prob.loss_fn, stages=2, mesh=fzero.local_mesh(2), offload="disk", offload_dir=str(tmp_path))
    state = step.init(fzero.params_of(prob.model))
    dirs = sorted(os.listdir(tmp_path))
    assert len(dirs) == 2 and all(d.startswith(("fzero-rank0-", "fzero-rank1-")) for d in dirs)
    files = os.listdir(tmp_path / dirs[0])
    assert any(f.startswith("master") for f in files) is False  # fp32: no masters, m and v per unit
    assert len(files) == 2 * 3  # Adam's m and v for each of the MLP's 3 units
    second = step.init(fzero.params_of(prob.model))  # another run: its own files
    assert len(os.listdir(tmp_path)) == 4
    for b in prob.batches:
        state, _ = step(state, b)
    del state, second
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_disk_offload_keeps_the_optimizer_state_out_of_ram():
    prob = mlp_problem(steps=2, sizes=[128] * 9, batch=2)
    import tempfile

    peaks, held = {}, {}
    with tempfile.TemporaryDirectory() as d:
        for where in (None, "disk"):
            counters = {}
            mesh = dataclasses.replace(fzero.local_mesh(2), rank_context=lambda r: counters.setdefault(r, LiveBytes()))
            kw = {"offload": where, "offload_dir": d, "sub_group_size": 2048} if where else {}
            step = fzero.compile(prob.loss_fn, stages=2, mesh=mesh, **kw)
            state = step.init(fzero.params_of(prob.model))
            for b in prob.batches:
                state, _ = step(state, b)
            peaks[where] = counters[0].peak
            held[where] = state_bytes(state[0])["optimizer"]
            del state
    psi = sum(p.numel() for p in prob.model.parameters())
    opt_bytes = 8 * psi / 2  # m and v of this rank's half
    assert held[None] >= opt_bytes and held["disk"] < 100  # only step counts stay in RAM
    # during the step: two sub-groups of (m, v) buffers, not the whole state
    assert peaks["disk"] - peaks[None] <= 2 * 2 * 2048 * 4 * 1.1 + 64 * 1024


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"offload": "disk"}, ValueError, r"fzero.offload: offload='disk' needs offload_dir="),
        ({"offload": "nvme", "offload_dir": "/no/such/dir"}, ValueError, r"offload_dir='/no/such/dir' does not exist"),
        ({"offload": "gpu"}, ValueError, r"fzero.offload: where must be one of \['cpu', 'disk', 'nvme'\], got 'gpu'"),
        ({"offload": "cpu", "offload_dir": "/tmp"}, ValueError, r"offload_dir='/tmp' only applies to offload='disk'"),
        ({"offload": "cpu", "offload_params": True, "stages": 2}, ValueError, r"params=True offloads param shards.*stage 2"),
        ({"offload": "cpu", "stages": 0}, ValueError, r"fzero.offload: needs fzero.shard_optimizer inside it"),
        ({"offload_params": True}, ValueError, r"offload_params/offload_dir need offload="),
        ({"offload": "disk", "offload_dir": "/tmp", "donate": False}, ValueError, r"an old state cannot be kept \(donate=False\)"),
        ({"offload": "disk", "offload_dir": "/tmp", "offload_params": True, "stages": 2}, ValueError, r"params=True offloads param shards.*stage 2"),
    ],
)
def test_offload_errors(kw, error, match):
    prob = mlp_problem(steps=1)
    kw = {"stages": 1, **kw}
    with pytest.raises(error, match=match):
        fzero.compile(prob.loss_fn, **kw)


def test_offload_dir_must_be_writable(tmp_path, monkeypatch):
    # chmod cannot stop root (these machines run as root), so the access check itself is made to say no
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=r"is not writable"):
        fzero.compile(mlp_problem(steps=1).loss_fn, stages=1, offload="disk", offload_dir=str(tmp_path))


def test_disk_offload_refuses_a_layer_wise_optimizer(tmp_path):
    prob = mlp_problem(steps=1)
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.lamb(1e-3), stages=1, mesh=fzero.local_mesh(2),
                         offload="disk", offload_dir=str(tmp_path))
    with pytest.raises(NotImplementedError, match=r"per-parameter norms .*lamb.*sub-groups"):
        step(step.init(fzero.params_of(prob.model)), prob.batches[0])


def test_disk_offload_says_up_front_when_the_files_will_not_fit(tmp_path, monkeypatch):
    prob = mlp_problem(steps=1)
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(2), offload="disk", offload_params=True,
                         offload_dir=str(tmp_path))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(OSError, match=r"fzero.offload\('disk'\): rank 0 needs [\d,]+ bytes in offload_dir=.* for its optimizer "
                                      r"state and param shards, but only 1,000 bytes are free there.*larger disk"):
        step.init(fzero.params_of(prob.model))
    assert all(not os.listdir(tmp_path / d) for d in os.listdir(tmp_path))  # nothing was written


def test_offload_policy_objects_equal_their_string_spellings(tmp_path):
    """fzero.CPUOffload / fzero.DiskOffload carry the settings the string form takes as keywords; the runs agree bitwise."""
    prob = PROBLEMS["gpt"]()
    mesh = fzero.local_mesh(2)
    base, _ = run(prob, stages=3, mesh=mesh, offload="disk", offload_params=True, offload_dir=str(tmp_path), sub_group_size=1000)
    got, state = run(prob, stages=3, mesh=mesh, offload=fzero.DiskOffload(str(tmp_path), params=True, sub_group_size=1000))
    for g, e in zip(got, base):
        assert_trees_equal(g, e)
    assert isinstance(state[0].opt_state, DiskOptState)
    cpu, _ = run(prob, stages=3, mesh=mesh, offload=fzero.CPUOffload(params=True))
    plain, _ = run(prob, stages=3, mesh=mesh)
    for g, e in zip(cpu, plain):
        assert_trees_equal(g, e)
    # by hand: the transform attaches the very policy object it was given
    policy = fzero.CPUOffload()
    step = fzero.offload(fzero.shard_optimizer(fzero.train_step(prob.loss_fn, fzero.optim.adamw(1e-3)), mesh), policy)
    assert step.offload is policy and step.opt_state.offload.where == "cpu"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda d: fzero.DiskOffload("/no/such/dir"), ValueError, r"fzero.DiskOffload: dir='/no/such/dir' does not exist"),
        (lambda d: fzero.DiskOffload(d, sub_group_size=3), ValueError, r"fzero.DiskOffload: sub_group_size must be an int >= "),
        (lambda d: fzero.DiskOffload(d, params="yes"), TypeError, r"fzero.DiskOffload: params \(offload_params\) must be True or False, got 'yes'"),
        (lambda d: fzero.CPUOffload(pin_memory=1), TypeError, r"fzero.CPUOffload: pin_memory must be True or False, got 1"),
        (lambda d: fzero.compile(mlp_problem(steps=1).loss_fn, stages=3, offload=fzero.CPUOffload(), offload_params=True),
         ValueError, r"fzero.offload: where=CPUOffload\(params=False, pin_memory=True\) is a policy object.*\['params'\] would be ignored"),
    ],
)
def test_offload_policy_errors(tmp_path, make, error, match):
    with pytest.raises(error, match=match):
        make(str(tmp_path))


def test_disk_offload_sub_group_rounds_up_to_the_shard_alignment(tmp_path):
    from fzero.layout._layout import SHARD_ALIGN

    assert fzero.DiskOffload(str(tmp_path), sub_group_size=SHARD_ALIGN + 1).sub_group_size == 2 * SHARD_ALIGN


class _BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.bn(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h).squeeze(-1)


@pytest.mark.parametrize("where", [None, "cpu", "disk"])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_state_given_to_with_buffers_is_spent_with_its_result(tmp_path, where, stages, ranks):
    """``step.with_buffers(state, ...)`` shares ``state``'s params and optimizer state (disk offload: its files), which a
    step updates in place. Before, stepping the new state moved the old one silently (``gather`` of it was 0.01 off,
    at every stage and offload); now either one stepped spends both, and the other is refused by name."""
    model = _BNNet()
    kw = {"offload": where, "offload_dir": str(tmp_path)} if where == "disk" else {"offload": where} if where else {}
    step = fzero.compile(lambda p, b: (fzero.apply(model, p, b["x"]) - b["y"]).pow(2).mean(),
                         optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(ranks), **kw)
    gen = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=gen), "y": torch.randn(8, generator=gen)}
    state, _ = step(step.init(fzero.params_of(model), buffers=fzero.buffers_of(model)), batch)
    before = step.gather(state)
    reset = step.with_buffers(state, {"bn.running_var": torch.ones(8)})
    assert_trees_equal(step.gather(reset), before)  # both readable until a step spends them
    step.evaluate(state, batch)
    step(reset, batch)
    for call in (step.gather, lambda s: step.evaluate(s, batch), lambda s: step(s, batch),
                 lambda s: fzero.checkpoint.save(str(tmp_path / "ckpt"), s)):
        with pytest.raises(ValueError, match=r"already passed to a step.*step.with_buffers' result and the state it was given"):
            call(state)
    # the other way round: stepping the source spends the result
    reset = step.with_buffers(step.init(fzero.params_of(model), buffers=fzero.buffers_of(model)), {"bn.running_var": torch.ones(8)})
    source_state = reset  # a state made from one with_buffers gives its marks on to the next one
    again = step.with_buffers(source_state, {"bn.running_mean": torch.zeros(8)})
    step(source_state, batch)
    with pytest.raises(ValueError, match=r"already passed to a step"):
        step.gather(again)


def test_a_dead_runs_directory_is_swept_when_its_files_hold_the_root_unit(tmp_path):
    """The next run in offload_dir removes the directories of dead runs that hold only fzero's files. Before, a file of
    the root unit (``opt__0__1__<root>.bin``: at stage 3 the params outside the blocks, as every Hugging Face LM's
    embeddings) did not look like fzero's, so a killed run's directory stayed for good."""
    import subprocess
    import sys

    from fzero.zero import _offload_dir

    prob = PROBLEMS["gpt"]()
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, precision="bf16",
                         offload=fzero.DiskOffload(str(live_dir), params=True))
    state = step.init(fzero.params_of(prob.model))
    (made,) = os.listdir(live_dir)
    names = os.listdir(live_dir / made)
    assert any("<root>" in n for n in names), names  # the root unit's files, as a killed run leaves them
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"fzero-rank0-p{gone.pid}-0123abcd-x1"
    dead.mkdir()
    for n in names:
        (dead / n).write_bytes(b"\0" * 8)
    assert _offload_dir.sweep(str(tmp_path)) == [str(dead)]
    assert os.listdir(tmp_path) == ["live"]
    del state


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_step_interrupted_in_its_disk_update_spends_the_state(tmp_path, monkeypatch, ranks):
    """Disk offload updates the files unit by unit, sub-group by sub-group, in place. Before, a Ctrl-C (or any error)
    there left the state it was given half-updated (one unit's params moved by 0.01, the others not; step count not
    advanced) and still accepted, so re-running ``state, m = step(state, b)`` trained on from it silently. Now the
    state is spent once its update begins; a step that raises before (a non-finite gradient) leaves it whole."""
    import fzero.optim

    model = _BNNet()
    step = fzero.compile(lambda p, b: (fzero.apply(model, p, b["x"]) - b["y"]).pow(2).mean(), optimizer=fzero.optim.adamw(1e-2),
                         stages=3, mesh=fzero.local_mesh(ranks), offload="disk", offload_dir=str(tmp_path), sub_group_size=64)
    gen = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(8, 4, generator=gen), "y": torch.randn(8, generator=gen)}
    state, _ = step(step.init(fzero.params_of(model)), batch)
    before = step.gather(state)
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):  # raised before any write: the state is whole
        step(state, {"x": batch["x"], "y": torch.full((8,), float("nan"))})
    assert_trees_equal(step.gather(state), before)
    real, calls = fzero.optim.apply_inplace, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(fzero.optim, "apply_inplace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        step(state, batch)
    monkeypatch.undo()
    for call in (step.gather, lambda s: step(s, batch)):
        with pytest.raises(ValueError, match=r"already passed to a step.*raised \(or was interrupted\) while it updated"):
            call(state)


@pytest.mark.parametrize("stages,ranks", [(2, 1), (3, 2)])
@pytest.mark.parametrize("sub_group_size", [64, 128])
def test_disk_offload_with_parameter_groups_equals_no_offload_bitwise(tmp_path, stages, ranks, sub_group_size):
    """A group's run of a unit that starts off a multiple of 64 elements was cut by the sub-groups at other elements
    than without offload, and torch's fused Adam rounds the last elements of each piece its own way: one element of a
    BatchNorm CNN's conv weights was 1.9e-9 off under bf16 (fzero.optim._select._aligned says how it is cut now)."""
    from zoo import ZOO

    entry = ZOO["bn_cnn"]
    labels = lambda params: {n: "decay" if v.ndim > 1 else "plain" for n, v in params.items()}  # noqa: E731
    optimizer = fzero.optim.multi_transform({"decay": fzero.optim.adamw(1e-2, weight_decay=0.1),
                                             "plain": fzero.optim.adamw(3e-3, weight_decay=0.0)}, labels)

    def train(offload=None):
        model = entry.build()
        step = fzero.compile(lambda p, b: entry.loss(lambda *a, **k: fzero.apply(model, p, *a, **k), b), optimizer=optimizer,
                             stages=stages, mesh=fzero.local_mesh(ranks), precision="bf16",
                             **({"offload": offload} if offload is not None else {}))
        state = step.init(fzero.params_of(model))
        out = []
        for batch in entry.batches():
            state, _ = step(state, batch)
            out.append(step.gather(state))
        return out

    base = train()
    got = train(fzero.DiskOffload(str(tmp_path), sub_group_size=sub_group_size))
    for g, e in zip(got, base):
        assert_trees_equal(g, e)


def _homes_forced(monkeypatch):
    """Route a CPU step's gradients through the host buffers that ``CPUOffload`` gives a step whose params are on a GPU
    (host and device are one memory here, so the route is off by itself); returns a count of the gradients routed."""
    import fzero.zero._policies as policies
    import fzero.zero._stages as stages_mod

    monkeypatch.setattr(policies, "_on_device", lambda t: True)
    routed = {"n": 0}
    to_home = stages_mod.ShardGradView._to_home

    def counted(self, *a, **k):
        routed["n"] += 1
        return to_home(self, *a, **k)

    monkeypatch.setattr(stages_mod.ShardGradView, "_to_home", counted)
    return routed


_BF16_FP32_REDUCE = fzero.Precision(compute=torch.bfloat16, reduce=torch.float32)  # fp32 shards, rounded to the bf16 param's


@pytest.mark.parametrize("stages, ranks, precision, grad_accum, bucket", [
    (2, 1, "fp32", 1, 0), (2, 2, "bf16", 2, 1 << 20), (3, 1, "bf16", 2, 0), (3, 2, "fp32", 1, 1 << 20), (3, 2, "bf16", 2, 0),
    (3, 2, _BF16_FP32_REDUCE, 2, 0), (2, 2, _BF16_FP32_REDUCE, 1, 0)],
    ids=lambda v: "bf16-reduce-fp32" if isinstance(v, fzero.Precision) else str(v))
def test_offloaded_gradients_go_to_the_host_as_backward_makes_them(monkeypatch, stages, ranks, precision, grad_accum, bucket):
    """With the params on a GPU, ``offload="cpu"`` sends each unit's gradient shard to a host buffer as soon as its
    reduction is waited for, so the device never holds the whole gradient (ZeRO-Offload's device memory: the params).
    On the CPU the route is off (one memory); forced on here, it runs: every step's params and metrics bitwise those of
    the step without it (the same roundings: the shard's dtype, sums over micro-batches kept in it), the buffers made
    at the first step and reused, a unit's buffer one per rank's shard. Clipping on, so the host's norm counts."""
    prob = PROBLEMS["gpt"](steps=3)
    kw = dict(stages=stages, mesh=fzero.local_mesh(ranks), precision=precision, grad_accum=grad_accum, offload="cpu",
              clip_grad_norm=0.05, bucket_elements=bucket)

    def steps():
        step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), **kw)
        state = step.init(fzero.params_of(prob.model))
        out = []
        for b in prob.batches:
            state, m = step(state, b)
            out.append((step.gather(state), m["loss"], m["grad_norm"]))
        return out, state

    base, _ = steps()
    routed = _homes_forced(monkeypatch)
    got, state = steps()
    assert routed["n"] >= len(prob.batches) * grad_accum * len(state[0].meta.layout.units)  # each unit, each micro-batch
    for (g, loss, norm), (e, loss_e, norm_e) in zip(got, base):
        assert_trees_equal(g, e)
        assert (loss, norm) == (loss_e, norm_e)
    # one buffer per unit and rank, kept on the state's flats from the first step on: the same memory every step
    from fzero.zero._policies import grad_homes_of

    homes = [h for rank in state for flat in rank.params.values() for h in grad_homes_of(flat).values()]
    assert len({h.data_ptr() for h in homes}) == len(state[0].meta.layout.units) * ranks
    assert all(h.dtype == torch.float32 for h in homes)


def test_a_saved_state_holds_no_gradient_buffer(monkeypatch, tmp_path):
    """The host gradient buffers are kept for the state's flats, not in their attributes, which ``torch.save`` and
    ``copy.deepcopy`` carry: a checkpoint of a state holds no gradient-sized buffer beside its params, a copy makes its
    own, and ``torch.load``'s default ``weights_only=True`` reads the flats back (an object of fzero's in a tensor's
    attributes made it refuse the file after a step had routed a gradient)."""
    import copy

    from fzero.zero._policies import grad_homes_of

    _homes_forced(monkeypatch)
    prob = PROBLEMS["gpt"](steps=1)
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(1), offload="cpu")
    state = step.init(fzero.params_of(prob.model))
    state, _ = step(state, prob.batches[0])
    flats = dict(state[0].params)
    assert all(grad_homes_of(flat) for flat in flats.values())
    torch.save(flats, tmp_path / "flats.pt")
    loaded = torch.load(tmp_path / "flats.pt")  # weights_only=True, torch's default
    copied = copy.deepcopy(flats)
    for name, flat in flats.items():
        assert torch.equal(loaded[name], flat) and torch.equal(copied[name], flat)
        assert not grad_homes_of(loaded[name]) and not grad_homes_of(copied[name])


def test_only_cpu_offload_of_device_params_moves_gradients_in_backward():
    """``grad_homes``: a host buffer per unit only where the optimizer is on the host and the params are not (CUDA);
    on a CPU-only machine, with ``offload_params=True`` (shards on the host) or disk offload (sub-groups of the device
    gradient at a time), and without offload, None: the gradient stays where backward makes it."""
    from fzero.step._parts import ON_DEVICE
    from fzero.zero._policies import CPUOffload, DiskOffload

    flat = torch.zeros(64)
    assert CPUOffload().grad_homes({"u": (flat, 0, 32)}) is None
    assert DiskOffload(dir=".").grad_homes({"u": (flat, 0, 32)}) is None
    assert ON_DEVICE.grad_homes({"u": (flat, 0, 32)}) is None
