"""Bad input gets an error that names the API, the offending value and the fix."""

import pytest
import torch

import fzero
from problems import mlp_problem


@pytest.fixture
def prob():
    return mlp_problem(steps=1)


@pytest.mark.parametrize("stages", [-1, 4, 1.5, "2", True])
def test_stages_outside_range(prob, stages):
    with pytest.raises(ValueError, match=r"fzero.compile: stages must be 0, 1, 2 or 3.*got"):
        fzero.compile(prob.loss_fn, stages=stages)


def test_shard_params_needs_shard_grads(prob):
    with pytest.raises(ValueError, match=r"fzero.shard_params: needs fzero.shard_grads inside it.*stage 0"):
        fzero.shard_params(fzero.train_step(prob.loss_fn, fzero.optim.sgd(0.1)))


def test_unit_settings_at_other_stages(prob):
    with pytest.raises(ValueError, match=r"fzero.compile: units only apply at stages=2 or 3.*stages=1"):
        fzero.compile(prob.loss_fn, stages=1, units=("layers.0",))
    with pytest.raises(ValueError, match=r"fzero.compile: prefetch only applies at stages=3.*stages=2"):
        fzero.compile(prob.loss_fn, stages=2, prefetch=False)


def test_unknown_setting_names_the_closest(prob):
    with pytest.raises(TypeError, match=r"unknown setting 'unit_element'.*Did you mean 'unit_elements'"):
        fzero.compile(prob.loss_fn, unit_element=10)


def test_batch_that_does_not_divide_by_the_mesh(prob):
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=1, mesh=fzero.local_mesh(4))
    state = step.init(fzero.params_of(prob.model))
    bad = {"x": torch.randn(6, 16), "y": torch.randn(6, 4)}
    with pytest.raises(ValueError, match=r"local_mesh\(4\).*batch leaf 'x' has dim 0 of size 6, which does not divide by 4"):
        step(state, bad)
    # the failed call did not consume the state
    step(state, {"x": torch.randn(8, 16), "y": torch.randn(8, 4)})


def test_loss_fn_returning_a_non_scalar(prob):
    def loss_fn(params, b):
        return (fzero.apply(prob.model, params, b["x"]) - b["y"]) ** 2

    step = fzero.train_step(loss_fn, fzero.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"loss_fn must return a 0-d floating-point loss; got .* shape \(8, 4\).*\.mean\(\)"):
        step(step.init(fzero.params_of(prob.model)), prob.batches[0])


def test_loss_fn_returning_a_non_tensor(prob):
    step = fzero.train_step(lambda p, b: 3.0, fzero.optim.sgd(0.1))
    with pytest.raises(TypeError, match=r"loss_fn must return a scalar tensor or a \(loss, aux\) pair; got float"):
        step(step.init(fzero.params_of(prob.model)), prob.batches[0])


@pytest.mark.parametrize(
    "params, match",
    [
        ({"w": [1.0, 2.0]}, r"leaf at 'w.0' is a float"),
        ({"w": torch.ones(3, dtype=torch.int64)}, r"parameter 'w' has dtype torch.int64"),
        ({}, r"params has no tensors"),
        ("weights", r"the leaf at '<root>' is a str"),
    ],
)
def test_params_that_are_not_a_pytree_of_float_tensors(prob, params, match):
    step = fzero.train_step(prob.loss_fn, fzero.optim.sgd(0.1))
    with pytest.raises((TypeError, ValueError), match=r"fzero.Step.init: .*" + match):
        step.init(params)


def test_dist_mesh_without_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"fzero.dist_mesh: no torchrun environment .*torchrun --nproc_per_node N.*fzero.local_mesh"):
        fzero.dist_mesh()


def test_state_from_another_step(prob):
    params = fzero.params_of(prob.model)
    s1 = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=1, mesh=fzero.local_mesh(2))
    s2 = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=2, mesh=fzero.local_mesh(2))
    s4 = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=2, mesh=fzero.local_mesh(4))
    solo = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=1)
    with pytest.raises(ValueError, match=r"state was made for stage 1 \(ZeRO-1\) on 2 rank\(s\), but this step is stage 2 \(ZeRO-2\).*gather"):
        s2(s1.init(params), prob.batches[0])
    with pytest.raises(ValueError, match=r"state holds 2 ranks but the step's local_mesh has 4"):
        s4(s2.init(params), prob.batches[0])
    with pytest.raises(TypeError, match=r"expected a TrainState .* got RankStates"):
        solo(s1.init(params), prob.batches[0])
    with pytest.raises(TypeError, match=r"expected a RankStates of 2 ranks.*got dict"):
        s1(params, prob.batches[0])


def test_donated_state_cannot_be_reused(prob):
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=1, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    new_state, _ = step(state, prob.batches[0])
    with pytest.raises(ValueError, match=r"already passed to a step.*donate=False"):
        step(state, prob.batches[0])
    with pytest.raises(ValueError, match=r"fzero.Step.gather: this state was already passed"):
        step.gather(state)
    keep = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=1, mesh=fzero.local_mesh(2), donate=False)
    s0 = keep.init(fzero.params_of(prob.model))
    a, _ = keep(s0, prob.batches[0])
    b, _ = keep(s0, prob.batches[0])
    torch.testing.assert_close(keep.gather(a), keep.gather(b), rtol=0, atol=0)


def test_optimizer_must_be_a_gradient_transformation(prob):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"fzero.train_step: optimizer must be an \(init, update\) GradientTransformation.*got AdamW"):
        fzero.train_step(prob.loss_fn, torch.optim.AdamW(model.parameters()))


def test_shard_grads_needs_shard_optimizer(prob):
    with pytest.raises(ValueError, match=r"fzero.shard_grads: needs fzero.shard_optimizer inside it"):
        fzero.shard_grads(fzero.train_step(prob.loss_fn, fzero.optim.sgd(0.1)))


def test_local_mesh_arguments():
    with pytest.raises(ValueError, match=r"fzero.local_mesh: n must be an int >= 1.*got 0"):
        fzero.local_mesh(0)


def test_a_failing_rank_raises_instead_of_hanging(prob):
    calls = []

    def loss_fn(params, b):
        calls.append(1)
        if b["x"][0, 0] > 100:  # only the rank that holds the poisoned sample fails
            raise RuntimeError("boom on one rank")
        return prob.loss_fn(params, b)

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=2, mesh=fzero.local_mesh(2, timeout=30))
    state = step.init(fzero.params_of(prob.model))
    x = torch.randn(8, 16)
    x[4, 0] = 1000.0
    with pytest.raises(RuntimeError, match="boom on one rank") as info:
        step(state, {"x": x, "y": torch.randn(8, 4)})
    assert "raised on rank 1" in str(info.value.__notes__)



@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_a_failing_rank_leaves_no_reference_cycle_behind(prob, autodiff):
    """The error a rank raised held, through its traceback, that rank's frames, whose closure held the mesh's list of
    errors, which held the error: a cycle only the garbage collector frees. One left to the interpreter's exit, with
    torch.func's wrapped tensors among the frames' locals, aborted the process there ("terminate called without an
    active exception", exit status 134, after a stage-3 step under autodiff="func" raised in backward on local_mesh(2))."""
    import gc
    import weakref

    alive = []

    def loss_fn(params, b):
        marker = torch.zeros(1)  # a local of the rank's frame
        alive.append(weakref.ref(marker))
        prob.loss_fn(params, b)
        raise RuntimeError("boom on every rank")

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, mesh=fzero.local_mesh(2, timeout=30),
                         autodiff=autodiff)
    state = step.init(fzero.params_of(prob.model))
    gc.disable()  # what refcounts alone free
    try:
        with pytest.raises(RuntimeError, match="boom on every rank"):
            step(state, {"x": torch.randn(8, 16), "y": torch.randn(8, 4)})
        assert len(alive) == 2 and [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()

@pytest.mark.parametrize("stages, autodiff", [(0, "autograd"), (1, "func"), (2, "autograd"), (3, "autograd"), (3, "func")])
def test_a_loss_fn_that_calls_backward_itself_is_named_and_the_state_trains_on(stages, autodiff):
    """``loss.backward()`` at the end of ``loss_fn``, as a plain PyTorch training step ends: torch's "Trying to backward
    through the graph a second time" (plain autograd), or, under torch.func, fzero's hint about torch.utils.checkpoint,
    which is not the cause. Both now say what loss_fn did and the fix; the state given is untouched."""
    model = torch.nn.Linear(4, 1)
    x = torch.randn(4, 4)

    def calls_backward(p, x):
        loss = fzero.apply(model, p, x).pow(2).mean()
        loss.backward()
        return loss

    settings = dict(optimizer=fzero.optim.sgd(0.1), stages=stages, autodiff=autodiff)
    bad = fzero.compile(calls_backward, **settings)
    good = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), **settings)
    state = good.init(fzero.params_of(model))
    with pytest.raises(RuntimeError, match=r"(?s)ran a backward over the loss already.*without\s+calling backward\(\)"):
        bad(state, x)
    state, _ = good(state, x)
    expected, _ = good(good.init(fzero.params_of(model)), x)
    for name, value in good.gather(expected).items():
        assert torch.equal(good.gather(state)[name], value)
