"""Step.evaluate: the loss without a gradient or an update, at every stage, from the sharded state."""

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
