"""Step.evaluate: the loss without a gradient or an update, at every stage, from the sharded state."""

import copy
import dataclasses

import pytest
import torch

import fzero
from fzero.memory import GatheredBytes
from fzero.models import GPT, GPTConfig, gpt_loss
from fzero.testing import assert_trees_equal
from problems import PROBLEMS


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_evaluate_gives_the_loss_the_next_step_reports_and_leaves_the_state(stages, ranks):
    prob = PROBLEMS["gpt"]()
    step = fzero.compile(prob.loss_fn, stages=stages, mesh=fzero.local_mesh(ranks))
    state, _ = step(step.init(fzero.params_of(prob.model)), prob.batches[0])
    before = step.gather(state)
    order = state[0].meta.gather_order
    got = step.evaluate(state, prob.batches[1])
    assert_trees_equal(step.gather(state), before)  # not donated, not changed
    assert state[0].meta.gather_order == order
    _, metrics = step(state, prob.batches[1])  # the state is still usable
    assert got["loss"] == metrics["loss"]
    assert got["loss"] == pytest.approx(float(prob.loss_fn(before, prob.batches[1])), rel=1e-6)


def test_evaluate_in_bf16_at_stage3_equals_the_step_loss():
    prob = PROBLEMS["gpt"]()
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(2), precision="bf16")
    state = step.init(fzero.params_of(prob.model))
    got = step.evaluate(state, prob.batches[0])
    _, metrics = step(state, prob.batches[0])
    assert got["loss"] == metrics["loss"]


def test_evaluate_at_stage3_gathers_one_unit_at_a_time():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=6))
    batch = {"x": torch.randint(0, 256, (4, 16)), "y": torch.randint(0, 256, (4, 16))}
    counters = {}
    mesh = dataclasses.replace(fzero.local_mesh(2), rank_context=lambda r: counters.setdefault(r, GatheredBytes()))
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=3, mesh=mesh)
    state, _ = step(step.init(fzero.params_of(model)), batch)
    counters.clear()
    step.evaluate(state, batch)
    layout = state[0].meta.layout
    units = sorted((u.padded * 4 for u in layout.units if u.name != "<root>"), reverse=True)
    root = sum(u.padded * 4 for u in layout.units if u.name == "<root>")
    full = sum(u.padded * 4 for u in layout.units)
    peak = counters[0].peak
    assert 0 < peak <= root + units[0] + units[1] < full  # the root, the running unit and the prefetched one
    assert counters[0].live == 0  # everything gathered was dropped


def test_evaluate_checks_its_state():
    prob = PROBLEMS["gpt"]()
    step = fzero.compile(prob.loss_fn, stages=3, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    step(state, prob.batches[0])
    with pytest.raises(ValueError, match=r"fzero.Step.evaluate: this state was already passed to a step"):
        step.evaluate(state, prob.batches[0])
    other = fzero.compile(prob.loss_fn, stages=2, mesh=fzero.local_mesh(2))
    with pytest.raises(ValueError, match=r"fzero.Step.evaluate: state was made for stage 3"):
        other.evaluate(step.init(fzero.params_of(prob.model)), prob.batches[0])


class _Blocks(torch.nn.Module):
    """A root Linear, two units, a head; ``blocks[i]`` may return a dataclass holding its own param."""

    def __init__(self, dataclass_out: bool = False):
        super().__init__()
        self.emb = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList([_Block(dataclass_out) for _ in range(2)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        x = self.emb(x)
        scales = []
        for b in self.blocks:
            out = b(x)
            x, scale = (out.h, out.scale) if isinstance(out, _Out) else (out, None)
            scales.append(scale)
        return self.head(x), scales


@dataclasses.dataclass
class _Out:
    h: torch.Tensor
    scale: torch.Tensor


class _Block(torch.nn.Module):
    def __init__(self, dataclass_out: bool):
        super().__init__()
        self.lin, self.scale, self.dataclass_out = torch.nn.Linear(8, 8), torch.nn.Parameter(torch.randn(8)), dataclass_out

    def forward(self, x):
        h = torch.tanh(self.lin(x)) * self.scale
        return _Out(h, self.scale) if self.dataclass_out else h


@pytest.mark.parametrize("stages", [2, 3])
def test_a_forward_without_grad_before_one_with_it_leaves_the_gradient_whole(stages):
    """A loss_fn that runs the model under torch.no_grad() first (a teacher pass, model.generate) and with its graph
    after: the unit views made without a graph were reused, so stage 2's gradient was all zero and stage 3's lacked the
    root unit's (grad_norm 1.39 where torch's is 2.26). Equal to plain PyTorch now."""
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(4, 8)

    def body(run, b):
        with torch.no_grad():
            target = run(b)[0] + 1.0
        return torch.nn.functional.mse_loss(run(b)[0], target * 0.5)

    ref = copy.deepcopy(model)
    body(ref, x).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    step = fzero.compile(lambda p, b: body(lambda x: fzero.apply(model, p, x), b), optimizer=fzero.optim.sgd(0.1),
                         stages=stages, mesh=fzero.local_mesh(1))
    state, _ = step(step.init(fzero.params_of(model)), x)
    got = step.gather(state)
    for name, want in ref.named_parameters():
        torch.testing.assert_close(got[name], want.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_stage3_evaluate_copies_a_param_a_unit_returns_in_a_dataclass():
    """A unit returning a dataclass holding its own param: the tensor handed back pointed at the unit's freed
    gathered buffer (0 bytes; reading it crashed the process). It is a copy now, equal to the param."""
    torch.manual_seed(0)
    model = _Blocks(dataclass_out=True).eval()
    grabbed = {}

    def keep(p, b):
        y, scales = fzero.apply(model, p, b)
        grabbed["scales"] = scales
        return y.mean()

    step = fzero.compile(keep, optimizer=fzero.optim.sgd(0.1), stages=3, mesh=fzero.local_mesh(1))
    step.evaluate(step.init(fzero.params_of(model)), torch.randn(4, 8))
    for i, scale in enumerate(grabbed["scales"]):
        assert scale.untyped_storage().nbytes() > 0 and torch.equal(scale, model.blocks[i].scale.detach())


def test_inference_mode_inside_loss_fn_at_stage_3_on_two_ranks():
    """torch.inference_mode() around fzero.apply inside loss_fn, after a step (prefetch follows the recorded order):
    the prefetched gather wrote into an inference tensor outside inference mode (torch's raw "Inplace update to
    inference tensor outside InferenceMode"). It runs as under no_grad now, with PyTorch's loss."""
    torch.manual_seed(0)
    model, x, y = _Blocks(), torch.randn(4, 8), torch.randn(4, 1)
    evaluating = []

    def loss_fn(p, b):
        if evaluating:
            with torch.inference_mode():
                out = fzero.apply(model, p, b[0])[0]
            return torch.nn.functional.mse_loss(out, b[1])
        return torch.nn.functional.mse_loss(fzero.apply(model, p, b[0])[0], b[1])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=3, mesh=fzero.local_mesh(2))
    state, _ = step(step.init(fzero.params_of(model)), (x, y))
    evaluating.append(True)
    got = step.evaluate(state, (x, y))["loss"]
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(step.state_dict(state, model))
    with torch.no_grad():
        want = float(torch.nn.functional.mse_loss(fresh(x)[0], y))
    assert got == pytest.approx(want, rel=1e-6)
    evaluating.clear()
    state, _ = step(state, (x, y))  # and training goes on


def test_stage3_evaluate_names_a_method_reading_params_outside_their_unit():
    """A method fzero.apply runs that reads a unit's params outside that unit's call (an L2 term over
    self.parameters() in a validation_step) gets their meta stand-ins at stage 3; the meta loss failed in torch's
    ".item() cannot be called on meta tensors". Named now, with the fixes."""

    class WithL2(_Blocks):
        def validation_step(self, b):
            return self(b)[0].square().mean() + 1e-2 * sum(p.pow(2).sum() for p in self.parameters())

    torch.manual_seed(0)
    model = WithL2()
    step = fzero.compile(lambda p, b: fzero.apply(model.validation_step, p, b), optimizer=fzero.optim.sgd(0.1),
                         stages=3, mesh=fzero.local_mesh(1))
    with pytest.raises(ValueError, match=r"(?s)fzero.Step.evaluate: loss_fn returned a meta tensor.*self.parameters\(\) for an L2 term"):
        step.evaluate(step.init(fzero.params_of(model)), torch.randn(4, 8))


def test_evaluate_names_itself_in_the_errors_of_its_batch():
    """The split of evaluate's batch on a local mesh refused with the step's name (fzero.Step.__call__), which the
    caller never called."""
    model = torch.nn.Linear(4, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b["x"]).sum() + b["y"].sum(), stages=0, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    with pytest.raises(ValueError, match=r"^fzero\.Step\.evaluate: under local_mesh\(2\) .* 'x' has dim 0 of size 5, which "
                                         r"does not divide by 2"):
        step.evaluate(state, {"x": torch.randn(5, 4), "y": torch.randn(5)})
    with pytest.raises(ValueError, match=r"^fzero\.Step\.evaluate: .* row counts differ: 'x' has 4, 'y' has 6"):
        step.evaluate(state, {"x": torch.randn(4, 4), "y": torch.randn(6)})


class _Detector(torch.nn.Module):
    """A detector's eval forward: one dict of detections per image, for images of their own sizes."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 1)

    def forward(self, images):
        return [{"scores": self.conv(img).mean((1, 2)), "image": img[0, 0, 0].long()} for img in images]


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_evaluate_gives_every_ranks_aux_in_the_batchs_row_order(stages, ranks):
    """On local_mesh(2) each rank evaluates its half of a detection batch, and metrics["aux"] was rank 0's only: the
    detections of images 0-1 of 4, the other half lost. "aux_per_rank" holds every rank's, in the batch's row order,
    each the module's own output on those images; "aux" stays rank 0's."""
    torch.manual_seed(0)
    model = _Detector()

    def loss_fn(params, batch):
        images, _ = batch
        detections = fzero.apply(model, params, images)
        return torch.stack([d["scores"].sum() for d in detections]).mean(), detections

    images = [torch.full((3, 4 + i, 5), float(i)) for i in range(4)]
    targets = [{"boxes": torch.rand(n, 4), "labels": torch.zeros(n, dtype=torch.long)} for n in (1, 2, 0, 3)]
    step = fzero.compile(loss_fn, stages=stages, mesh=fzero.local_mesh(ranks))
    metrics = step.evaluate(step.init(fzero.params_of(model)), (images, targets))
    assert [len(aux) for aux in metrics["aux_per_rank"]] == [4 // ranks] * ranks
    every = [d for aux in metrics["aux_per_rank"] for d in aux]
    assert [int(d["image"]) for d in every] == [0, 1, 2, 3]
    with torch.no_grad():
        want = model(images)
    for got, ref in zip(every, want):
        torch.testing.assert_close(got["scores"], ref["scores"])
    assert [int(d["image"]) for d in metrics["aux"]] == list(range(4 // ranks))  # rank 0's, as before


def test_evaluate_without_aux_has_no_aux_per_rank():
    model = torch.nn.Linear(2, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), stages=0, mesh=fzero.local_mesh(2))
    assert set(step.evaluate(step.init(fzero.params_of(model)), torch.randn(4, 2))) == {"loss"}


def test_evaluate_names_itself_when_loss_fn_returns_no_scalar_loss():
    """A per-row loss or a count from loss_fn in evaluate was refused as ``fzero.train_step``'s, which the caller never
    called, with "an integer loss has no gradient", which evaluate needs none of."""
    model = torch.nn.Linear(4, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).squeeze(-1), optimizer=fzero.optim.sgd(0.1))
    state = step.init(fzero.params_of(model))
    with pytest.raises(ValueError, match=r"^fzero.Step.evaluate: loss_fn must return a 0-d floating-point loss; got a "
                                         r"torch.float32 tensor of shape \(3,\)"):
        step.evaluate(state, torch.randn(3, 4))
    counts = fzero.compile(lambda p, b: (fzero.apply(model, p, b) > 0).sum(), optimizer=fzero.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"^fzero.Step.evaluate: .*torch.int64.*averaged\), e.g. loss.float\(\)"):
        counts.evaluate(counts.init(fzero.params_of(model)), torch.randn(3, 4))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 3])
def test_apply_outside_a_step_with_the_gathered_params_alone_names_the_trained_batchnorm_statistics(stages, ranks):
    """``model.eval()`` and ``fzero.apply(model, step.gather(state), x)`` (the EMA recipe's evaluation) ran on the
    BatchNorm statistics the module held before training, which no step writes: 7.4e-2 off PyTorch's eval output after
    3 steps, silently. It is refused by name; with the state's buffers (``step.state_dict``) it is PyTorch's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), optimizer=fzero.optim.adamw(1e-2),
                         stages=stages, mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    for _ in range(2):
        state, _ = step(state, torch.randn(8, 4) * 3 + 1)
    x = torch.randn(5, 4)
    model.eval()
    with torch.no_grad(), pytest.raises(ValueError, match=r"'1.running_mean'.*step.state_dict\(state, model\)"):
        fzero.apply(model, step.gather(state), x)
    reference.load_state_dict(step.state_dict(state, model))
    reference.eval()
    with torch.no_grad():
        want = reference(x)
        assert torch.equal(fzero.apply(model, step.state_dict(state, model), x), want)
        own = fzero.apply(model, {**step.gather(state), **fzero.buffers_of(model)}, x)  # the module's, on purpose
        assert not torch.allclose(own, want)
        model.load_state_dict(step.state_dict(state, model))  # the state's buffers in the module: read as they are
        assert torch.equal(fzero.apply(model, step.gather(state), x), want)
