"""Progressive layer drop (fzero.models.ProgressiveLayerDrop): the paper's schedule, the draw over depth, and a
GPT trained with it as plain PyTorch trains it, with stage 3 gathering and reducing only the blocks that run."""

import math

import pytest
import torch

import fzero
from fzero.models import ProgressiveLayerDrop, gpt_loss
from fzero.testing import assert_trees_equal
from problems import B1, B2, EPS, LR, WD, gpt_problem


@pytest.mark.parametrize("theta", [0.1, 0.5, 0.9, 1.0])
def test_the_keep_ratio_is_the_papers_schedule(theta):
    pld = ProgressiveLayerDrop(theta=theta, gamma=0.001)
    for t in [0, 1, 2, 10, 1000, 10**6]:
        assert pld.theta_at(t) == pytest.approx((1.0 - theta) * math.exp(-0.001 * t) + theta, rel=1e-15)
    assert pld.theta_at(0) == 1.0  # nothing is dropped at the first step
    probs = pld.keep_probabilities(10**6, 4)  # at the end: 1 - l/L * (1 - theta) for l = 1..4
    assert probs == pytest.approx([1 - (l + 1) / 4 * (1 - theta) for l in range(4)])


def test_each_layer_is_drawn_with_its_probability_and_the_same_draw_every_time():
    pld = ProgressiveLayerDrop(theta=0.5, gamma=1.0, seed=3)  # theta(t) = 0.5 from the first few steps on
    draws = [pld.layers(t, 4) for t in range(2000)]
    assert draws[:50] == [pld.layers(t, 4) for t in range(50)]  # a pure function of (seed, step): ranks agree
    other = ProgressiveLayerDrop(theta=0.5, gamma=1.0, seed=4)
    assert [other.layers(t, 4) for t in range(100, 120)] != draws[100:120]  # the seed decides the draw
    kept = [sum(d[l][0] for d in draws[100:]) / 1900 for l in range(4)]
    assert kept == pytest.approx([0.875, 0.75, 0.625, 0.5], abs=0.04)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"ProgressiveLayerDrop: theta=0; it is the keep ratio"):
        ProgressiveLayerDrop(theta=0)
    with pytest.raises(ValueError, match=r"progressive_layer_drop\.gamma must be a number >= 0, got -1"):
        fzero.config.from_deepspeed({"progressive_layer_drop": {"enabled": True, "gamma": -1}})
    with pytest.raises(ValueError, match=r"unknown key 'progressive_layer_drop\.thetta'"):
        fzero.config.from_deepspeed({"progressive_layer_drop": {"enabled": True, "thetta": 0.5}})
    settings = fzero.config.from_deepspeed({"progressive_layer_drop": {"enabled": True, "theta": 0.4, "gamma": 0.01}})
    assert settings.progressive_layer_drop == ProgressiveLayerDrop(theta=0.4, gamma=0.01)
    assert fzero.config.from_deepspeed({"progressive_layer_drop": {"enabled": False}}).progressive_layer_drop is None


def test_an_infinite_gamma_is_refused_not_a_nan_keep_probability():
    """gamma=inf passed the check (>= 0): theta_at(0) is (1 - theta) * exp(-inf * 0) + theta = NaN, so every keep
    probability was NaN and every layer was dropped at step 0, silently."""
    with pytest.raises(ValueError, match=r"ProgressiveLayerDrop: gamma=inf; it must be a finite number >= 0"):
        ProgressiveLayerDrop(gamma=float("inf"))


def _problem(pld):
    prob = gpt_problem(steps=5)
    n = prob.model.cfg.n_layer
    box = {"k": 0}  # the loop sets the step the draw is for

    def loss_fn(params, b):
        return gpt_loss(fzero.apply(prob.model, params, b["x"], pld.layers(box["k"], n)), b["y"])

    return prob, loss_fn, box


def test_a_gpt_with_layer_drop_trains_as_plain_pytorch_and_stage_3_runs_only_the_kept_blocks():
    pld = ProgressiveLayerDrop(theta=0.3, gamma=1.0, seed=1)
    prob, loss_fn, box = _problem(pld)
    n = prob.model.cfg.n_layer
    dropped = [[i for i, (keep, _) in enumerate(pld.layers(k, n)) if not keep] for k in range(len(prob.batches))]
    assert any(dropped) and not all(dropped)  # this seed drops some blocks in some steps

    params = {k: v.clone().requires_grad_() for k, v in fzero.params_of(prob.model).items()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    expected = []
    for k, b in enumerate(prob.batches):  # plain PyTorch: a dropped block's params get no gradient, no update
        box["k"] = k
        opt.zero_grad(set_to_none=True)
        loss_fn(params, b).backward()
        opt.step()
        expected.append({name: v.detach().clone() for name, v in params.items()})

    runs = {}
    for stages, prefetch in ((0, None), (3, False), (3, True)):
        mesh = fzero.count_collectives(fzero.local_mesh(2))
        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD),
                             stages=stages, mesh=mesh, **({} if prefetch is None else {"prefetch": prefetch}))
        state = step.init(fzero.params_of(prob.model))
        history = []
        for k, b in enumerate(prob.batches):
            box["k"] = k
            mesh.counter.reset()
            state, _ = step(state, b)
            history.append(step.gather(state))
            if stages == 3:
                gathered = {c.label for c in mesh.counter.calls if c.op == "all_gather" and c.tag == "params"}
                reduced = {c.label for c in mesh.counter.calls if c.op == "reduce_scatter" and c.tag == "grads"}
                runs_blocks = {f"blocks.{i}" for i in range(n) if i not in dropped[k]}
                assert {u for u in reduced if u and u.startswith("blocks.")} == runs_blocks  # a dropped unit: no reduction
                blocks_gathered = {u for u in gathered if u and u.startswith("blocks.")}
                if prefetch:  # the prefetch follows the last step's order, so it may gather a block this step drops
                    assert blocks_gathered >= runs_blocks
                else:  # without it a dropped unit is not gathered either
                    assert blocks_gathered == runs_blocks
        runs[(stages, prefetch)] = history
    for k, want in enumerate(expected):
        torch.testing.assert_close(runs[(0, None)][k], want, rtol=1e-5, atol=1e-6)  # two half batches against one
        for key in ((3, False), (3, True)):
            assert_trees_equal(runs[key][k], runs[(0, None)][k])  # stage 3 equals stage 0 bit for bit
    start = fzero.params_of(prob.model)
    for i in range(n):  # a block dropped in every step so far has not moved (as in plain PyTorch: no gradient)
        k = next((k for k, d in enumerate(dropped) if i not in d), len(dropped))
        for name in (name for name in start if name.startswith(f"blocks.{i}.")):
            for j in range(k):
                assert torch.equal(runs[(3, False)][j][name], start[name]), (name, j)


@pytest.mark.torchrun
def test_under_torchrun_the_ranks_agree_on_the_dropped_blocks_and_train_as_the_local_mesh(tmp_path, one_thread):
    """Two processes at stage 3 draw which blocks run from (seed, step) alone, with no collective for it: had they
    drawn apart, their gathers would pair different units (a RanksDisagree on the thread mesh; a hang or a wrong
    exchange under torchrun). The params after each step equal those of local_mesh(2) bit for bit."""
    import os

    from launch import torchrun

    out = tmp_path / "pld.pt"
    torchrun([os.path.join(os.path.dirname(__file__), "layerdrop_worker.py"), "--out", str(out)])
    got = torch.load(out, weights_only=True)
    pld = ProgressiveLayerDrop(theta=0.3, gamma=1.0, seed=1)
    prob, loss_fn, box = _problem(pld)
    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD), stages=3,
                         mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    for k, b in enumerate(prob.batches):
        box["k"] = k
        state, _ = step(state, b)
        assert_trees_equal(got[k], step.gather(state))
