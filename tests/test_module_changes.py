"""What a user changes on the module between steps: what a step sees, what it refuses, never what it ignores silently.

A state fixes at ``step.init`` which params train, and holds the persistent buffers from the first step on. A
``requires_grad`` changed afterwards (a layer frozen or unfrozen, a trainable adapter attached) used to be ignored at
stages 0-1 (a frozen param kept training, a new one never trained) and, at stages 2-3, to run a new trainable param as
its meta stand-in, whose memory torch's CPU kernels read as values (losses of 1e16, or finite and wrong). A persistent
buffer written on the module after the state took it over was ignored at every stage. Both are refused now, by name;
what the module legitimately carries into every step (mode, attributes, hooks, frozen values) is checked to still
train as plain PyTorch does in ``tests/test_hooks.py`` and the zoo.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fzero

STAGES = [0, 1, 2, 3]


class Net(nn.Module):
    """Two blocks (the stage 2-3 units) and a head, with a BatchNorm (persistent buffers) in the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # no bias before the BatchNorm: it cannot change the loss, so its gradient is rounding noise, which Adam turns
        # into lr-sized steps that differ from one CPU to another (3e-3 on inp.bias between two machines' runs)
        self.inp = nn.Linear(4, 8, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.bn(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _batches(n=4):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(8, 4, generator=gen) for _ in range(n)]


def _step(model, stages, ranks=1):
    def loss_fn(params, x):
        return fzero.apply(model, params, x).pow(2).mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(ranks))
    return step, step.init(fzero.params_of(model))


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("change", ["freeze", "unfreeze", "attach"])
def test_a_trainable_set_changed_after_init_is_refused_by_name(stages, change):
    model = Net()
    model.blocks[1][0].bias.requires_grad_(False)  # frozen from the start: "unfreeze" makes it trainable
    step, state = _step(model, stages)
    batches = _batches()
    state, _ = step(state, batches[0])
    if change == "freeze":
        model.blocks[0][0].weight.requires_grad_(False)
        name, what = "blocks.0.0.weight", "frozen since"
    elif change == "unfreeze":
        model.blocks[1][0].bias.requires_grad_(True)
        name, what = "blocks.1.0.bias", "trainable now but not in the state"
    else:
        model.blocks[0].append(nn.Linear(8, 8))  # an adapter inside a unit (the other names unchanged)
        name, what = "blocks.0.2.weight", "trainable now but not in the state"
    with pytest.raises(ValueError, match=rf"trainable parameters of Net are not those the state was made with; {what}.*"
                                         rf"{name.replace('.', '[.]')}.*step.init\(fzero.params_of\(model\)\)"):
        step(state, batches[1])


@pytest.mark.parametrize("stages", STAGES)
def test_a_new_trainable_set_trains_from_a_new_state_as_the_error_says(stages):
    """The error's recipe: the trained values into the model, the change, a new state; it then trains as PyTorch does
    from the same values (Adam's moments start again, as the error says)."""
    model = Net()
    step, state = _step(model, stages)
    batches = _batches()
    state, _ = step(state, batches[0])
    model.load_state_dict(step.state_dict(state, model))
    model.blocks[0][0].weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    state = step.init(fzero.params_of(model), buffers=fzero.buffers_of(model))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for x in batches[1:]:
        state, _ = step(state, x)
        _plain_step(ref, opt, x)
    _assert_trains_as(step, state, model, ref)


def _plain_step(ref: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    ref(x).pow(2).mean().backward()
    opt.step()


def _assert_trains_as(step, state, model: nn.Module, ref: nn.Module) -> None:
    """The state's params and buffers, as ``model``'s state dict, equal ``ref``'s within fp32 tolerance."""
    got = step.state_dict(state, model)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", STAGES)
def test_a_buffer_written_on_the_module_after_the_state_took_it_is_refused(stages, ranks):
    model = Net()
    step, state = _step(model, stages, ranks)
    batches = _batches()
    state, _ = step(state, batches[0])
    with torch.no_grad():
        model.bn.running_var.fill_(4.0)  # the state holds its own running_var, which the forward keeps writing
    with pytest.raises(ValueError, match=r"buffer 'bn.running_var' of Net was changed on the module after the state "
                                         r"took it over.*step.with_buffers\(state, \{'bn.running_var': value\}\)"):
        step(state, batches[1])


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", STAGES)
def test_a_buffer_replaced_on_the_module_by_another_tensor_is_refused(stages, ranks):
    """A buffer registered again under its name (a new tensor, not a write into the old one) was taken as read: the
    record was kept by the old tensor's id, the new tensor had none, and the state's old value trained on, silently."""
    model = Net()
    step, state = _step(model, stages, ranks)
    batches = _batches()
    state, _ = step(state, batches[0])
    model.bn.register_buffer("running_var", torch.full((8,), 4.0))
    with pytest.raises(ValueError, match=r"buffer 'bn.running_var' of Net was changed on the module after the state "
                                         r"took it over.*step.with_buffers\(state, \{'bn.running_var': value\}\)"):
        step(state, batches[1])
    state = step.with_buffers(state, {"bn.running_var": model.bn.running_var})  # the fix: the module now agrees
    state, _ = step(state, batches[1])
    # another tensor holding the state's own value (a state dict loaded with assign=True): not a change
    model.bn.running_var = step.state_dict(state, model)["bn.running_var"]
    state, _ = step(state, batches[2])
    # new tensors of the same values (model.to(...) and dtype round trips replace every buffer so): not a change either,
    # though the module's running_mean is not the state's (the state took the statistics over at the first step)
    before = model.bn.running_mean
    model.double().float()
    assert model.bn.running_mean is not before
    step(state, batches[3])


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 3])
def test_pruning_a_pruned_module_again_between_steps_is_refused_and_trains_as_pytorch_by_the_fix(stages, ranks):
    """``torch.nn.utils.prune`` pruning again (iterative pruning) registers a new ``weight_mask``: that was ignored
    silently (8% off PyTorch in the pruned weights after 5 AdamW steps). Refused now; the fix (the trained values into
    the module, prune, the new masks into the state) trains as PyTorch does, with DDP's batch split on two ranks."""
    from torch.nn.utils import prune

    def build():
        model = Net()
        for block in model.blocks:
            prune.l1_unstructured(block[0], "weight", amount=0.3)
        return model

    def reprune(m):
        for block in m.blocks:
            prune.l1_unstructured(block[0], "weight", amount=0.3)

    batches = _batches(5)
    model = build()
    step, state = _step(model, stages, ranks)
    state, _ = step(state, batches[0])
    reprune(model)
    with pytest.raises(ValueError, match=r"buffer 'blocks.0.0.weight_mask' of Net was changed on the module"):
        step(state, batches[1])

    model = build()
    step, state = _step(model, stages, ranks)
    reps = [build() for _ in range(ranks)]
    opt = torch.optim.AdamW(reps[0].parameters(), lr=1e-2)
    for k, x in enumerate(batches):
        if k in (2, 3):
            model.load_state_dict(step.state_dict(state, model))
            reprune(model)
            state = step.with_buffers(state, {n: b for n, b in model.named_buffers() if n.endswith("weight_mask")})
            for rep in reps:
                reprune(rep)
        state, _ = step(state, x)
        for rep in reps[1:]:  # DDP: every rank starts the step from rank 0's params and buffers
            rep.load_state_dict(reps[0].state_dict())
        grads = []
        for rep, part in zip(reps, x.chunk(ranks)):
            rep.zero_grad()
            rep.bn.momentum = 0.1
            rep(part).pow(2).mean().backward()
            grads.append([p.grad for p in rep.parameters()])
        for p, gs in zip(reps[0].parameters(), zip(*grads)):
            p.grad = sum(gs) / ranks
        opt.step()
    _assert_trains_as(step, state, model, reps[0])
    assert int(step.state_dict(state, model)["blocks.0.0.weight_mask"].sum()) == int(reps[0].blocks[0][0].weight_mask.sum()) < 64 * 0.7 ** 2


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 3])
def test_a_buffer_write_is_refused_whichever_state_read_the_module_last(stages, ranks):
    """Two states on one module (two runs, or a train and a probe step): a write to the module's buffer after the first
    state took it over is refused for that state even when the second adopted the new value in between. The module
    kept one record of the last read, so the second state's adoption hid the write from the first, which trained on
    with its own statistics silently."""
    model = Net()
    step, first = _step(model, stages, ranks)
    other, second = _step(model, stages, ranks)
    batches = _batches()
    first, _ = step(first, batches[0])
    with torch.no_grad():
        model.bn.running_var.fill_(4.0)
    second, _ = other(second, batches[1])  # a new state: takes the module's value now, as a first step does
    with pytest.raises(ValueError, match=r"buffer 'bn.running_var' of Net was changed on the module after the state "
                                         r"took it over"):
        step(first, batches[2])
    second, _ = other(second, batches[2])  # the one that took the written value trains on


@pytest.mark.parametrize("stages", [0, 3])
def test_loading_the_states_own_values_into_the_module_is_not_a_change(stages):
    """``model.load_state_dict(step.state_dict(state, model))`` between steps (to evaluate or save the module) writes
    the module's buffers, with the state's values: training goes on, bit for bit as without it."""
    batches = _batches()
    runs = []
    for sync in (False, True):
        model = Net()
        step, state = _step(model, stages)
        for x in batches:
            state, _ = step(state, x)
            if sync:
                model.load_state_dict(step.state_dict(state, model))
        runs.append(step.state_dict(state, model))
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


def _write(model, how):
    if how == "clamp_data":  # WGAN's weight clipping, after a step
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)
    elif how == "init":  # a re-init of a submodule
        nn.init.zeros_(model.blocks[1][0].weight)
    else:
        model.head.weight.data = model.head.weight.data * 0.5


@pytest.mark.parametrize("stages", [0, 2, 3])
@pytest.mark.parametrize("how", ["clamp_data", "init", "assign_data"])
def test_a_trainable_param_written_on_the_module_between_steps_is_refused_by_name(stages, how):
    """A step trains its state and never reads the module's trainable params. Before: a write on the module between
    steps (``p.data.clamp_``, ``torch.nn.init``, ``p.data = t``) was ignored at every stage, 0.29-0.35 off PyTorch
    after 3 SGD steps, silently. Now the next step refuses it before its update, naming the params and the fixes;
    loading the state's own values is not a change (``test_loading_the_states_own_values_into_the_module_is_not_a_change``,
    and through ``.data`` below)."""
    model = Net()
    step, state = _step(model, stages)
    x = _batches(1)[0]
    state, _ = step(state, x)
    _write(model, how)
    name = {"clamp_data": "inp.weight", "init": "blocks.1.0.weight", "assign_data": "head.weight"}[how]
    with pytest.raises(ValueError, match=rf"the trainable param\(s\) .*'{name}'.* of Net were written on the module since "
                                         rf"the step before(.|\n)*t.clamp_\(-c, c\)(.|\n)*state = step.init"):
        step(state, x)
    model = Net()  # the state's values, loaded through .data, are not a change
    step, state = _step(model, stages)
    for x in _batches(3):
        state, _ = step(state, x)
        for n, v in step.state_dict(state, model).items():
            model.get_parameter(n).data.copy_(v) if n in dict(model.named_parameters()) else None


@pytest.mark.parametrize("stages", [0, 3])
def test_weight_clipping_on_the_states_params_trains_as_pytorch(stages):
    """The fix the error names for an element-wise edit of every param (WGAN's critic clipping): made in place on the
    state's params (fp32, no masters), on each rank's state of a local mesh, it trains as PyTorch's p.data.clamp_."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).mean(), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(2), **({"unit_elements": 64} if stages < 2 else {}))
    state = step.init(fzero.params_of(model))
    for x in _batches(3):
        state, _ = step(state, x)
        for s in state.states:
            for t in s.params.values():
                t.clamp_(-0.05, 0.05)
        opt.zero_grad()
        reference(x).mean().backward()
        opt.step()
        for p in reference.parameters():
            p.data.clamp_(-0.05, 0.05)
    got = step.gather(state)
    for n, p in reference.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), rtol=1e-6, atol=1e-7)


def test_a_buffer_set_with_with_buffers_trains_as_pytorch():
    """The fix the error names: the new value set in the state (in the buffer's own dtype, whatever it is given in) is
    what the next steps use, as PyTorch uses a buffer written on its module."""
    model = Net()
    step, state = _step(model, 0)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = _batches()
    for k, x in enumerate(batches):
        if k == 2:
            state = step.with_buffers(state, {"bn.running_var": torch.full((8,), 4.0, dtype=torch.float64)})
            with torch.no_grad():
                ref.bn.running_var.fill_(4.0)
        state, _ = step(state, x)
        _plain_step(ref, opt, x)
    _assert_trains_as(step, state, model, ref)


def test_with_buffers_refuses_what_the_state_does_not_hold():
    model = Net()
    step, state = _step(model, 0)
    with pytest.raises(ValueError, match=r"holds no buffer \['bn.running_var'\]; it holds \[\]. A state takes the "
                                         r"module's persistent buffers at its first step"):
        step.with_buffers(state, {"bn.running_var": torch.zeros(8)})
    state, _ = step(state, _batches(1)[0])
    with pytest.raises(ValueError, match=r"holds no buffer \['bn.running_men'\]; it holds \['bn.num_batches_tracked'"):
        step.with_buffers(state, {"bn.running_men": torch.zeros(8)})
    with pytest.raises(ValueError, match=r"'bn.running_var' has shape \(8,\) in the state; the new value has \(4,\)"):
        step.with_buffers(state, {"bn.running_var": torch.zeros(4)})


class TiedNet(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("stages", STAGES)
def test_a_state_of_another_configuration_is_named_as_such(stages):
    """A state (or a checkpoint loaded into one) from another configuration of the model, run by this one: an untied
    one run by a tied model (torch said only "Consider using tie_weights=False"), a smaller one by a larger model (at
    stages 2-3 the new layers ran as meta stand-ins)."""
    ids = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(0))

    def run(state_from, model):
        step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                             stages=stages, mesh=fzero.local_mesh(1))
        step(step.init(fzero.params_of(state_from)), ids)

    with pytest.raises(ValueError, match=r"the state holds separate values for \['emb.weight', 'head.weight'\], which are "
                                         r"one tied parameter in TiedNet.*tie_word_embeddings=False"):
        run(TiedNet(tie=False), TiedNet(tie=True))
    larger = TiedNet(tie=True)
    larger.blocks.append(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"trainable now but not in the state \(.*a smaller configuration of the model\): "
                                         r"\['blocks.1.weight', 'blocks.1.bias'\]"):
        run(TiedNet(tie=True), larger)


def test_a_copy_of_the_module_is_not_taken_for_a_write():
    """The module's buffers carry a mark of the last read; a deepcopy of the module (an EMA or eval copy, a pickled
    module) copies the mark while its version counter starts again: run with a resumed state, it is no write."""
    model = Net()
    with torch.no_grad():
        for _ in range(3):  # writes before any step: the version the mark records is 3, a copy's starts lower
            model.bn.running_var.add_(0.0)
    step, state = _step(model, 0)
    batches = _batches()
    state, _ = step(state, batches[0])
    twin = copy.deepcopy(model)  # its buffers hold the values at init, the state's have moved on
    assert twin.bn.running_var._version != model.bn.running_var._version
    step2, _ = _step(twin, 0)
    step2(state, batches[1])


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("change", ["reshape", "tie"])
def test_a_param_reshaped_or_tied_between_steps_is_refused(stages, change):
    """At stages 2-3 the skeleton's checks of the module's params against the state (names, shapes, ties, requires_grad)
    are skipped where the params' pattern is that of an earlier step that passed them (``fzero.zero._sharded``'s
    ``_checked_before``): a change between steps makes them run again, and refuse it as at the first step."""
    model = Net()
    step, state = _step(model, stages)
    batches = _batches()
    for x in batches[:2]:  # the second step skips the checks
        state, _ = step(state, x)
    if change == "reshape":
        model.blocks[0][0] = nn.Linear(8, 16)  # the same names, another shape
        match = r"unit 'blocks.0' param 'blocks.0.0.(weight|bias)' has shape \(8(, 8)?,?\) in the state but \(16(, 8)?,?\) in"
    else:
        model.blocks[1][0].weight = model.blocks[0][0].weight  # the same names and shapes, one tensor
        match = r"the state holds separate values for \['blocks.0.0.weight', 'blocks.1.0.weight'\], which are one tied"
    with pytest.raises(ValueError, match=match):
        step(state, batches[2])


class _Lookup(nn.Module):
    """An embedding whose row 0 holds a NaN and is never looked up (memory ``torch.empty`` left, a reserved row)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(6, 8)
        with torch.no_grad():
            self.emb.weight[0, 2] = float("nan")
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, i):
        h = self.emb(i)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("stages, ranks, precision", [(0, 1, None), (3, 2, None), (1, 2, "bf16")])
def test_a_param_holding_a_nan_is_not_taken_for_written(stages, ranks, precision):
    """The checks of a write on the module between steps, and of a forward's write through ``.data`` against the fp32
    masters, compared values with ``torch.ne``/``torch.equal``, for which a NaN differs from itself: a NaN in a row no
    batch looks up refused the second step (the first, under bf16) as a write nothing made, where PyTorch trains. Now it
    trains as PyTorch, the state's values loaded into the module between steps or not."""
    model, reference = _Lookup(), _Lookup()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = fzero.compile(lambda p, i: fzero.apply(model, p, i), optimizer=fzero.optim.adamw(1e-2), stages=stages,
                         mesh=fzero.local_mesh(ranks), **({"precision": precision} if precision else {}))
    state = step.init(fzero.params_of(model))
    gen = torch.Generator().manual_seed(0)
    for k in range(3):
        i = torch.randint(1, 6, (4, 3), generator=gen)
        state, _ = step(state, i)
        if k == 1:  # the state's values (with the NaN) into the module: not a write either
            model.load_state_dict(step.state_dict(state, model))
        opt.zero_grad()
        reference(i).backward()
        opt.step()
    got = step.gather(state)
    assert got["emb.weight"][0, 2].isnan() and not got["emb.weight"][1:].isnan().any()
    if precision is None:
        for n, p in reference.named_parameters():
            torch.testing.assert_close(got[n], p.detach(), rtol=1e-5, atol=1e-6, equal_nan=True)
