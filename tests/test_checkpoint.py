"""fzero.checkpoint: bit-exact resume in a fresh process (local mesh and torchrun), resharding across stages and
world sizes, mixed precision and offloaded state, consolidation, keep=K, crash safety under kill -9, and errors.

Bit-exact comparisons pin torch to one intra-op thread, as the worker processes are (one thread sums in one order).
"""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import fzero
from checkpoint_worker import crash_step, make_step
from fzero.checkpoint import CheckpointError
from fzero.checkpoint._verify import crc32_file, marker_bytes
from fzero.testing import assert_trees_close, assert_trees_equal
from problems import PROBLEMS, gpt_problem, mlp_problem

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "checkpoint_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}


def worker(*args: str, torchrun: bool = False, timeout: int = 120) -> None:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if torchrun else [sys.executable]
    proc = subprocess.run([*launch, WORKER, *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def train(step, state, batches):
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    return state, losses


def straight_run(problem: str, *, stages: int, mesh, precision: str = "fp32", save: str | None = None, at: int = 5, stop: int = 10):
    """10 steps in this process, saving after ``at`` steps: the gathered params and the losses of steps at..stop."""
    prob = PROBLEMS[problem](steps=stop)
    step = make_step(prob, stages=stages, mesh=mesh, precision=precision)
    state, _ = train(step, step.init(fzero.params_of(prob.model)), prob.batches[:at])
    if save:
        fzero.checkpoint.save(save, state, extra={"next_batch": at})
    state, losses = train(step, state, prob.batches[at:stop])
    return step.gather(state), losses


# -- resume ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("problem,stages,precision", [("mlp", 3, "fp32"), ("gpt", 2, "fp16")])
def test_resume_in_a_fresh_process_is_bitexact(tmp_path, one_thread, problem, stages, precision):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out.pt")
    params, losses = straight_run(problem, stages=stages, mesh=fzero.local_mesh(2), precision=precision, save=ck)
    worker("train", "--problem", problem, "--stages", str(stages), "--ranks", "2", "--precision", precision,
           "--first", "5", "--last", "10", "--load", ck, "--out", out)
    resumed = torch.load(out, weights_only=True)
    assert resumed["losses"] == losses
    assert_trees_equal(resumed["params"], params)
    assert fzero.checkpoint.read_extra(ck) == {"next_batch": 5}


@pytest.mark.torchrun
def test_resume_under_torchrun_is_bitexact_and_crosses_mesh_kinds(tmp_path, one_thread):
    """torchrun saves (each rank its own files) and the local mesh resumes it; the local mesh saves and torchrun resumes."""
    local_ck, dist_ck, out = str(tmp_path / "local"), str(tmp_path / "dist"), str(tmp_path / "out.pt")
    params, losses = straight_run("mlp", stages=3, mesh=fzero.local_mesh(2), save=local_ck)
    worker("train", "--dist", "--problem", "mlp", "--stages", "3", "--first", "0", "--last", "5", "--save", dist_ck, torchrun=True)
    worker("train", "--dist", "--problem", "mlp", "--stages", "3", "--first", "5", "--last", "10", "--load", local_ck,
           "--out", out, torchrun=True)
    resumed = torch.load(out, weights_only=True)
    assert resumed["losses"] == losses
    assert_trees_equal(resumed["params"], params)
    files = os.listdir(dist_ck)
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)  # each rank wrote its part
    prob = mlp_problem(steps=10)
    step = make_step(prob, stages=3, mesh=fzero.local_mesh(2))
    assert_trees_equal(fzero.checkpoint.load(dist_ck, like=step), fzero.checkpoint.load(local_ck, like=step))
    wider = make_step(prob, stages=1, mesh=fzero.local_mesh(4))  # and it reshards like any other
    assert_trees_equal(wider.gather(fzero.checkpoint.load(dist_ck, like=wider)), step.gather(fzero.checkpoint.load(local_ck, like=step)))
    state, got = train(step, fzero.checkpoint.load(dist_ck, like=step), prob.batches[5:])
    assert got == losses
    assert_trees_equal(step.gather(state), params)


@pytest.mark.torchrun
def test_dropout_resumes_bitexact_across_local_mesh_and_torchrun(tmp_path, one_thread):
    """A local_mesh(2) and 2 torchrun processes are the same 2 ranks: a checkpoint of one resumes in the other with each
    rank's own random stream (before: none was restored across mesh kinds, so dropout drew other masks than the straight
    run, silently: 3e-3 off it on GPT-2 after two steps)."""
    local_ck, dist_ck, out = str(tmp_path / "local"), str(tmp_path / "dist"), str(tmp_path / "out.pt")
    prob = PROBLEMS["dropout"](steps=10)
    step = make_step(prob, stages=2, mesh=fzero.local_mesh(2))
    torch.manual_seed(7)
    state, losses = train(step, step.init(fzero.params_of(prob.model)), prob.batches[:5])
    fzero.checkpoint.save(local_ck, state)
    state, losses = train(step, state, prob.batches[5:])
    params = step.gather(state)
    worker("train", "--dist", "--problem", "dropout", "--stages", "2", "--first", "5", "--last", "10", "--load", local_ck,
           "--out", out, torchrun=True)
    resumed = torch.load(out, weights_only=True)
    assert resumed["losses"] == losses
    assert_trees_equal(resumed["params"], params)
    # and back: torchrun saves at step 5 (each process its own generator), the local mesh resumes
    worker("train", "--dist", "--problem", "dropout", "--stages", "2", "--first", "0", "--last", "5", "--save", dist_ck,
           "--seed", "7", torchrun=True)
    torch.manual_seed(99)
    state, got = train(step, fzero.checkpoint.load(dist_ck, like=step), prob.batches[5:])
    assert got == losses
    assert_trees_equal(step.gather(state), params)


@pytest.mark.torchrun
def test_local_mesh_checkpoint_after_a_draw_between_step_and_save_resumes_bitexact_under_torchrun(tmp_path, one_thread):
    """A draw from torch's generator between the local mesh's last step and the save (a DataLoader's RandomSampler at
    an epoch's start, an augmentation in the main thread) leaves no per-rank rows: every rank of the local mesh goes on
    from the global state the checkpoint holds, and so must every torchrun process (before: nothing was restored,
    silently, while the same checkpoint resumed on the local mesh bit for bit)."""
    ck, out = str(tmp_path / "local"), str(tmp_path / "out.pt")
    prob = PROBLEMS["dropout"](steps=10)
    step = make_step(prob, stages=2, mesh=fzero.local_mesh(2))
    torch.manual_seed(7)
    state, _ = train(step, step.init(fzero.params_of(prob.model)), prob.batches[:5])
    torch.rand(1)
    fzero.checkpoint.save(ck, state)
    state, losses = train(step, state, prob.batches[5:])
    worker("train", "--dist", "--problem", "dropout", "--stages", "2", "--first", "5", "--last", "10", "--load", ck,
           "--out", out, torchrun=True)
    resumed = torch.load(out, weights_only=True)
    assert resumed["losses"] == losses
    assert_trees_equal(resumed["params"], step.gather(state))


# -- resharding ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source,targets", [((3, 4), [(1, 2), (0, 1)]), ((0, 1), [(3, 4), (1, 2)])])
def test_reshard_across_stages_and_world_sizes(tmp_path, source, targets):
    """Saved at one (stage, ranks), loaded at others: same params, and training follows the 1-rank reference."""
    prob = gpt_problem(steps=6)

    def step_for(stages, ranks):
        return make_step(prob, stages=stages, mesh=fzero.local_mesh(ranks) if ranks > 1 else None)

    ref = step_for(0, 1)
    state, ref_history = ref.init(fzero.params_of(prob.model)), []
    for b in prob.batches:
        state, _ = ref(state, b)
        ref_history.append(ref.gather(state))
    saver = step_for(*source)
    state, _ = train(saver, saver.init(fzero.params_of(prob.model)), prob.batches[:3])
    ck = fzero.checkpoint.save(str(tmp_path / "ck"), state)
    saved = saver.gather(state)
    for stages, ranks in targets:
        step = step_for(stages, ranks)
        state = fzero.checkpoint.load(ck, like=step)
        assert_trees_equal(step.gather(state), saved)
        for k, b in enumerate(prob.batches[3:], start=3):
            state, _ = step(state, b)
            assert_trees_close(step.gather(state), ref_history[k], rtol=1e-5, atol=1e-6)


# -- precision and offload -------------------------------------------------------------------------------------


def test_bf16_masters_round_trip_and_feed_other_policies(tmp_path):
    prob = PROBLEMS["any"]()
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=2, mesh=fzero.local_mesh(2), precision="bf16")
    state, _ = train(step, step.init(fzero.params_of(prob.model)), prob.batches[:2])
    ck = fzero.checkpoint.save(str(tmp_path / "ck"), state)
    with open(os.path.join(ck, "fzero.json")) as f:
        info = json.load(f)
    assert info["master"] and info["params_dtype"] == "bfloat16"
    assert_trees_equal(fzero.checkpoint.load(ck, like=step), state)  # bf16 params, fp32 masters, moments: all bitwise
    masters = step.gather(state)  # the fp32 masters
    for other in (fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=0),  # fp32: resumes from the masters
                  fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(4), precision="bf16")):
        assert_trees_equal(other.gather(fzero.checkpoint.load(ck, like=other)), masters)


def test_disk_offloaded_state_saves_and_loads_both_ways(tmp_path):
    prob = mlp_problem(steps=4)
    opt = fzero.optim.adamw(1e-3)
    disk = fzero.compile(prob.loss_fn, optimizer=opt, stages=1, mesh=fzero.local_mesh(2), precision="bf16", offload="disk",
                         offload_dir=str(tmp_path), sub_group_size=256)
    plain = fzero.compile(prob.loss_fn, optimizer=opt, stages=1, mesh=fzero.local_mesh(2), precision="bf16")
    state, _ = train(disk, disk.init(fzero.params_of(prob.model)), prob.batches[:2])
    ck = fzero.checkpoint.save(str(tmp_path / "ck"), state)
    a, la = train(plain, fzero.checkpoint.load(ck, like=plain), prob.batches[2:])
    b, lb = train(disk, fzero.checkpoint.load(ck, like=disk), prob.batches[2:])
    assert la == lb
    assert_trees_equal(disk.gather(b), plain.gather(a))
    ck2 = fzero.checkpoint.save(str(tmp_path / "ck2"), a)
    assert_trees_equal(disk.gather(fzero.checkpoint.load(ck2, like=disk)), plain.gather(a))


@pytest.mark.parametrize("stages,precision", [(0, "fp32"), (3, "fp16")])
def test_torch_save_of_a_whole_state_round_trips_and_trains_on_bitwise(tmp_path, stages, precision):
    """Users torch.save a state object as it is. It pickled the step that made it (``Marks.made_by``) with its
    ``loss_fn`` closure, and failed deep in pickle ("Can't pickle local object"); now it round-trips and trains on bit for
    bit. A state a step has reused the buffers of is refused by name (it holds that step's values)."""
    prob = mlp_problem(steps=4)
    step = make_step(prob, stages=stages, mesh=fzero.local_mesh(2), precision=precision)
    state, _ = train(step, step.init(fzero.params_of(prob.model)), prob.batches[:2])
    torch.save({"state": state, "epoch": 1}, tmp_path / "s.pt")
    copy = torch.load(tmp_path / "s.pt", weights_only=False)["state"]
    assert_trees_equal(copy, state)
    a, la = train(step, state, prob.batches[2:])
    b, lb = train(step, copy, prob.batches[2:])
    assert la == lb
    assert_trees_equal(step.gather(b), step.gather(a))
    with pytest.raises(ValueError, match=r"pickling a TrainState/RankStates .* already passed to a step, which reused its buffers"):
        torch.save(state, tmp_path / "spent.pt")


def test_a_disk_offloaded_state_is_refused_by_torch_save(tmp_path):
    """Its optimizer state lives in mapped files that are removed with the state: pickle failed on the mmap, naming
    neither the state nor the fix."""
    prob = mlp_problem(steps=1)
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=1, mesh=fzero.local_mesh(2), offload="disk",
                         offload_dir=str(tmp_path))
    state = step.init(fzero.params_of(prob.model))
    with pytest.raises(TypeError, match=r"fzero.DiskOffload: a disk-offloaded state cannot be pickled .* files under .*"
                                        r"fzero.checkpoint.save\(path, state\)"):
        torch.save(state, tmp_path / "s.pt")


# -- consolidate ----------------------------------------------------------------------------------------------


class TiedLM(torch.nn.Module):
    """A head tied by alias (``head.weight is emb.weight``: two state-dict keys), a buffer and a frozen layer."""

    def __init__(self, vocab: int = 16, d: int = 8) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in range(2)])
        self.frozen = torch.nn.Linear(d, d).requires_grad_(False)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x)) * self.scale
        return self.head(x + 0.1 * self.frozen(x))


def test_consolidate_loads_strictly_into_the_model_and_from_the_command_line(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 16, (4, 6), generator=gen) for _ in range(2)]

    def loss_fn(params, idx):
        return torch.nn.functional.cross_entropy(fzero.apply(model, params, idx).flatten(0, 1), idx.flatten())

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=1, mesh=fzero.local_mesh(2), precision="bf16")
    state, _ = train(step, step.init(fzero.params_of(model)), batches)
    ck = fzero.checkpoint.save(str(tmp_path / "ck"), state, keep=1)
    trained = step.gather(state)  # fp32 masters
    out = fzero.checkpoint.consolidate(str(tmp_path / "ck"), str(tmp_path / "model.pt"), model=model)  # the newest
    fresh = TiedLM()
    fresh.load_state_dict(torch.load(out, weights_only=True))  # strict
    assert fresh.head.weight is fresh.emb.weight
    for name, value in trained.items():
        assert torch.equal(fresh.get_parameter(name), value), name
    assert torch.equal(fresh.frozen.weight, model.frozen.weight) and torch.equal(fresh.scale, model.scale)

    cli = subprocess.run([sys.executable, "-m", "fzero.checkpoint", "consolidate", ck, str(tmp_path / "cli.pt")],
                         env=ENV, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and "Warning" not in cli.stderr, cli.stderr
    plain = torch.load(tmp_path / "cli.pt", weights_only=True)
    assert sorted(plain) == sorted([*trained, "scale"])  # params and the buffers the state holds
    assert torch.equal(plain["scale"], model.scale)
    for name, value in trained.items():
        assert plain[name].dtype == torch.float32 and torch.equal(plain[name], value)


# -- keep, rng, crash safety ----------------------------------------------------------------------------------


def test_keep_the_last_k_and_load_the_newest(tmp_path):
    prob = mlp_problem(steps=4)
    step = make_step(prob, stages=1, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    (tmp_path / ".step_00000001.partial").mkdir()  # a save that died long ago
    assert fzero.checkpoint.latest(tmp_path) is None
    for b in prob.batches:
        state, _ = step(state, b)
        fzero.checkpoint.save(tmp_path, state, keep=2, extra={"k": state.step_count})
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]
    assert fzero.checkpoint.latest(tmp_path) == str(tmp_path / "step_00000004")
    assert fzero.checkpoint.read_extra(tmp_path) == {"k": 4}
    assert_trees_equal(fzero.checkpoint.load(tmp_path, like=step), state)


def test_after_a_rollback_keep_keeps_the_new_line_and_latest_resumes_it(tmp_path):
    """Roll back to an older checkpoint and train on: the new line's checkpoints have lower steps than the abandoned
    line's. keep=K keeps the K saved last, and latest() (so load(parent)) is the one saved last, as DeepSpeed's
    `latest` tag: ranked by step, keep=1 deleted the checkpoint it had just written (save returned a path that no
    longer existed) and latest() resumed the abandoned line."""
    prob = mlp_problem(steps=4)
    step = make_step(prob, stages=1, mesh=None)
    state = step.init(fzero.params_of(prob.model))
    for b in prob.batches:
        state, _ = step(state, b)
        fzero.checkpoint.save(tmp_path / "k3", state, keep=3)
        fzero.checkpoint.save(tmp_path / "k1", state, keep=1)
    for keep, kept in ((3, ["step_00000002", "step_00000003", "step_00000004"]), (1, ["step_00000003"])):
        parent = tmp_path / f"k{keep}"
        back = fzero.checkpoint.load(tmp_path / "k3" / "step_00000002", like=step)
        back, _ = step(back, prob.batches[0])  # the new line's step 3, on other data than the old one's
        saved = fzero.checkpoint.save(parent, back, keep=keep, extra={"line": "new"})
        assert saved == str(parent / "step_00000003") and os.path.isdir(saved)
        assert sorted(os.listdir(parent)) == kept
        assert fzero.checkpoint.latest(parent) == saved and fzero.checkpoint.read_extra(parent) == {"line": "new"}
        assert_trees_equal(fzero.checkpoint.load(parent, like=step), back)


def _frozen_embedding_run(tmp_path, *, save_model: bool):
    """Phase 1 trains the whole model; phase 2 freezes the trained embedding (the trained values into the module, a new
    state over the rest) and saves after two steps. Returns the step, the saved path, the state and model there, and
    the batches left."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 16))

    def compile_for(model):
        loss = lambda p, idx: torch.nn.functional.cross_entropy(fzero.apply(model, p, idx).flatten(0, 1), idx.flatten())  # noqa: E731
        return fzero.compile(loss, optimizer=fzero.optim.adamw(1e-1), stages=1, mesh=fzero.local_mesh(2))

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 16, (4, 6), generator=gen) for _ in range(6)]
    model = build()
    step = compile_for(model)
    state = step.init(fzero.params_of(model))
    state, _ = step(state, batches[0])
    model.load_state_dict(step.state_dict(state, model))
    model[0].weight.requires_grad_(False)
    state = step.init(fzero.params_of(model))
    for b in batches[1:3]:
        state, _ = step(state, b)
    ck = fzero.checkpoint.save(tmp_path / "ck", state, model=model if save_model else None)
    return build, compile_for, ck, state, model, batches[3:]


def test_frozen_params_saved_with_the_model_resume_in_a_fresh_one(tmp_path):
    """save(model=) writes the frozen params, as DeepSpeed does by default, and load(model=) puts them back into a
    model built from scratch: the run goes on bit for bit as uninterrupted. Without them it resumed on the embedding's
    random init, silently; consolidate exports the saved values too."""
    build, compile_for, ck, state, model, rest = _frozen_embedding_run(tmp_path, save_model=True)
    fresh = build()
    fresh[0].weight.requires_grad_(False)
    assert not torch.equal(fresh[0].weight, model[0].weight)  # what a fresh process builds
    step = compile_for(fresh)
    resumed = fzero.checkpoint.load(ck, like=step, model=fresh)
    assert torch.equal(fresh[0].weight, model[0].weight)
    straight = compile_for(model)
    for b in rest:
        resumed, _ = step(resumed, b)
        state, _ = straight(state, b)
    assert_trees_equal(step.gather(resumed), straight.gather(state))
    out = fzero.checkpoint.consolidate(ck, tmp_path / "w.pt", model=build())
    assert torch.equal(torch.load(out, weights_only=True)["0.weight"], model[0].weight)
    with pytest.raises(CheckpointError, match=r"holds the frozen parameters \['0.weight'\] of the model it was saved "
                                              r"with.*load\(path, like=..., model=model\)"):
        fzero.checkpoint.load(ck, like=step)
    unfrozen = build()
    with pytest.raises(CheckpointError, match=r"saved but not frozen in the model: \['0.weight'\] \(trainable there\)"):
        fzero.checkpoint.load(ck, like=step, model=unfrozen)


def test_frozen_params_loaded_into_a_module_of_meta_tensors_go_where_the_state_computes(tmp_path):
    """A module with no real tensor (built on meta, its trained params donated to the state): load(model=) makes its
    frozen params on the state's device, not the host (a CUDA state's forward met host frozen params). Meta stands in
    for the GPU: the state's compute device (``state.meta.device``) says meta."""
    import dataclasses

    build, compile_for, ck, state, model, _ = _frozen_embedding_run(tmp_path, save_model=True)
    with torch.device("meta"):
        emptied = build()
    emptied[0].weight.requires_grad_(False)
    step = compile_for(model)
    like = step.init(fzero.params_of(model))
    elsewhere = type(like)(tuple(dataclasses.replace(s, meta=dataclasses.replace(s.meta, device=torch.device("meta")))
                                 for s in like.states))
    fzero.checkpoint.load(ck, like=elsewhere, model=emptied)
    assert emptied[0].weight.device.type == "meta" and not emptied[0].weight.requires_grad
    host = build()  # a module with real tensors: its frozen params stay on its device, whatever the state's
    host[0].weight.requires_grad_(False)
    fzero.checkpoint.load(ck, like=elsewhere, model=host)
    assert host[0].weight.device.type == "cpu" and torch.equal(host[0].weight, model[0].weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU twin of this test always runs)")
def test_frozen_params_loaded_into_a_module_of_meta_tensors_train_on_with_a_gpu_state(tmp_path):
    """The GPU case of ``test_frozen_params_loaded_into_a_module_of_meta_tensors_go_where_the_state_computes``: a
    module built on meta takes the checkpoint's frozen embedding on the GPU its state is on, and the run goes on."""
    build, compile_for, ck, state, model, rest = _frozen_embedding_run(tmp_path, save_model=True)
    with torch.device("meta"):
        emptied = build()
    emptied[0].weight.requires_grad_(False)
    step = compile_for(emptied)
    resumed = fzero.checkpoint.load(ck, like=step.init({k: v.cuda() for k, v in fzero.params_of(model).items()}), model=emptied)
    assert emptied[0].weight.device.type == "cuda" and torch.equal(emptied[0].weight.cpu(), model[0].weight)
    straight = compile_for(model)
    for b in rest:
        resumed, _ = step(resumed, b.cuda())
        state, _ = straight(state, b)
    assert_trees_close({k: v.cpu() for k, v in step.gather(resumed).items()}, straight.gather(state), rtol=1e-4, atol=1e-5)


def test_a_checkpoint_saved_without_the_model_is_not_loaded_into_a_model_with_frozen_params(tmp_path):
    build, compile_for, ck, _, model, _ = _frozen_embedding_run(tmp_path, save_model=False)
    with pytest.raises(CheckpointError, match=r"saved without model=, so it holds none of the frozen parameters of "
                                              r"Sequential \(\['0.weight'\]\)"):
        fzero.checkpoint.load(ck, like=compile_for(model), model=model)
    fzero.checkpoint.load(ck, like=compile_for(model))  # the module's frozen values are the user's to give, as before


def test_optimizer_false_loads_the_weights_into_a_step_of_another_optimizer(tmp_path):
    """To evaluate a checkpoint with a step that has no (or another) optimizer: params, buffers and step, as saved; the
    optimizer's state stays the step's own. Without optimizer=False such a load is refused, as before."""
    prob = mlp_problem(steps=2)
    adam = make_step(prob, stages=3, mesh=fzero.local_mesh(2))
    state = adam.init(fzero.params_of(prob.model))
    for b in prob.batches:
        state, _ = adam(state, b)
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    sgd = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=1, mesh=None)
    with pytest.raises(CheckpointError, match="optimizer state"):
        fzero.checkpoint.load(ck, like=sgd)
    weights = fzero.checkpoint.load(ck, like=sgd, optimizer=False)
    assert_trees_equal(sgd.gather(weights), adam.gather(state))
    assert weights.step_count == state.step_count


@pytest.mark.parametrize("offload", [None, "disk"])
def test_optimizer_false_resumes_the_schedule_at_the_checkpoints_step(tmp_path, offload):
    """The kept optimizer state's schedule goes on from the loaded step (as DeepSpeed loads the scheduler's position
    without the optimizer's states), so the lr a step applies is the one its metrics report."""
    prob = mlp_problem(steps=4)
    schedule = lambda t: 0.1 * (t + 1)  # noqa: E731  (a linear warm-up)
    (tmp_path / "off").mkdir()

    def compile_():
        return fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(schedule), stages=2, mesh=fzero.local_mesh(2),
                             **({"offload": fzero.DiskOffload(str(tmp_path / "off"))} if offload else {}))

    step = compile_()
    state = step.init(fzero.params_of(prob.model))
    for b in prob.batches[:3]:
        state, _ = step(state, b)
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    fresh = compile_()
    weights = fzero.checkpoint.load(ck, like=fresh, optimizer=False)
    after, m = fresh(weights, prob.batches[3])
    assert m["lr"] == pytest.approx(0.4)
    # SGD without momentum holds no state: the run that kept its optimizer is the reference, step for step
    ref, m_ref = step(state, prob.batches[3])
    assert m_ref["lr"] == pytest.approx(0.4)
    assert_trees_close(fresh.gather(after), step.gather(ref), rtol=1e-6, atol=1e-7)


def test_an_fp32_checkpoint_resumed_in_fp16_takes_the_steps_initial_loss_scale(tmp_path):
    """The checkpoint holds no loss scale: the fp16 state keeps its own initial one, with like=step and like=state (a
    like state's copy was zeros: a loss scale of 0, which zeroes every gradient and never grows)."""
    prob = mlp_problem(steps=1)
    fp32 = make_step(prob, stages=1, mesh=fzero.local_mesh(2))
    ck = fzero.checkpoint.save(tmp_path / "ck", fp32.init(fzero.params_of(prob.model)))
    fp16 = make_step(prob, stages=1, mesh=fzero.local_mesh(2), precision="fp16")
    fresh = fp16.init(fzero.params_of(prob.model))
    for like in (fp16, fresh):
        state = fzero.checkpoint.load(ck, like=like)
        for s, f in zip(state.states, fresh.states):
            assert [float(t) for t in s.loss_scale] == [float(t) for t in f.loss_scale] and float(s.loss_scale.scale) == 2.0**16
        before = {k: v.clone() for k, v in fp16.gather(state).items()}
        for _ in range(2):  # the schedule's lr is 0 at its first step
            state, m = fp16(state, prob.batches[0])
            assert not m["skipped"]
        assert any(not torch.equal(a, b) for a, b in zip(fp16.gather(state).values(), before.values()))


def test_rng_state_is_restored(tmp_path):
    prob = mlp_problem(steps=1)
    step = make_step(prob, stages=0, mesh=None)
    state = step.init(fzero.params_of(prob.model))
    torch.manual_seed(123)
    fzero.checkpoint.save(tmp_path / "ck", state)
    expected = torch.rand(4)
    fzero.checkpoint.load(tmp_path / "ck", like=step)
    assert torch.equal(torch.rand(4), expected)
    torch.rand(4)
    fzero.checkpoint.load(tmp_path / "ck", like=step, restore_rng=False)
    assert not torch.equal(torch.rand(4), expected)


def _drawing_problem(host: bool):
    """The MLP with a loss that draws from the RNGs: as many torch draws as the rank's rows say (ranks draw different
    amounts, so their streams end apart), and with ``host`` Python's ``random`` and NumPy's too."""
    import dataclasses
    import random

    import numpy as np

    prob = mlp_problem(steps=6)

    def loss_fn(params, b):
        noise = torch.rand(int(b["x"][:, 0].sum() > 0) + 1).sum()
        if host:
            noise = noise + random.random() + float(np.random.rand())
        return torch.nn.functional.mse_loss(fzero.apply(prob.model, params, b["x"]) * (1 + 0.1 * noise), b["y"])

    return dataclasses.replace(prob, loss_fn=loss_fn)


def _seed_all(seed: int) -> None:
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("ranks,host", [(2, False), (2, True), (None, True)])
def test_resume_draws_what_the_straight_run_draws(tmp_path, one_thread, stages, ranks, host):
    """Saved after 3 steps and resumed by a new step (another process's generators: reseeded), the run equals the
    straight one bit for bit: torch's CPU generator, Python's and NumPy's, and on local_mesh(2) each rank's own
    streams, which end apart when the ranks draw different amounts (before: the ranks restarted from rank 0's streams
    and Python's and NumPy's were not saved: losses 1.2e-3 to 3.7e-3 off)."""
    prob = _drawing_problem(host)

    def new_step():
        return make_step(prob, stages=stages, mesh=None if ranks is None else fzero.local_mesh(ranks))

    _seed_all(7)
    step = new_step()
    state, _ = train(step, step.init(fzero.params_of(prob.model)), prob.batches[:3])
    fzero.checkpoint.save(tmp_path / "ck", state)
    state, straight = train(step, state, prob.batches[3:])
    _seed_all(99)
    resumed_step = new_step()
    resumed, losses = train(resumed_step, fzero.checkpoint.load(tmp_path / "ck", like=resumed_step), prob.batches[3:])
    assert [float(x) for x in losses] == [float(x) for x in straight]
    assert_trees_equal(resumed_step.gather(resumed), step.gather(state))


def test_restore_rng_false_and_old_checkpoints_leave_the_new_generators_alone(tmp_path):
    """``restore_rng=False`` touches no generator; a checkpoint without the new keys (saved before they existed)
    still loads, restores torch's CPU generator (the old key keeps its meaning) and leaves Python's and NumPy's alone."""
    import random

    import numpy as np

    prob = mlp_problem(steps=1)
    step = make_step(prob, stages=0, mesh=None)
    state = step.init(fzero.params_of(prob.model))
    _seed_all(123)
    fzero.checkpoint.save(tmp_path / "ck", state)
    expected = (torch.rand(3), random.random(), np.random.rand())
    _seed_all(5)
    fzero.checkpoint.load(tmp_path / "ck", like=step, restore_rng=False)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(5)))
    assert (random.random(), np.random.rand()) == (random.Random(5).random(), np.random.RandomState(5).rand())
    fzero.checkpoint.load(tmp_path / "ck", like=step)
    assert torch.equal(torch.rand(3), expected[0]) and (random.random(), np.random.rand()) == expected[1:]

    # the checkpoint the code before the new keys wrote: torch's CPU generator as rng/0 only
    from fzero.checkpoint import _rng

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_rng, "tensors", lambda process, step: {f"rng/{process}": torch.get_rng_state()})
        _seed_all(123)
        old = fzero.checkpoint.save(tmp_path / "old", state)
    metadata = torch.distributed.checkpoint.FileSystemReader(old).read_metadata()
    assert [k for k in metadata.state_dict_metadata if k.startswith("rng")] == ["rng/0"]
    _seed_all(5)
    fzero.checkpoint.load(old, like=step)
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == (random.Random(5).random(), np.random.RandomState(5).rand())


def test_cuda_generators_are_saved_where_cuda_is_initialized_and_restored_where_the_device_count_matches(tmp_path, monkeypatch):
    """The CPU twin of ``test_dropout_on_a_gpu_resumes_bitwise``: torch.cuda's calls stand in for two devices."""
    prob = mlp_problem(steps=1)
    step = make_step(prob, stages=0, mesh=None)
    state = step.init(fzero.params_of(prob.model))
    with pytest.MonkeyPatch.context() as mp:  # CUDA never initialized (on a GPU machine an earlier test may have)
        mp.setattr(torch.cuda, "is_initialized", lambda: False)
        fzero.checkpoint.save(tmp_path / "none", state)  # nothing drawn there, nothing saved
    keys = torch.distributed.checkpoint.FileSystemReader(str(tmp_path / "none")).read_metadata().state_dict_metadata
    assert "rng_cuda/0" not in keys and {"rng/0", "rng_python/0", "rng_numpy/0"} <= set(keys)
    devices = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in devices])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    fzero.checkpoint.save(tmp_path / "ck", state)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fzero.checkpoint.load(tmp_path / "ck", like=step)
    assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], devices))
    fzero.checkpoint.load(tmp_path / "ck", like=step, restore_rng=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # another machine: which device's state is whose?
    fzero.checkpoint.load(tmp_path / "ck", like=step)
    assert len(restored) == 1


def test_like_step_rebuilds_the_params_on_the_device_they_computed_on(tmp_path, monkeypatch):
    """The CPU twin of ``test_dropout_on_a_gpu_resumes_bitwise``'s load: ``like=step`` rebuilt the params on the host
    whatever the checkpoint's device, so a CUDA model's first layer failed on a host param ("Expected all tensors to
    be on the same device", seen on an H200). The save records where the params computed; a CUDA checkpoint goes to
    this process's current CUDA device, a host one (or one saved before the record) to the host."""
    from fzero.checkpoint._load import saved_device

    prob = mlp_problem(steps=1)
    step = make_step(prob, stages=2, mesh=fzero.local_mesh(2))
    fzero.checkpoint.save(tmp_path / "ck", step.init(fzero.params_of(prob.model)))
    assert json.loads((tmp_path / "ck" / "fzero.json").read_text())["device"] == "cpu"
    loaded = fzero.checkpoint.load(tmp_path / "ck", like=step)
    assert {t.device.type for s in loaded.states for t in s.params.values()} == {"cpu"}
    assert all(s.meta.device.type == "cpu" for s in loaded.states)
    assert saved_device({"device": "cpu"}) == torch.device("cpu")
    assert saved_device({}) == torch.device("cpu")  # saved before the device was recorded: as before
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert saved_device({"device": "cuda"}) == torch.device("cpu")  # a GPU run's checkpoint on a machine without one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert saved_device({"device": "cuda"}) == torch.device("cuda", 1)  # torchrun's rank 1: its own device


def test_buffers_a_checkpoint_adds_to_a_state_are_made_on_its_compute_device():
    """``like=step`` starts from a state without buffers (a step adopts the module's at its first), so every buffer
    the checkpoint holds is made to be read into: on the device the state computes on, where the module's own
    buffers are (made on the host, a CUDA model's BatchNorm would meet host running statistics). The device is
    stood in for by ``meta`` here: on the CPU every device is the host."""
    import dataclasses

    from fzero.checkpoint._state import with_saved_buffers

    prob = mlp_problem(steps=1)
    state = make_step(prob, stages=0, mesh=None).init(fzero.params_of(prob.model))
    elsewhere = dataclasses.replace(state, meta=dataclasses.replace(state.meta, device=torch.device("meta")))
    info = {"buffers": [{"name": "bn.running_mean", "shape": [4], "dtype": "float32"}]}
    assert with_saved_buffers(elsewhere, info).buffers["bn.running_mean"].device.type == "meta"
    assert with_saved_buffers(state, info).buffers["bn.running_mean"].device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU twins of this test always run)")
def test_a_batchnorm_model_saved_on_a_gpu_resumes_there_from_like_step(tmp_path):
    """Params and buffers of ``load(like=step)`` on the GPU the run was on: the straight run, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).cuda()
    batches = [{"x": torch.randn(8, 8, device="cuda"), "y": torch.randn(8, 2, device="cuda")} for _ in range(4)]

    def loss_fn(params, b):
        return torch.nn.functional.mse_loss(fzero.apply(model, params, b["x"]), b["y"])

    def make():
        return fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=3)

    step = make()
    state, _ = train(step, step.init(fzero.params_of(model)), batches[:2])
    fzero.checkpoint.save(tmp_path / "ck", state)
    state, straight = train(step, state, batches[2:])
    again = make()
    loaded = fzero.checkpoint.load(tmp_path / "ck", like=again)
    assert {t.device.type for t in loaded.buffers.values()} == {"cuda"}
    resumed, losses = train(again, loaded, batches[2:])
    assert [float(x) for x in losses] == [float(x) for x in straight]
    assert_trees_equal(again.gather(resumed), step.gather(state))
    assert_trees_equal(resumed.buffers, state.buffers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (its CPU counterpart: test_consolidate_loads_strictly_...)")
def test_consolidate_of_a_gpu_model_writes_every_tensor_on_the_host(tmp_path):
    """``consolidate(..., model=model)`` of a CUDA model: the frozen params the checkpoint lacks come from the model,
    on the host as the saved ones (they were CUDA tensors in the file, which then failed to load without CUDA). No CPU
    twin shows the device: on the CPU every tensor is on the host anyway."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).cuda()
    model[0].requires_grad_(False)
    batch = {"x": torch.randn(8, 4, device="cuda"), "y": torch.randn(8, 2, device="cuda")}

    def loss_fn(params, b):
        return torch.nn.functional.mse_loss(fzero.apply(model, params, b["x"]), b["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=0)
    state, _ = train(step, step.init(fzero.params_of(model)), [batch])
    fzero.checkpoint.save(tmp_path / "ck", state)
    out = fzero.checkpoint.consolidate(tmp_path / "ck", tmp_path / "model.pt", model=model)
    loaded = torch.load(out, weights_only=True)
    assert sorted(loaded) == sorted(name for name, _ in model.named_parameters())  # its state_dict() is refused now
    assert {k: v.device.type for k, v in loaded.items()} == {k: "cpu" for k in loaded}
    assert torch.equal(loaded["0.weight"], model[0].weight.cpu())
    assert torch.equal(loaded["1.weight"], step.gather(state)["1.weight"].cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU twin of this test always runs)")
def test_dropout_on_a_gpu_resumes_bitwise(tmp_path):
    """Dropout on a CUDA model draws from the device's generator: saved mid-way and resumed after a reseed, the run
    equals the straight one bit for bit (before: the CUDA generators were not saved, so other masks)."""
    import dataclasses

    prob = mlp_problem(steps=6)
    model = prob.model.cuda()
    batches = [{k: v.cuda() for k, v in b.items()} for b in prob.batches]

    def loss_fn(params, b):
        h = torch.nn.functional.dropout(b["x"], 0.3)
        return torch.nn.functional.mse_loss(fzero.apply(model, params, h), b["y"])

    prob = dataclasses.replace(prob, loss_fn=loss_fn)
    torch.manual_seed(7)
    step = make_step(prob, stages=0, mesh=None)
    state, _ = train(step, step.init(fzero.params_of(model)), batches[:3])
    fzero.checkpoint.save(tmp_path / "ck", state)
    state, straight = train(step, state, batches[3:])
    torch.manual_seed(99)
    again = make_step(prob, stages=0, mesh=None)
    resumed, losses = train(again, fzero.checkpoint.load(tmp_path / "ck", like=again), batches[3:])
    assert [float(x) for x in losses] == [float(x) for x in straight]
    assert_trees_equal(again.gather(resumed), step.gather(state))


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    fixed, parent = str(tmp_path / "ck"), str(tmp_path / "keep")
    logs = {fixed: tmp_path / "fixed.log", parent: tmp_path / "keep.log"}
    procs = {}
    for where, extra in ((fixed, []), (parent, ["--keep"])):
        with open(logs[where], "wb") as log:
            procs[where] = subprocess.Popen([sys.executable, WORKER, "crash", "--save", where, *extra], env=ENV, stdout=log, stderr=log)

    def mid_save(where: str) -> bool:  # a complete checkpoint exists and a later one is being written
        if where == fixed:
            return os.path.exists(os.path.join(fixed, "COMPLETE")) and os.path.exists(os.path.join(tmp_path, ".ck.partial"))
        return os.path.isdir(parent) and fzero.checkpoint.latest(parent) is not None and any(e.endswith(".partial") for e in os.listdir(parent))

    deadline = time.monotonic() + 60
    try:
        while procs and time.monotonic() < deadline:
            for where, proc in list(procs.items()):
                assert proc.poll() is None, logs[where].read_text()[-3000:]
                if mid_save(where):
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    del procs[where]
            time.sleep(0.005)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    assert not procs, "the workers never reached a second save"
    step, params = crash_step()
    expected = step.gather(step.init(params))
    for where in (fixed, parent):
        state = fzero.checkpoint.load(where, like=step)
        assert state.step_count == fzero.checkpoint.read_extra(where)["k"] >= 1
        assert_trees_equal(step.gather(state), expected)
    assert os.path.isdir(tmp_path / ".ck.partial")  # the killed save's leftovers
    fzero.checkpoint.save(fixed, state)  # the next save replaces them
    assert not os.path.exists(os.path.join(tmp_path, ".ck.partial"))


# -- errors -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    prob = mlp_problem(steps=1)
    step = make_step(prob, stages=1, mesh=fzero.local_mesh(2))
    state, _ = train(step, step.init(fzero.params_of(prob.model)), prob.batches)
    path = fzero.checkpoint.save(str(tmp_path_factory.mktemp("saved") / "ck"), state)
    return path, step, state


def copy_of(saved, tmp_path) -> str:
    return shutil.copytree(saved[0], str(tmp_path / "copy"))


def data_file(path: str) -> str:
    return os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0])


def test_load_errors_name_the_path_and_what_is_wrong(saved, tmp_path):
    _, step, _ = saved
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere"):
        fzero.checkpoint.load(tmp_path / "nowhere", like=step)
    ck = copy_of(saved, tmp_path)
    os.remove(os.path.join(ck, "COMPLETE"))
    with pytest.raises(CheckpointError, match=r"copy is incomplete: it has no COMPLETE marker"):
        fzero.checkpoint.load(ck, like=step)
    shutil.rmtree(ck)
    ck = copy_of(saved, tmp_path)
    os.remove(data_file(ck))
    with pytest.raises(CheckpointError, match=r"copy is damaged: the file __0_0.distcp is missing"):
        fzero.checkpoint.load(ck, like=step)
    shutil.rmtree(ck)
    ck = copy_of(saved, tmp_path)
    with open(data_file(ck), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"__0_0.distcp has 100 bytes, \d+ were written"):
        fzero.checkpoint.load(ck, like=step)
    shutil.rmtree(ck)
    ck = copy_of(saved, tmp_path)
    size = os.path.getsize(data_file(ck))
    with open(data_file(ck), "r+b") as f:  # same size, garbage inside: its checksum differs
        f.write(b"\xff" * size)
    with pytest.raises(fzero.checkpoint.CheckpointCorrupted, match=r"copy is corrupted: __0_0.distcp has CRC-32 [0-9a-f]{8}, but [0-9a-f]{8} was recorded"):
        fzero.checkpoint.load(ck, like=step)
    # unverified, DCP's own error, re-raised as an Exception
    with pytest.raises(CheckpointError, match=r"fzero.checkpoint.load: .*copy: could not read the data \(a data file is corrupted or was changed\)"):
        fzero.checkpoint.load(ck, like=step, verify=False)


def test_other_tools_checkpoints_are_named_with_what_fzero_reads_of_them(saved, tmp_path):
    """What users come with: an FSDP2 run's dcp.save directory was called an interrupted fzero save, and a Hugging Face
    Trainer's checkpoint-N "neither a checkpoint nor a directory holding" one. Each is named, with the way to its
    weights and the word that its optimizer state is not read."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    _, step, _ = saved
    torch.save({"model": {"w": torch.ones(2)}}, tmp_path / "full.pt")
    torch_save_to_dcp(tmp_path / "full.pt", tmp_path / "fsdp")  # DCP's format, as FSDP2's get_state_dict + dcp.save
    for api in (lambda p: fzero.checkpoint.load(p, like=step), lambda p: fzero.checkpoint.consolidate(p, tmp_path / "o.pt")):
        with pytest.raises(CheckpointError, match=r"fsdp is a torch.distributed.checkpoint \(DCP\) directory that fzero did "
                                                  r"not write .*dcp_to_torch_save.* The optimizer starts afresh"):
            api(tmp_path / "fsdp")
    trainer = tmp_path / "checkpoint-2"
    trainer.mkdir()
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        (trainer / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"checkpoint-2 holds Hugging Face weights \(model.safetensors: .*"
                                              r"fzero.checkpoint.pretrained\(path, model=model\).*its optimizer.pt \(a torch "
                                              r"optimizer's state: AdamW's moments\) is not read"):
        fzero.checkpoint.load(trainer, like=step)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "latest").write_text("global_step3")
    with pytest.raises(CheckpointError, match=r"ds is a DeepSpeed checkpoint .*fzero.checkpoint.from_deepspeed"):
        fzero.checkpoint.load(tmp_path / "ds", like=step)


def test_a_run_directory_whose_checkpoints_are_incomplete_is_not_named_another_tools(saved, tmp_path):
    """A run directory holds fzero's step_* checkpoints, and often save_weights' model.safetensors or a `latest` file
    the user's script writes beside them. Its newest complete checkpoint loads; where none is complete (a copy in
    progress lacks the COMPLETE marker), load named the directory Hugging Face weights "not an fzero checkpoint" (or
    a DeepSpeed checkpoint), and told the user to start from the weights with a fresh optimizer: the checkpoints'
    optimizer state given up for a copy that had not finished."""
    _, step, _ = saved
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(saved[0], run / "step_00000001")
    (run / "model.safetensors").write_bytes(b"")
    (run / "latest").write_text("step_00000001")
    assert fzero.checkpoint.load(run, like=step).step_count == saved[2].step_count
    os.remove(run / "step_00000001" / "COMPLETE")
    for extra in ("model.safetensors", "latest"):
        with pytest.raises(CheckpointError, match=r"run is neither a checkpoint nor a directory holding complete step_\* "
                                                  r"checkpoints\.$"):
            fzero.checkpoint.load(run, like=step)
        os.remove(run / extra)


def test_metadata_that_would_run_code_is_refused(saved, tmp_path):
    _, step, _ = saved
    ck = copy_of(saved, tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(os.path.join(ck, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    os.remove(os.path.join(ck, "COMPLETE"))  # a marker with the evil file's checksum, so that only the unpickler stands in the way
    (tmp_path / "copy" / "COMPLETE").write_bytes(marker_bytes(ck, {f: crc32_file(os.path.join(ck, f)) for f in os.listdir(ck)}))
    with pytest.raises(CheckpointError, match=r"\.metadata is corrupted or not DCP metadata .*refusing to load (posix|os)\.system"):
        fzero.checkpoint.load(ck, like=step)
    with pytest.raises(CheckpointError, match="refusing"):
        fzero.checkpoint.consolidate(ck, tmp_path / "out.pt")
    assert not marker.exists()


def test_load_into_another_model_or_optimizer_is_refused(saved):
    path, _, _ = saved
    other = mlp_problem(steps=1, sizes=(16, 32, 4))
    with pytest.raises(CheckpointError, match=r"does not hold this model's parameters .*not in the state: layers.4.bias"):
        fzero.checkpoint.load(path, like=make_step(other, stages=1, mesh=None).init(fzero.params_of(other.model)))
    prob = mlp_problem(steps=1)
    sgd = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1, momentum=0.9), stages=0)
    with pytest.raises(CheckpointError, match=r"optimizer state in .* differs from this step's optimizer's"):
        fzero.checkpoint.load(path, like=sgd)
    with pytest.raises(TypeError, match="like must be the Step to resume with"):
        fzero.checkpoint.load(path, like=prob.model)


def test_extra_with_keys_json_would_turn_into_str_is_refused_before_writing(saved, tmp_path):
    """``extra`` goes through JSON, which writes every dict key as a str without a word: a loader's ``{rank: position}``
    came back as ``{"0": ...}`` (``positions.get(rank, 0)`` restarted the data, silently), and ``{1: a, "1": b}`` lost
    an entry. DeepSpeed's ``client_state`` (``torch.save``) keeps them. Refused by name, with the fix; str keys, lists
    and nested dicts round-trip exactly."""
    _, step, state = saved
    for extra, match in (({"pos": {0: 120, 1: 96}}, r"extra\['pos'\] has the key 0 \(int\), which would come back from "
                                                     r"read_extra as the str '0'\. Write str keys \(str\(0\)\)"),
                         ({1: "a", "1": "b"}, r"extra has the key 1 \(int\).*the key of the entry extra\['1'\], one of "
                                              r"which would be lost"),
                         ({"runs": [{"ok": 1}, {None: 2}]}, r"extra\['runs'\]\[1\] has the key None \(NoneType\)")):
        with pytest.raises(TypeError, match=r"fzero.checkpoint.save: extra must be JSON data, whose dict keys are str; " + match):
            fzero.checkpoint.save(tmp_path / "a", state, extra=extra)
        assert not os.path.exists(tmp_path / "a")
    good = {"pos": {"0": 120, "1": 96}, "seen": [1, 2.5, None, True, "x"], "nested": {"a": {"b": []}}}
    assert fzero.checkpoint.read_extra(fzero.checkpoint.save(tmp_path / "b", state, extra=good)) == good


def test_save_errors(saved, tmp_path):
    _, step, state = saved
    with pytest.raises(ValueError, match="pass the whole RankStates"):
        fzero.checkpoint.save(tmp_path / "a", state[0])
    with pytest.raises(ValueError, match="keep must be None .* or an int >= 1"):
        fzero.checkpoint.save(tmp_path / "a", state, keep=0)
    with pytest.raises(TypeError, match="extra must be JSON data"):
        fzero.checkpoint.save(tmp_path / "a", state, extra={"when": object()})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="mine exists and is not an fzero checkpoint; refusing to replace it"):
        fzero.checkpoint.save(tmp_path / "mine", state)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    donor = fzero.compile(mlp_problem().loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=0)
    s0 = donor.init(fzero.params_of(mlp_problem().model))
    donor(s0, mlp_problem().batches[0])
    with pytest.raises(ValueError, match="reused its buffers"):
        fzero.checkpoint.save(tmp_path / "b", s0)
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
