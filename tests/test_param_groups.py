"""Parameter groups (``fzero.optim.masked``, ``multi_transform``, ``adamw(mask=...)``) against torch.optim's param groups.

The optimizer sees flat unit buffers (stage 0) or each rank's shard of them (stages 1-3), never the user's
pytree; the groups are decided on that pytree and must land on the right elements of every shard, including
parameters cut between two ranks and padding. Each case runs a small model with biases, LayerNorms and a
positional table at stages 0-3 on ``local_mesh(2)``, with and without CPU offload, and compares the params
after every step with ``torch.optim.AdamW`` given two param groups. Tolerance as in tests/test_parity.py for
two ranks: the 2-rank gradient is a mean of per-rank means (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fzero
import fzero.optim as fo
from fzero.testing import assert_trees_close, assert_trees_equal

LR, FAST_LR, WD, STEPS = 1e-3, 3e-3, 0.1, 4
CASES = [(0, None)] + [(s, o) for s in (1, 2, 3) for o in (None, "cpu")]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.proj = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


class Net(nn.Module):
    """GPT-2's names where it has them (wte, wpe, h, ln_f): biases, LayerNorms and a positional table to exclude."""

    def __init__(self, vocab: int = 32, d: int = 16, seq: int = 8, n: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList([Block(d) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def problem():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # LayerNorms away from their init, so that decaying them shows
        for name, p in model.named_parameters():
            if "ln" in name:
                p.add_(torch.randn_like(p) * 0.5)
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randint(0, 32, (8, 8), generator=gen), "y": torch.randint(0, 32, (8, 8), generator=gen)}
               for _ in range(STEPS)]

    def loss_fn(params, b):
        logits = fzero.apply(model, params, b["x"])
        return nn.functional.cross_entropy(logits.flatten(0, 1), b["y"].flatten())

    return model, loss_fn, batches


def labels(params):
    mask = fo.decay_mask(params)
    return {k: "fast" if mask[k] else "slow" for k in params}


def torch_run(groups_of):
    """torch.optim.AdamW with the param groups ``groups_of(names) -> [(names, lr, weight_decay)]``, full batch."""
    model, loss_fn, batches = problem()
    params = {k: v.clone().requires_grad_() for k, v in fzero.params_of(model).items()}
    groups = [{"params": [params[n] for n in names], "lr": lr, "weight_decay": wd} for names, lr, wd in groups_of(list(params))]
    assert sum(len(g["params"]) for g in groups) == len(params)
    opt = torch.optim.AdamW(groups, lr=LR, fused=True)
    history = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(params, b).backward()
        opt.step()
        history.append({k: v.detach().clone() for k, v in params.items()})
    return history


def decay_groups(names):
    mask = fo.decay_mask(fzero.params_of(problem()[0]))
    return [([n for n in names if mask[n]], LR, WD), ([n for n in names if not mask[n]], LR, 0.0)]


def two_lr_groups(names):
    mask = fo.decay_mask(fzero.params_of(problem()[0]))
    return [([n for n in names if mask[n]], FAST_LR, WD), ([n for n in names if not mask[n]], LR, 0.0)]


def fzero_run(opt, stages, offload, *, first=0, steps=STEPS, state=None, step=None):
    """Params after each of ``steps`` steps on batches ``first``, ``first + 1``, ...; the last state; the step."""
    model, loss_fn, batches = problem()
    if step is None:
        step = fzero.compile(loss_fn, optimizer=opt, stages=stages, mesh=fzero.local_mesh(2), offload=offload,
                             **({"unit_elements": 1024} if stages < 2 else {}))
    if state is None:
        state = step.init(fzero.params_of(model))
    history = []
    for b in batches[first : first + steps]:
        state, _ = step(state, b)
        history.append(step.gather(state))
    return history, state, step


def assert_every_step_close(got, expected):
    assert len(got) == len(expected) == STEPS
    for g, e in zip(got, expected):
        assert_trees_close(g, e, rtol=1e-5, atol=1e-6)


def test_the_mask_matters_here():
    """The model has params on both sides of the rule, and one group's treatment visibly differs from the other's
    within the steps compared (else the parity tests below could not fail)."""
    mask = fo.decay_mask(fzero.params_of(problem()[0]))
    assert {k for k, v in mask.items() if not v} == {
        "wpe.weight", "h.0.ln.weight", "h.0.ln.bias", "h.0.fc.bias", "h.0.proj.bias", "h.1.ln.weight", "h.1.ln.bias",
        "h.1.fc.bias", "h.1.proj.bias", "ln_f.weight", "ln_f.bias", "head.bias"}
    grouped, everything = torch_run(decay_groups)[-1], torch_run(lambda names: [(names, LR, WD)])[-1]
    assert (grouped["ln_f.weight"] - everything["ln_f.weight"]).abs().max() > 1e-4
    assert (grouped["wpe.weight"] - everything["wpe.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("stages, offload", CASES)
def test_adamw_with_a_no_decay_mask_equals_torch_with_two_param_groups(stages, offload):
    opt = fo.adamw(LR, weight_decay=WD, mask=fo.decay_mask)
    got, _, _ = fzero_run(opt, stages, offload)
    assert_every_step_close(got, torch_run(decay_groups))


@pytest.mark.parametrize("stages, offload", CASES)
def test_multi_transform_with_two_learning_rates_equals_torch_with_two_param_groups(stages, offload):
    opt = fo.multi_transform({"fast": fo.adamw(FAST_LR, weight_decay=WD), "slow": fo.adamw(LR, weight_decay=0.0)}, labels)
    got, state, _ = fzero_run(opt, stages, offload)
    assert_every_step_close(got, torch_run(two_lr_groups))
    # the two groups' Adam moments share one tensor per unit (one state, as torch's groups), not one each
    inner = state.states[0].opt_state.inner
    assert inner["fast"][0].mu is inner["slow"][0].mu and inner["fast"][0].nu is inner["slow"][0].nu


def test_masked_chain_equals_adamw_mask():
    """``masked`` in a chain is what ``adamw(mask=)`` is: the pure chain and the fused step agree."""
    opt = fo.chain(fo.scale_by_adam(), fo.masked(fo.add_decayed_weights(WD), fo.decay_mask), fo.scale_by_learning_rate(LR))
    got, _, _ = fzero_run(opt, 2, None)
    assert_every_step_close(got, torch_run(decay_groups))


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_adamw_mask_is_bitwise_the_same_at_every_stage(stages):
    """The masked decay is an element-wise multiply before the unchanged Adam kernel: stages 1-3 equal stage 0."""
    opt = fo.adamw(LR, weight_decay=WD, mask=fo.decay_mask)
    base, _, _ = fzero_run(opt, 0, None)
    got, _, _ = fzero_run(opt, stages, None)
    for g, e in zip(got, base):
        assert_trees_equal(g, e)


@pytest.mark.parametrize("save_stages, load_stages", [(3, 3), (3, 1), (1, 2)])
def test_checkpoint_round_trip_keeps_the_groups(tmp_path, save_stages, load_stages):
    opt = fo.multi_transform({"fast": fo.adamw(FAST_LR, weight_decay=WD), "slow": fo.adamw(LR, weight_decay=0.0)}, labels)
    whole, _, _ = fzero_run(opt, save_stages, "cpu")
    _, state, _ = fzero_run(opt, save_stages, "cpu", steps=STEPS // 2)
    fzero.checkpoint.save(tmp_path / "ckpt", state)
    _, loss_fn, _ = problem()
    step = fzero.compile(loss_fn, optimizer=opt, stages=load_stages, mesh=fzero.local_mesh(2),
                         **({"unit_elements": 1024} if load_stages < 2 else {}))
    loaded = fzero.checkpoint.load(tmp_path / "ckpt", like=step)
    inner = loaded.states[0].opt_state.inner
    assert set(inner) == {"fast", "slow"} and float(inner["fast"][0].count) == STEPS // 2
    rest, _, _ = fzero_run(opt, load_stages, None, first=STEPS // 2, steps=STEPS // 2, state=loaded, step=step)
    for g, e in zip(rest, whole[STEPS // 2:]):
        assert_trees_close(g, e, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_without_groups_does_not_load_into_an_optimizer_with_them(tmp_path):
    _, state, _ = fzero_run(fo.adamw(LR), 1, None, steps=1)
    fzero.checkpoint.save(tmp_path / "plain", state)
    _, loss_fn, _ = problem()
    opt = fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)}, labels)
    step = fzero.compile(loss_fn, optimizer=opt, stages=1, mesh=fzero.local_mesh(2), unit_elements=1024)
    with pytest.raises(Exception, match=r"optimizer state .* differs from this step's optimizer"):
        fzero.checkpoint.load(tmp_path / "plain", like=step)
