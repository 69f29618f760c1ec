"""Buffers are state: BatchNorm statistics and other buffers a forward writes live in ``TrainState.buffers``,
come back from the step, save and load with checkpoints, and never touch the user's module.

The reference is plain PyTorch on a copy of the module (DDP's semantics on several ranks are in
test_zoo.py); a forward that writes its buffers in place is refused by ``torch.func.grad`` unless they
are tensors of its own level, which is what these tests guard at every stage.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fzero
from fzero.testing import assert_trees_close, assert_trees_equal


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU()),  # cumulative average: reads the count
        nn.Flatten(), nn.Linear(4 * 4 * 4, 2),
    )


def _batches(n=3, batch=4):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, 8, 8, generator=gen) for _ in range(n)]


def _loss(out):
    return out.pow(2).mean()


def _plain(model, batches, *, accum=1):
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in batches:
        opt.zero_grad()
        for micro in b.chunk(accum):
            (_loss(ref(micro)) / accum).backward()
        opt.step()
    return dict(ref.state_dict())


def _fzero(model, batches, *, stages, autodiff="func", **kw):
    def loss_fn(params, b):
        return _loss(fzero.apply(model, params, b))

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(1), autodiff=autodiff, **kw)
    state = step.init(fzero.params_of(model))
    for b in batches:
        state, _ = step(state, b)
    return step, state


@pytest.mark.parametrize("autodiff", ["func", "autograd"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_batchnorm_trains_as_in_pytorch_and_the_module_is_untouched(stages, autodiff):
    model = _cnn()
    before = copy.deepcopy(model.state_dict())
    step, state = _fzero(model, _batches(), stages=stages, autodiff=autodiff)
    got = step.state_dict(state, model)
    assert list(got) == list(model.state_dict(keep_vars=True))  # the model's keys, in its order
    assert_trees_equal(got, _plain(model, _batches()))
    assert int(got["1.num_batches_tracked"]) == 3
    assert_trees_equal({k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}, dict(before))
    copy.deepcopy(model).load_state_dict(got, strict=True)


def test_grad_accum_updates_the_statistics_once_per_micro_batch():
    model = _cnn()
    step, state = _fzero(model, _batches(), stages=2, grad_accum=2)
    got = step.state_dict(state, model)
    assert_trees_equal(got, _plain(model, _batches(), accum=2))
    assert int(got["3.1.num_batches_tracked"]) == 6


def test_init_takes_the_buffers_and_evaluate_leaves_them():
    model = _cnn()

    def loss_fn(params, b):
        return _loss(fzero.apply(model, params, b))

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model), buffers=fzero.buffers_of(model))
    assert_trees_equal(step.state_dict(state, model), dict(model.state_dict()))  # before any step
    state, _ = step(state, torch.cat(_batches(2)))
    held = {k: v.clone() for k, v in state[0].buffers.items()}
    step.evaluate(state, torch.cat(_batches(2)))
    assert_trees_equal(state[0].buffers, held)


def test_under_bf16_buffers_stay_in_their_own_dtype():
    model = _cnn()
    step, state = _fzero(model, _batches(), stages=3, precision="bf16")
    state = state[0]
    assert state.buffers["1.running_mean"].dtype == torch.float32
    assert state.buffers["1.num_batches_tracked"].dtype == torch.int64
    assert int(state.buffers["1.num_batches_tracked"]) == 3
    assert not torch.equal(state.buffers["1.running_mean"], model[1].running_mean)


class _Constants(nn.Module):
    """A BatchNorm beside persistent buffers the forward only reads: a float64 table and an fp32 scale that bf16
    cannot hold."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.register_buffer("table", torch.tensor([1.0 + 2**-40, 3.141592653589793], dtype=torch.float64))
        self.register_buffer("scale", torch.tensor(1.0 + 2**-20))

    def forward(self, x):
        return self.bn(self.fc(x)) * self.table[1].to(x.dtype) * self.scale.to(x.dtype)


@pytest.mark.parametrize("autodiff", ["func", "autograd"])
@pytest.mark.parametrize("stages", [0, 3])
def test_under_bf16_a_buffer_the_forward_only_reads_keeps_its_exact_value(stages, autodiff):
    """Before: every floating buffer came back from the bf16 forward rounded through bf16, so after one step the
    state, state_dict and checkpoints held pi as 3.140625 and 1 + 2**-20 as 1.0 (load_state_dict of it wrote them
    into the model). The forward still reads the bf16 casts; what it writes (BatchNorm's statistics) is kept."""
    torch.manual_seed(0)
    model = _Constants()

    def loss_fn(params, b):
        return _loss(fzero.apply(model, params, b))

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(2),
                         precision="bf16", autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    for _ in range(2):
        state, _ = step(state, torch.randn(8, 4))
    got = step.state_dict(state, model)
    assert got["table"].dtype == torch.float64 and torch.equal(got["table"], model.table)
    assert torch.equal(got["scale"], model.scale)
    assert not torch.equal(got["bn.running_mean"], model.bn.running_mean) and int(got["bn.num_batches_tracked"]) == 2


def test_checkpoints_keep_the_buffers_across_stages_and_consolidate_has_them(tmp_path):
    model = _cnn()
    batches = _batches(4, batch=8)

    def loss_fn(params, b):
        return _loss(fzero.apply(model, params, b))

    def make(stages):
        return fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(2))

    s3 = make(3)
    state = s3.init(fzero.params_of(model))
    for b in batches[:2]:
        state, _ = s3(state, b)
    fzero.checkpoint.save(str(tmp_path / "ckpt"), state)
    for b in batches[2:]:
        state, _ = s3(state, b)
    straight = s3.state_dict(state, model)

    s1 = make(1)  # resharded to stage 1
    resumed = fzero.checkpoint.load(str(tmp_path / "ckpt"), like=s1)
    assert sorted(resumed[0].buffers) == sorted(k for k in model.state_dict(keep_vars=True) if ".running_" in k or "num_batches" in k)
    for b in batches[2:]:
        resumed, _ = s1(resumed, b)
    assert_trees_equal(s1.state_dict(resumed, model), straight)

    out = fzero.checkpoint.consolidate(str(tmp_path / "ckpt"), str(tmp_path / "model.pt"), model=model)
    loaded = torch.load(out, weights_only=True)
    assert int(loaded["1.num_batches_tracked"]) == 2
    copy.deepcopy(model).load_state_dict(loaded, strict=True)


def test_errors_name_the_api_and_the_fix():
    model = _cnn()
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"fzero.Step.init: buffers must be a dict of buffer name -> tensor, as fzero.buffers_of"):
        step.init(fzero.params_of(model), buffers=[1])
    state, _ = step(step.init(fzero.params_of(model)), _batches(1)[0])
    with pytest.raises(ValueError, match=r"fzero.Step.state_dict: the state holds .* which Linear.state_dict\(\) does not name"):
        step.state_dict(state, nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"fzero.buffers_of: expected an nn.Module"):
        fzero.buffers_of({})



def test_state_dict_refuses_a_model_of_another_width_and_names_itself_on_a_spent_state():
    """A model of the same names and another width got the state's tensors silently (load_state_dict failed later,
    naming no cause); a spent state's error named Step.gather; a meta value for with_buffers was torch's bare
    "Cannot copy out of meta tensor"."""
    model = _cnn()
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1))
    first = step.init(fzero.params_of(model))
    state, _ = step(first, _batches(1)[0])
    wider = _cnn()
    wider[5] = nn.Linear(4 * 4 * 4, 3)
    with pytest.raises(ValueError, match=r"fzero.Step.state_dict: '5.weight' has shape \(2, 64\) in the state but \(3, 64\) "
                                         r"in Sequential: the model is another configuration"):
        step.state_dict(state, wider)
    with pytest.raises(ValueError, match=r"^fzero.Step.state_dict: this state was already passed to a step"):
        step.state_dict(first, model)
    with pytest.raises(ValueError, match=r"with_buffers: the value for buffer '1.running_mean' is a meta tensor"):
        step.with_buffers(state, {"1.running_mean": torch.zeros(4, device="meta")})
    model.load_state_dict(step.state_dict(state, model))  # the model it was made from: strict, as before

class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.bn(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _student_and_teacher():
    torch.manual_seed(0)
    student, teacher = _BNNet(), _BNNet()
    with torch.no_grad():  # a trained teacher's statistics, unlike the student's
        teacher.bn.running_mean.uniform_(-1, 1)
        teacher.bn.running_var.uniform_(0.5, 2.0)
    return student, teacher.eval().requires_grad_(False)


def _distill(s, t):
    return torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")


@pytest.mark.parametrize("stages", [0, 3])
def test_a_teacher_run_by_apply_is_refused_where_it_would_share_the_students_buffers(stages):
    """A teacher (or a GAN's discriminator) built from the same code has buffers of the same names as the model: run
    by fzero.apply in the model's step, it read the state's values and wrote its own into them, silently (the teacher's
    output 4% off at the second step, the student's statistics started from the teacher's)."""
    student, teacher = _student_and_teacher()

    def loss_fn(params, x):
        with torch.no_grad():
            t = fzero.apply(teacher, {}, x)  # the teacher's frozen params come from the module
        return _distill(fzero.apply(student, params, x), t)

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages)
    state = step.init(fzero.params_of(student))
    with pytest.raises(ValueError, match=r"fzero.apply: two modules run in this step, a _BNNet and then a _BNNet "
                                         r"\(another instance of the same class\), have a persistent buffer 'bn.running_mean'"
                                         r".*fzero.apply\(other, \{\*\*other_params, \*\*other_buffers\}, x\)"):
        step(state, torch.randn(8, 4))


@pytest.mark.parametrize("stages", [0, 3])
def test_a_teacher_given_its_own_buffers_distills_as_in_pytorch(stages):
    """The error's fix: the teacher's buffers beside its params; the student then trains as plain PyTorch with the
    teacher called directly, and under bf16 the teacher's fp32 tensors meet the cast input (before: a dtype error)."""
    student, teacher = _student_and_teacher()
    own = {**dict(teacher.named_parameters()), **fzero.buffers_of(teacher)}

    def loss_fn(params, x):
        with torch.no_grad():
            t = fzero.apply(teacher, own, x)
        return _distill(fzero.apply(student, params, x).float(), t.float())

    ref = copy.deepcopy(student)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages)
    state = step.init(fzero.params_of(student))
    for x in [torch.randn(8, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]:
        opt.zero_grad()
        with torch.no_grad():
            t = teacher(x)
        _distill(ref(x), t).backward()
        opt.step()
        state, _ = step(state, x)
    got, want = step.state_dict(state, student), ref.state_dict()
    for name in want:  # inp.bias comes before BatchNorm: no effect on the loss, rounding noise for a gradient
        if name != "inp.bias":
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    bf16 = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, precision="bf16")
    _, metrics = bf16(bf16.init(fzero.params_of(student)), torch.randn(8, 4))
    assert torch.isfinite(torch.as_tensor(metrics["loss"]))


def test_blocks_of_the_trained_model_applied_one_by_one_are_told_to_apply_the_model():
    """Two blocks of the model the step trains, each run by fzero.apply with its share of the params (as a per-block
    recompute does), have buffers of the same names: refused as a teacher is, but the teacher's fix (buffers given
    beside the params) would drop their BatchNorm updates, so the error names the model's own way too."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(2))

    def loss_fn(params, x):
        for i, block in enumerate(blocks):
            x = fzero.apply(block, {k[2:]: v for k, v in params.items() if k.startswith(f"{i}.")}, x)
        return x.square().mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0)
    with pytest.raises(ValueError, match=r"(?s)have a persistent buffer '1.running_mean'.*parts of the model this step "
                                         r"trains.*fzero.apply\(model.features, params, x\).*remat=True"):
        step(step.init(fzero.params_of(blocks)), torch.randn(8, 4))


class _QATNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import torch.ao.quantization as Q

        self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])  # the stage-3 unit

    def forward(self, x):
        return self.dequant(self.blocks[0](torch.relu(self.inp(self.quant(x)))))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # torch.ao.quantization's own
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 3])
def test_a_buffer_the_forward_resizes_exports_in_its_new_shape(stages, ranks):
    """Eager QAT (``prepare_qat`` with a per-channel weight qconfig): each FakeQuantize resizes its ``scale`` and
    ``zero_point`` from (1,) to one per channel at its first forward. Training matched PyTorch, but ``step.state_dict(state,
    model)`` refused the state's (8,) against the module's (1,) as "another configuration of the model", so the trained
    model could not be loaded or converted. PyTorch's own ``load_state_dict`` resizes them back (FakeQuantize's
    ``_load_from_state_dict``)."""
    import torch.ao.quantization as Q

    def build():
        torch.manual_seed(0)
        m = _QATNet()
        m.qconfig = Q.get_default_qat_qconfig("x86")
        return Q.prepare_qat(m.train())

    batches = [b.flatten(1)[:, :4] for b in _batches(3)]
    ref = build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in batches:
        opt.zero_grad()
        reps = [ref] + [copy.deepcopy(ref) for _ in range(ranks - 1)]  # DDP: each rank from rank 0's values
        grads = []
        for r, part in zip(reps, b.chunk(ranks)):  # rank 0's buffers are the process's
            _loss(r(part)).backward()
            grads.append([p.grad.clone() for p in r.parameters()])
        for p, gs in zip(ref.parameters(), zip(*grads)):
            p.grad = sum(gs) / ranks
        opt.step()
    model = build()
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    for b in batches:
        state, _ = step(state, b)
    sd = step.state_dict(state, model)
    assert sd["inp.weight_fake_quant.scale"].shape == (8,)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(sd[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    fresh = build()
    fresh.load_state_dict(sd)  # strict
    Q.convert(fresh.eval())


class _SharedNorm(nn.Module):
    """One BatchNorm registered under two names and run twice in a forward: its statistics are one tensor under two
    ``state_dict`` keys (tied buffers, as peft's VeRA and RandLoRA tie their projections across layers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.bn1 = self.bn2 = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.head(self.bn2(self.fc2(self.bn1(self.fc1(x)))))


def _shared_norm_batches():
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=gen) for _ in range(3)]


def _ddp_shared_norm(model, ranks):
    """Plain PyTorch with DDP's semantics: rank 0's statistics broadcast to every replica before each forward."""
    ref = copy.deepcopy(model)
    reps = [ref] + [copy.deepcopy(ref) for _ in range(ranks - 1)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in _shared_norm_batches():
        for rep in reps[1:]:
            rep.load_state_dict(ref.state_dict())
        grads = []
        for rep, half in zip(reps, b.chunk(ranks)):
            rep.zero_grad()
            _loss(rep(half)).backward()
            grads.append([p.grad for p in rep.parameters()])
        for p, gs in zip(ref.parameters(), zip(*grads)):
            p.grad = sum(gs) / ranks
        opt.step()
    return dict(ref.state_dict())


@pytest.mark.parametrize("ranks", [1, 2])
# remat at stage 2 with named units: _SharedNorm has no default unit, so {"stages": 0, "remat": True} recomputed nothing
@pytest.mark.parametrize("settings", [{"stages": 0}, {"stages": 0, "autodiff": "func"},
                                      {"stages": 2, "units": ["fc1", "fc2", "head"], "remat": True},
                                      {"stages": 2}, {"stages": 3, "units": ["fc1", "fc2", "head"]},
                                      {"stages": 3, "units": ["fc1", "fc2", "head"], "remat": True}],
                         ids=lambda s: "-".join(f"{k}{v if not isinstance(v, list) else ''}" for k, v in s.items()))
def test_a_buffer_tied_under_two_names_trains_as_in_pytorch(settings, ranks):
    """Each name was a copy of its own in the state, and torch's functional_call refused the two values ("got multiple
    values for keys ... which are tied"): a model with tied buffers did not train at all. Now one tensor serves both
    names, written twice per forward as in the module."""
    model = _SharedNorm()

    def loss_fn(params, b):
        return _loss(fzero.apply(model, params, b))

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), mesh=fzero.local_mesh(ranks), **settings)
    state = step.init(fzero.params_of(model), buffers=fzero.buffers_of(model))
    for b in _shared_norm_batches():
        state, _ = step(state, b)
    got = step.state_dict(state, model)
    expected = _ddp_shared_norm(model, ranks)
    assert int(expected["bn1.num_batches_tracked"]) == 6  # the reference runs the norm twice a forward
    assert_trees_equal(got, expected)
    copy.deepcopy(model).load_state_dict(got, strict=True)


def test_tied_buffers_resume_save_their_weights_once_and_two_values_for_them_are_refused(tmp_path):
    model = _SharedNorm()
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.adamw(1e-2), stages=3,
                         units=["fc1", "fc2", "head"], mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    b0, b1, b2 = _shared_norm_batches()
    state, _ = step(state, b0)
    fzero.checkpoint.save(tmp_path, state)
    resumed = fzero.checkpoint.load(tmp_path, like=state)
    state, _ = step(state, b1)
    resumed, _ = step(resumed, b1)
    assert_trees_equal(step.state_dict(resumed, model), step.state_dict(state, model))
    one = step.with_buffers(resumed, {"bn1.running_mean": torch.ones(4)})  # the other name keeps its value: which is it?
    with pytest.raises(ValueError, match=r"fzero.apply: the buffers 'bn1.running_mean' and 'bn2.running_mean' of "
                                         r"_SharedNorm are one tensor.*step.with_buffers\(state, \{'bn1.running_mean'"):
        step(one, b2)
    both = step.with_buffers(state, {"bn1.running_mean": torch.ones(4), "bn2.running_mean": torch.ones(4)})
    both, _ = step(both, b2)
    got = step.state_dict(both, model)
    assert got["bn1.running_mean"].equal(got["bn2.running_mean"])
    assert (got["bn1.running_mean"] - 1).abs().max() < 0.5  # started from the ones set under both names
    # weight files write a tied tensor once, as save_pretrained does (safetensors refuses shared storage); both were
    # refused as a name the model lacks
    from safetensors.torch import load_file

    fzero.checkpoint.save_weights(step, both, tmp_path / "weights", model=model)
    fzero.checkpoint.save(tmp_path / "again", both)
    fzero.checkpoint.consolidate(tmp_path / "again", tmp_path / "consolidated", model=model, format="safetensors")
    for written in (load_file(tmp_path / "weights" / "model.safetensors"), load_file(tmp_path / "consolidated" / "model.safetensors")):
        assert "bn1.running_mean" in written and "bn2.running_mean" not in written
        fresh = _SharedNorm()
        fresh.load_state_dict(written, strict=False)
        assert_trees_equal(dict(fresh.state_dict()), got)


def test_weights_of_a_state_whose_tied_buffers_hold_two_values_are_refused(tmp_path):
    """A state trained with the buffers apart, written for a model that ties them: one entry would keep one value and
    lose the other (0.55 of trained statistics here), where the export used to refuse the model."""

    class Block(nn.Module):
        def __init__(self, stat):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("stat", stat)

        def forward(self, x):
            with torch.no_grad():
                self.stat.mul_(0.5).add_(x.detach().mean(0))
            return torch.tanh(self.fc(x) + self.stat)

    class Net(nn.Module):
        def __init__(self, tie):
            super().__init__()
            torch.manual_seed(0)
            shared = torch.zeros(4)
            self.blocks = nn.ModuleList([Block(shared), Block(shared if tie else torch.zeros(4))])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    apart = Net(tie=False)
    step = fzero.compile(lambda p, b: _loss(fzero.apply(apart, p, b)), optimizer=fzero.optim.sgd(0.1), stages=0)
    state, _ = step(step.init(fzero.params_of(apart)), torch.randn(8, 4))
    assert not state.buffers["blocks.0.stat"].equal(state.buffers["blocks.1.stat"])
    fzero.checkpoint.save(tmp_path / "ckpt", state)
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"save_weights: the state holds separate values for "
                                                               r"\['blocks.0.stat', 'blocks.1.stat'\].*one tied buffer in Net"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "w", model=Net(tie=True))
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"consolidate: the state holds separate values"):
        fzero.checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "c", model=Net(tie=True), format="safetensors")


class _RootReadsUnitStats(nn.Module):
    """The root reads a unit's BatchNorm statistics outside the unit's call (to undo the normalization)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        bn = self.blocks[1][1]
        return self.head(x * (bn.running_var + bn.eps).sqrt() + bn.running_mean)


@pytest.mark.parametrize("stages", [0, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_units_buffer_read_outside_its_call_is_the_states(stages, ranks):
    # stage 3 bound a unit's buffers for the unit's call alone: the root read the module's own statistics, which no step
    # writes (the training losses 1.82 where PyTorch's are 1.92, step.evaluate 2.045 where PyTorch's eval gives 2.209)
    torch.manual_seed(0)
    model = _RootReadsUnitStats()
    batches = [{"x": torch.randn(8, 8) * 3 + 2, "y": torch.randint(0, 3, (8,))} for _ in range(3)]
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = fzero.compile(lambda p, b: nn.functional.cross_entropy(fzero.apply(model, p, b["x"]), b["y"]), stages=stages,
                         mesh=fzero.local_mesh(ranks), optimizer=fzero.optim.sgd(0.1))
    state = step.init(fzero.params_of(model))
    for batch in batches[:2]:
        state, metrics = step(state, batch)
        if ranks == 1:
            loss = nn.functional.cross_entropy(ref(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-6)
    model.eval()
    got = step.evaluate(state, batches[2])["loss"]
    ref = copy.deepcopy(model)
    ref.load_state_dict(step.state_dict(state, model))
    with torch.no_grad():
        halves = [{k: v.chunk(ranks)[r] for k, v in batches[2].items()} for r in range(ranks)]
        want = sum(nn.functional.cross_entropy(ref(h["x"]), h["y"]).item() for h in halves) / ranks
    assert got == pytest.approx(want, rel=1e-6)


class _Counted(nn.Module):
    """A block whose forward replaces its buffer (``self.n = self.n + 1``) rather than writing it in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n = self.n + 1
        return torch.tanh(self.fc(x)) * (1 + 0.1 * self.n)


def _ddp_step(replicas: list[nn.Module], opt: torch.optim.Optimizer, batch: torch.Tensor, *, every_buffer: bool = False) -> float:
    """One step of DDP's semantics over ``replicas`` (``replicas[0]`` is the one ``opt`` steps): each replica starts from
    rank 0's params and buffers (the state_dict's; ``every_buffer``: the non-persistent ones too, as DDP broadcasts
    ``named_buffers()``), runs its share of ``batch``, and the averaged gradient takes one step. Returns the mean loss."""
    ref = replicas[0]
    for rep in replicas[1:]:
        rep.load_state_dict(ref.state_dict())
        if every_buffer:
            with torch.no_grad():
                for buf, buf0 in zip(rep.buffers(), ref.buffers()):
                    buf.copy_(buf0)
    losses, grads = [], []
    for rep, half in zip(replicas, batch.chunk(len(replicas))):
        rep.zero_grad()
        loss = _loss(rep(half))
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad for p in rep.parameters()])
    for p, gs in zip(ref.parameters(), zip(*grads)):
        p.grad = sum(gs) / len(replicas)
    opt.step()
    return sum(losses) / len(replicas)


class _ChainNet(nn.Module):
    """``block()`` once in the root unit, twice as the units of stages 2-3, then a head."""

    def __init__(self, block: type[nn.Module]):
        super().__init__()
        torch.manual_seed(0)
        self.first = block()  # in the root unit
        self.blocks = nn.ModuleList([block() for _ in range(2)])  # units at stages 2-3
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("settings", [{"stages": 0}, {"stages": 0, "autodiff": "func"}, {"stages": 2}, {"stages": 3},
                                      {"stages": 3, "remat": True}, {"stages": 3, "autodiff": "func"},
                                      {"stages": 0, "remat": True}, {"stages": 1, "remat": True}],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_a_buffer_the_forward_replaces_is_kept_as_pytorch_keeps_it(settings, ranks):
    """``self.n = self.n + 1`` puts a new tensor in the buffer's slot, which torch's module keeps; the step kept the
    value it had handed out, and the next step started from it: the counters stayed 0 where PyTorch's are 3, the losses
    up to 0.02 off, silently, at every stage and under torchrun. Against DDP's semantics: each rank's replica starts
    the step from rank 0's buffers."""
    model = _ChainNet(_Counted)
    ref = copy.deepcopy(model)
    replicas = [ref] + [copy.deepcopy(ref) for _ in range(ranks - 1)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 4, generator=gen) for _ in range(3)]
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1),
                         mesh=fzero.local_mesh(ranks), **settings)
    state = step.init(fzero.params_of(model), buffers=fzero.buffers_of(model))
    for b in batches:
        state, metrics = step(state, b)
        assert float(metrics["loss"]) == pytest.approx(_ddp_step(replicas, opt, b), rel=1e-5)
    got = step.state_dict(state, model)
    assert [float(got[k]) for k in ("first.n", "blocks.0.n", "blocks.1.n")] == [3.0, 3.0, 3.0]
    assert_trees_close({k: v for k, v in got.items()}, dict(ref.state_dict()), rtol=1e-5, atol=1e-6)


class _LazyStat(torch.nn.Module):
    """A persistent buffer registered as None and set by the first forward (a lazily created running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("stat", None)

    def forward(self, x):
        m = x.detach().mean(0)
        self.stat = m.clone() if self.stat is None else 0.5 * self.stat + 0.5 * m
        return self.lin(x) + self.stat


class _LazyBlocks(torch.nn.Module):
    """Two of them as the blocks of a ModuleList: stage 2-3 units, whose calls run inside the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_LazyStat(), _LazyStat()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("stages,ranks,blocks,remat", [(0, 1, False, False), (1, 2, False, False), (3, 2, False, False),
                                                       (2, 2, True, False), (3, 2, True, True),
                                                       (0, 1, True, True), (1, 2, True, True)])
def test_a_buffer_the_forward_creates_from_none_is_refused_by_name(stages, ranks, blocks, remat):
    """It was not in the state: every step started from None again and step.state_dict and checkpoints left it out,
    where PyTorch keeps it (params 2e-2 off after 4 AdamW steps at lr 1e-2, silently)."""
    torch.manual_seed(0)
    model = _LazyBlocks() if blocks else _LazyStat()
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), stages=stages,
                         mesh=fzero.local_mesh(ranks) if ranks > 1 else None, remat=remat)
    state = step.init(fzero.params_of(model))
    name = "blocks.0.stat" if blocks else "stat"
    with pytest.raises(ValueError, match=rf"persistent buffer '{name}', which was registered as None.*register_buffer\('stat'"):
        step(state, torch.randn(4, 8))
    assert all(m.stat is None for m in model.modules() if isinstance(m, _LazyStat))


class _RunningMean(nn.Module):
    """A block keeping a running mean of its input in a non-persistent buffer (out of the state_dict), written in place
    by its forward and subtracted from the input: the step's bank does not hold it, the module does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("avg", torch.zeros(4), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            self.avg.mul_(0.5).add_(0.5 * x.mean(0))
        return torch.tanh(self.fc(x - self.avg))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("settings", [{"stages": 0}, {"stages": 1}, {"stages": 2}, {"stages": 3}, {"stages": 0, "remat": True},
                                      {"stages": 2, "remat": True}, {"stages": 3, "remat": True}],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_a_non_persistent_buffer_the_forward_writes_trains_as_pytorch(settings, ranks):
    """The forward's in-place write of a non-persistent buffer, against DDP's semantics (each replica starts a step
    from rank 0's buffers, the non-persistent ones too: DDP broadcasts ``named_buffers()``). Before: on local_mesh(2)
    every rank thread wrote the module's one tensor (twice a step, each rank reading the other's write: 3.7e-3 off
    after one AdamW step in a zoo-sized model), and under remat at stages 2-3 the recompute read the value the forward
    had written and wrote it again (3.6e-3 off on one rank), silently. The user's module ends holding rank 0's value, as in PyTorch."""
    model = _ChainNet(_RunningMean)
    ref = copy.deepcopy(model)
    replicas = [ref] + [copy.deepcopy(ref) for _ in range(ranks - 1)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 4, generator=gen) + 1 for _ in range(3)]
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1),
                         mesh=fzero.local_mesh(ranks), **settings)
    state = step.init(fzero.params_of(model))
    for b in batches:
        state, metrics = step(state, b)
        assert float(metrics["loss"]) == pytest.approx(_ddp_step(replicas, opt, b, every_buffer=True), rel=1e-6)
    assert_trees_close(step.gather(state), dict(ref.named_parameters()), rtol=1e-6, atol=1e-7)
    assert_trees_close(dict(model.named_buffers()), dict(ref.named_buffers()), rtol=1e-6, atol=1e-7)


class _AliasedCache(nn.Module):
    """A non-persistent buffer that views another (``head = cache[:4]``): the forward writes ``cache`` in place and reads
    ``head``, which holds the write, as one tensor's memory."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(8), persistent=False)
        self.register_buffer("head", self.cache[:4], persistent=False)

    def forward(self, x):
        with torch.no_grad():
            self.cache.mul_(0.5).add_(torch.cat([x.mean(0), x.std(0)]))
        return torch.tanh(self.fc(x - self.head))


class _AliasedCacheNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_AliasedCache() for _ in range(2)])
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@pytest.mark.parametrize("stages", [0, 3])
def test_a_non_persistent_buffer_that_views_another_stays_its_view_on_each_rank(stages):
    """Each rank's own copies of the non-persistent buffers alias as the module's do. Before: ``cache`` and its view
    ``head`` were cloned apart on local_mesh(2), so ``head`` never saw the forward's write into ``cache`` (4e-2 off DDP
    after 3 SGD steps), silently. Against DDP's semantics, as above."""
    ranks = 2
    model, ref = _AliasedCacheNet(), _AliasedCacheNet()
    replicas = [ref] + [_AliasedCacheNet() for _ in range(ranks - 1)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    step = fzero.compile(lambda p, b: _loss(fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1),
                         mesh=fzero.local_mesh(ranks), stages=stages)
    state = step.init(fzero.params_of(model))
    for _ in range(3):
        b = torch.randn(8, 4, generator=gen) + 1
        state, _ = step(state, b)
        for rep in replicas[1:]:  # DDP: every replica starts the step from rank 0's params and buffers
            with torch.no_grad():
                for p, p0 in zip(rep.parameters(), ref.parameters()):
                    p.copy_(p0)
                for block, block0 in zip(rep.blocks, ref.blocks):
                    block.cache.copy_(block0.cache)
        for rep, share in zip(replicas, b.chunk(ranks)):
            rep.zero_grad()
            (_loss(rep(share)) / ranks).backward()
        for p, *others in zip(ref.parameters(), *[rep.parameters() for rep in replicas[1:]]):
            p.grad = p.grad + sum(q.grad for q in others)
        opt.step()
    assert_trees_close(step.gather(state), dict(ref.named_parameters()), rtol=1e-6, atol=1e-7)
    for block, block0 in zip(model.blocks, ref.blocks):
        torch.testing.assert_close(block.cache, block0.cache, rtol=1e-6, atol=1e-7)
        assert block.head.data_ptr() == block.cache.data_ptr()  # still its view
