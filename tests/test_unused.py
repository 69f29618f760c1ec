"""A param that gets no gradient is left as torch.optim leaves it (issue 12, item 5).

torch.optim skips a parameter whose ``grad`` is None: no weight decay, no moment update, and its own step
count (Adam's per-parameter ``state["step"]``, which its bias correction uses) does not advance. Under DDP a
parameter that some rank used gets the gradient averaged over ranks (zeros from the others); only one that no
rank used, in no micro-batch, keeps ``grad=None``. A parameter that is used with a zero gradient
(``0 * head(h)``) is used: torch updates it (its weight decays).

``Net`` has all of these in one model: a ``ModuleDict`` head no loss touches (``heads.unused``), a block
skipped in step 2 only and used again in step 3 (LayerDrop), a layer the data routes to on rank 0 only, in
steps 1 and 3 (``side``: in the root unit, gathered on every rank at stage 3), and a head used times zero
(``heads.zero``). ``MoE`` has experts that no token is routed to in some steps. Both run at stages 0-3 on
``local_mesh(1)`` and ``(2)`` with every optimizer fzero has, against two references with DDP's semantics:
torch.optim where it has the optimizer, and fzero's own optimizer run on each parameter separately, skipping
those whose grad is None (so each keeps its own state and step count, as torch does).

``python tests/test_unused.py --worker ...`` is the torchrun side of ``test_torchrun_equals_local_mesh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
import fzero.optim as fo
from fzero.step._state import RankStates
from fzero.testing import assert_trees_equal
from launch import torchrun

VOCAB, D, STEPS, BATCH, SEQ = 32, 16, 4, 4, 6
LR = 1e-2
TOL = dict(rtol=1e-6, atol=1e-6)

# name -> (fzero optimizer, torch.optim equivalent or None)
OPTIMIZERS: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.optim.Optimizer] | None]] = {
    "adamw": (lambda: fo.adamw(LR, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1)),
    "adam": (lambda: fo.adam(LR), lambda ps: torch.optim.Adam(ps, lr=LR)),
    "sgd_momentum": (lambda: fo.sgd(LR, momentum=0.9, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.01)),
    "lion": (lambda: fo.lion(LR, weight_decay=0.1), None),
    "lamb": (lambda: fo.lamb(LR, weight_decay=0.01), None),
    "chain": (lambda: fo.chain(fo.scale_by_adam(), fo.add_decayed_weights(0.1), fo.scale_by_learning_rate(LR)),
              lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1)),
}


# -- models ------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(D) for _ in range(3)])  # the stage-3 units
        self.side = nn.Linear(D, D)
        self.heads = nn.ModuleDict({"lm": nn.Linear(D, VOCAB), "unused": nn.Linear(D, VOCAB), "zero": nn.Linear(D, VOCAB)})

    def forward(self, x, *, skip=(), side=None):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if i not in skip:  # LayerDrop
                h = block(h)
        if side is not None and bool(side.any()):  # data-dependent: only where this rank's batch asks for it
            h = h + self.side(h)
        return self.heads["lm"](h) + 0 * self.heads["zero"](h)  # "zero" is used: its gradient is exactly zero


def net_batches() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for k in range(STEPS):
        side = torch.zeros(BATCH, dtype=torch.bool)
        if k in (0, 2):
            side[0] = True  # the first row: rank 0's half on local_mesh(2)
        out.append({"x": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), "side": side, "skip": (1,) if k == 1 else ()})
    return out


def net_loss(call: Callable, b: dict[str, Any]) -> torch.Tensor:
    logits = call(b["x"], skip=b["skip"], side=b["side"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), b["x"][:, 1:].flatten())


class MoE(nn.Module):
    """Top-1 routing to experts; an expert that gets no token is not called (as Mixtral's loop skips it)."""

    def __init__(self, d: int, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList([nn.Linear(d, d) for _ in range(experts)])

    def forward(self, h):
        flat = h.reshape(-1, h.shape[-1])
        gate = torch.softmax(self.router(flat), -1)
        choice = gate.argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(flat[rows]) * gate[rows, e : e + 1])
        return h + out.reshape(h.shape)


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([MoE(D)])  # unit "layers.0" holds the router and every expert
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def moe_batches() -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(11)
    return [{"x": torch.randint(0, VOCAB, (BATCH, 3), generator=g)} for _ in range(STEPS)]


def moe_loss(call: Callable, b: dict[str, Any]) -> torch.Tensor:
    logits = call(b["x"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), b["x"][:, 1:].flatten())


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    batches: Callable[[], list[dict[str, Any]]]
    loss: Callable[[Callable, dict[str, Any]], torch.Tensor]


def _seeded(cls: type) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls()

    return build


CASES = {"net": Case(_seeded(Net), net_batches, net_loss), "moe": Case(_seeded(MoENet), moe_batches, moe_loss)}


# -- references: DDP's gradient, then torch.optim or fzero's optimizer per parameter --------------------------


def _split(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    return [{k: v.chunk(n)[r] if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for r in range(n)]


def ddp_grads(case: Case, model: nn.Module, params: dict[str, torch.Tensor], batch: dict[str, Any], ranks: int,
              micro: int = 1) -> dict[str, torch.Tensor | None]:
    """The gradient DDP gives each param: the mean over ranks and micro-batches of what each computed, zeros where
    one did not use it; None where none did."""
    sums: dict[str, torch.Tensor | None] = {n: None for n in params}
    for part in (m for r in _split(batch, ranks) for m in _split(r, micro)):
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        loss = case.loss(lambda *a, **k: torch.func.functional_call(model, leaves, a, k), part)
        for (n, leaf), g in zip(leaves.items(), torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)):
            if g is not None:
                sums[n] = g if sums[n] is None else sums[n] + g
    return {n: None if g is None else g / (ranks * micro) for n, g in sums.items()}


@dataclasses.dataclass
class Reference:
    params: list[dict[str, torch.Tensor]]  # after each step
    used: list[set[str]]  # per step: the params some rank gave a gradient


@functools.cache
def reference(case_name: str, opt_name: str, ranks: int, kind: str, micro: int = 1) -> Reference:
    """kind "torch": torch.optim on the params; "fzero": fzero's optimizer on each param alone (its own state)."""
    case = CASES[case_name]
    model = case.build()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    make_fzero, make_torch = OPTIMIZERS[opt_name]
    if kind == "torch":
        leaves = {n: nn.Parameter(p) for n, p in params.items()}  # params are the same tensors, stepped in place
        opt = make_torch(list(leaves.values()))
    else:
        opt, states = make_fzero(), {}
    out, used = [], []
    for batch in case.batches():
        grads = ddp_grads(case, model, params, batch, ranks, micro)
        used.append({n for n, g in grads.items() if g is not None})
        if kind == "torch":
            for n, p in leaves.items():
                p.grad = grads[n]
            opt.step()
        else:
            for n, g in grads.items():
                if g is not None:
                    if n not in states:  # torch.optim makes a param's state at its first gradient
                        states[n] = opt.init({n: params[n]})
                    states[n] = fo.apply_inplace(opt, {n: g}, states[n], {n: params[n]})
        out.append({n: p.detach().clone() for n, p in params.items()})
    return Reference(out, used)


def run_fzero(case_name: str, opt_name: str, *, stages: int, ranks: int, mesh: Any = None, **settings) -> tuple[list, list, Any]:
    case = CASES[case_name]
    model = case.build()

    def loss_fn(params, batch):
        return case.loss(lambda *a, **k: fzero.apply(model, params, *a, **k), batch)

    step = fzero.compile(loss_fn, optimizer=OPTIMIZERS[opt_name][0](), stages=stages,
                         mesh=mesh or fzero.local_mesh(ranks), **settings)
    state = step.init(fzero.params_of(model))
    history, metrics = [], []
    for batch in case.batches():
        state, m = step(state, batch)
        history.append(step.gather(state))
        metrics.append(m)
    return history, metrics, state


def assert_matches(got: list[dict[str, torch.Tensor]], ref: Reference, what: str) -> None:
    for k, (g, e) in enumerate(zip(got, ref.params)):
        for n in e:
            if not any(n in u for u in ref.used[: k + 1]):  # never had a gradient: exactly as it started
                assert torch.equal(g[n], e[n]), f"{what}, step {k + 1}: {n} got no gradient yet but moved"
            else:
                torch.testing.assert_close(g[n], e[n], **TOL, msg=lambda m, k=k, n=n: f"{what}, step {k + 1}, {n}: {m}")


# -- the references exercise what they are for -----------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_net_reference_has_every_kind_of_param(ranks):
    ref = reference("net", "adamw", ranks, "torch")
    assert not any("heads.unused.weight" in u for u in ref.used)  # never used
    assert [("blocks.1.lin.weight" in u) for u in ref.used] == [True, False, True, True]  # LayerDrop in step 2
    assert [("side.weight" in u) for u in ref.used] == [True, False, True, False]  # rank 0 only, steps 1 and 3
    assert all("heads.zero.weight" in u for u in ref.used)  # used, with a zero gradient
    start = fzero.params_of(CASES["net"].build())
    assert not torch.equal(ref.params[0]["heads.zero.weight"], start["heads.zero.weight"])  # decayed


def test_the_moe_reference_routes_no_token_to_some_expert_in_some_step():
    for ranks in (1, 2):
        ref = reference("moe", "adamw", ranks, "torch")
        experts = [f"layers.0.experts.{e}.weight" for e in range(8)]
        pattern = [[e in u for e in experts] for u in ref.used]
        assert not all(all(p) for p in pattern), pattern  # some expert idle in some step
        assert any(any(pattern[k][e] for k in range(STEPS)) and not all(pattern[k][e] for k in range(STEPS))
                   for e in range(8)), pattern  # one idle in some steps and busy in others


def test_fzero_per_param_reference_is_torch_optim():
    """The per-parameter reference (fzero's optimizer on each param alone) is torch.optim's semantics: check it on
    the optimizers torch has, so it can stand in for the ones it has not (Lion, LAMB)."""
    for name in ("adamw", "adam", "sgd_momentum"):
        a, b = reference("net", name, 2, "torch"), reference("net", name, 2, "fzero")
        assert_matches(a.params, b, f"torch {name} vs fzero per param")


# -- every stage, mesh and optimizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_net_trains_as_torch_optim(opt, stages, ranks):
    got, metrics, _ = run_fzero("net", opt, stages=stages, ranks=ranks)
    assert_matches(got, reference("net", opt, ranks, "fzero"), f"{opt} stage {stages} mesh {ranks} vs per-param fzero")
    if OPTIMIZERS[opt][1] is not None:
        assert_matches(got, reference("net", opt, ranks, "torch"), f"{opt} stage {stages} mesh {ranks} vs torch.optim")
    ref = reference("net", opt, ranks, "fzero")
    for k in range(1, STEPS):  # a step a param sits out leaves it bitwise as it was
        for n in set(got[k]) - ref.used[k]:
            assert torch.equal(got[k][n], got[k - 1][n]), f"step {k + 1}: {n} had no gradient but moved"
    unused = [set(m.get("unused", ())) for m in metrics]
    assert unused[0] == {"heads.unused.weight", "heads.unused.bias"}
    assert unused[1] == {"heads.unused.weight", "heads.unused.bias", "blocks.1.lin.weight", "blocks.1.lin.bias",
                         "side.weight", "side.bias"}


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_moe_idle_experts_train_as_torch_optim(stages, ranks):
    got, _, _ = run_fzero("moe", "adamw", stages=stages, ranks=ranks)
    assert_matches(got, reference("moe", "adamw", ranks, "torch"), f"moe stage {stages} mesh {ranks}")


def test_sgd_momentum_is_bitwise_torch_on_one_rank():
    got, _, _ = run_fzero("net", "sgd_momentum", stages=0, ranks=1)
    for g, e in zip(got, reference("net", "sgd_momentum", 1, "torch").params):
        assert_trees_equal(g, e)


@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum", "lion"])
def test_stages_1_to_3_equal_stage_0_bitwise(opt):
    """Params with their own step counts are recomputed in aligned windows (fzero.optim._fused): the same bits at
    every stage. (Not LAMB: its per-param norms are summed over the shards, so its last bits depend on the stage.)"""
    base, _, _ = run_fzero("net", opt, stages=0, ranks=2)
    for stages in (1, 2, 3):
        got, _, _ = run_fzero("net", opt, stages=stages, ranks=2)
        for g, b in zip(got, base):
            assert_trees_equal(g, b)


def test_adam_keeps_a_step_count_per_param():
    _, _, state = run_fzero("net", "adamw", stages=1, ranks=2)
    adam = state[0].opt_state[0]
    assert float(adam.count) == STEPS
    layout = state[0].meta.layout
    names = [""] * len(layout.order)  # in the user's pytree order, as the skip counts are
    for slot, leaf in enumerate(layout.order):
        names[leaf] = layout.paths[slot]
    skipped = dict(zip(names, adam.skipped.tolist()))
    assert skipped["heads.unused.weight"] == STEPS and skipped["blocks.1.lin.weight"] == 1 and skipped["side.bias"] == 2
    assert skipped["heads.zero.weight"] == 0 and skipped["emb.weight"] == 0
    for s in state.states:
        assert torch.equal(s.opt_state[0].skipped, adam.skipped)  # every rank counts alike


# -- offload, precision, accumulation, autograd, remat ---------------------------------------------------------------


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("opt", ["adamw", "sgd_momentum", "lamb"])
def test_cpu_offload(opt, stages):
    got, _, _ = run_fzero("net", opt, stages=stages, ranks=2, offload="cpu")
    assert_matches(got, reference("net", opt, 2, "fzero"), f"{opt} offload cpu stage {stages}")


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("opt", ["adamw", "lion"])
def test_disk_offload(tmp_path, opt, stages):
    """Disk offload updates sub-groups that cut through params: each knows which params it holds."""
    extra = {"offload_params": True} if stages == 3 else {}
    got, _, _ = run_fzero("net", opt, stages=stages, ranks=2, offload="disk", offload_dir=str(tmp_path), sub_group_size=64, **extra)
    assert_matches(got, reference("net", opt, 2, "fzero"), f"{opt} offload disk stage {stages}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_leaves_unused_masters_moments_and_params_as_they_were(precision):
    start = fzero.params_of(CASES["net"].build())
    runs = {s: run_fzero("net", "adamw", stages=s, ranks=2, precision=precision) for s in (0, 3)}
    for stages, (got, metrics, state) in runs.items():
        assert not all(m["skipped"] for m in metrics)  # fp16: the first steps overflow the initial loss scale
        for g in got:  # gather gives the fp32 masters
            assert torch.equal(g["heads.unused.weight"], start["heads.unused.weight"])
        assert not torch.equal(got[-1]["heads.zero.weight"], start["heads.zero.weight"])  # used: decayed
    for a, b in zip(runs[0][0], runs[3][0]):
        assert_trees_equal(a, b)


def test_grad_accum_a_param_used_in_one_micro_batch_is_used():
    """side is used in rank 0's first row only: with grad_accum=2 that is one micro-batch of two."""
    got, _, _ = run_fzero("net", "adamw", stages=2, ranks=2, grad_accum=2)
    assert_matches(got, reference("net", "adamw", 2, "torch", micro=2), "grad_accum=2")


def test_plain_autograd_and_remat():
    ref = reference("net", "adamw", 2, "torch")
    got, _, _ = run_fzero("net", "adamw", stages=3, ranks=2, autodiff="autograd")
    assert_matches(got, ref, "autodiff='autograd'")
    got, _, _ = run_fzero("net", "adamw", stages=3, ranks=2, remat=True)
    assert_matches(got, ref, "stage 3 remat=True")


# -- checkpoints, errors ----------------------------------------------------------------------------------------------


def test_checkpoint_keeps_the_per_param_step_counts(tmp_path):
    """Save after the LayerDrop step, load into another stage, go on: as if never stopped."""
    case = CASES["net"]
    full, _, _ = run_fzero("net", "adamw", stages=1, ranks=2)
    model = case.build()

    def loss_fn(params, batch):
        return case.loss(lambda *a, **k: fzero.apply(model, params, *a, **k), batch)

    def make(stages, ranks):
        return fzero.compile(loss_fn, optimizer=OPTIMIZERS["adamw"][0](), stages=stages, mesh=fzero.local_mesh(ranks))

    first = make(1, 2)
    state = first.init(fzero.params_of(model))
    batches = case.batches()
    for b in batches[:2]:
        state, _ = first(state, b)
    path = fzero.checkpoint.save(tmp_path / "ckpt", state)
    second = make(3, 2)  # another stage (the same world size: side is used per rank)
    state = fzero.checkpoint.load(path, like=second)
    assert sorted(state[0].opt_state[0].skipped.tolist()) == [0.0] * 9 + [1.0] * 4 + [2.0] * 2  # side, blocks.1, heads.unused
    for k, b in enumerate(batches[2:], start=2):
        state, _ = second(state, b)
        torch.testing.assert_close(second.gather(state), full[k], rtol=1e-6, atol=1e-7)
    one = fzero.checkpoint.load(path, like=make(0, 1))  # and into one rank: the counts are per param, not per shard
    assert torch.equal(one[0].opt_state[0].skipped, fzero.checkpoint.load(path, like=first)[0].opt_state[0].skipped)


def test_a_checkpoint_from_before_skip_counts_loads_with_zeros(tmp_path):
    """A state without skip counts (skipped=None) saves as checkpoints did before they existed: it loads, with zeros."""
    model = Net()
    step = fzero.compile(lambda p, b: net_loss(lambda *a, **k: fzero.apply(model, p, *a, **k), b),
                         optimizer=fo.adamw(LR), stages=1, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    old = RankStates(tuple(dataclasses.replace(s, opt_state=(s.opt_state[0]._replace(skipped=None),) + s.opt_state[1:])
                                 for s in state.states))
    path = fzero.checkpoint.save(tmp_path / "old", old)
    loaded = fzero.checkpoint.load(path, like=step)
    for s in loaded.states:
        assert torch.equal(s.opt_state[0].skipped, torch.zeros(15))
    loaded, _ = step(loaded, net_batches()[0])
    assert loaded[0].opt_state[0].skipped.sum() == 2  # heads.unused: its first skipped step


def test_a_state_without_per_param_counts_says_how_to_make_one():
    model = Net()
    step = fzero.compile(lambda p, b: net_loss(lambda *a, **k: fzero.apply(model, p, *a, **k), b),
                         optimizer=fo.adamw(LR), stages=0)
    state = step.init(fzero.params_of(model))
    adam = state.opt_state[0]
    state = dataclasses.replace(state, opt_state=(adam._replace(skipped=None),) + tuple(state.opt_state[1:]))
    with pytest.raises(ValueError, match=r"fzero.optim.adamw: parameters without a gradient must skip this step .* "
                                         r"skipped=None.*Make the state with the optimizer's init"):
        step(state, net_batches()[0])


def test_a_state_made_for_other_params_names_both_counts():
    model = Net()
    step = fzero.compile(lambda p, b: net_loss(lambda *a, **k: fzero.apply(model, p, *a, **k), b),
                         optimizer=fo.adamw(LR), stages=0)
    state = step.init(fzero.params_of(model))
    adam = state.opt_state[0]
    wrong = adam._replace(skipped=torch.zeros(3))  # e.g. opt.init on the flat buffers without the step's Segments
    state = dataclasses.replace(state, opt_state=(wrong,) + tuple(state.opt_state[1:]))
    with pytest.raises(ValueError, match=r"fzero.optim.adamw: the optimizer state counts steps for 3 parameters, but this "
                                         r"step has 15.*step.init\(params\)"):
        step(state, net_batches()[0])


def test_apply_inplace_with_a_segments_that_skips_leaves_them_alone():
    """The optimizer API on its own: a Segments whose active() says which params take the step."""

    class Skip(fo.WholeLeaves):
        def active(self):
            return torch.tensor([True, False])

    params = {"a": torch.ones(3), "b": torch.ones(2)}
    for name, (make, _) in OPTIMIZERS.items():
        opt = make()
        p = {k: v.clone() for k, v in params.items()}
        state = opt.init(p)
        with fo.use_segments(Skip()):
            state = fo.apply_inplace(opt, {"a": torch.ones(3), "b": torch.ones(2)}, state, p)
        assert torch.equal(p["b"], params["b"]), name
        assert not torch.equal(p["a"], params["a"]), name


class _TwoOutputs(nn.Module):
    """A unit returning two results, of two layers: ``aux`` reaches nothing in the loss."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.main, self.aux = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.main(h)), {"aux": self.aux(h)}


class _PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([_TwoOutputs(D) for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h, _ = block(h)
        return self.head(h)


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("stages", [0, 3])
def test_the_params_behind_a_units_output_that_reaches_nothing_get_no_gradient(stages, remat, autodiff):
    """A unit's output that reaches nothing in the loss gives the layers behind it no gradient, as in torch (grad=None:
    AdamW leaves them as they are). At stage 3 the unit's outputs pass a Function that refills the unit before its
    backward; it handed the unused output a zero gradient, which reached ``aux`` as a zero gradient: its weight decayed
    and its moments moved, silently."""
    torch.manual_seed(0)
    model = _PartlyUsed()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss_fn(params, batch):
        logits = fzero.apply(model, params, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    step = fzero.compile(loss_fn, optimizer=fo.adamw(LR, weight_decay=0.1), stages=stages, mesh=fzero.local_mesh(2),
                         remat=remat, autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        state, _ = step(state, {"x": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
                                "y": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)})
    got = step.gather(state)
    for i in range(2):
        for name in (f"blocks.{i}.aux.weight", f"blocks.{i}.aux.bias"):
            assert torch.equal(got[name], start[name]), f"{name} got a gradient at stage {stages}"
        assert not torch.equal(got[f"blocks.{i}.main.weight"], start[f"blocks.{i}.main.weight"])


# -- torchrun ---------------------------------------------------------------------------------------------------------


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [0, 3])
def test_torchrun_equals_local_mesh(tmp_path, one_thread, stages):
    out = tmp_path / "run.pt"
    torchrun([__file__, "--worker", "--stages", str(stages), "--out", str(out)])
    dist = torch.load(out, weights_only=False)
    local, metrics, _ = run_fzero("net", "adamw", stages=stages, ranks=2)
    for d, l in zip(dist["history"], local):
        assert_trees_equal(d, l)
    assert [m.get("unused") for m in dist["metrics"]] == [m.get("unused") for m in metrics]


def _worker() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    case = CASES["net"]
    local = [_split(b, mesh.size)[mesh.rank] for b in case.batches()]  # each process passes its own share
    case = dataclasses.replace(case, batches=lambda: local)
    CASES["net"] = case
    history, metrics, _ = run_fzero("net", "adamw", stages=args.stages, ranks=mesh.size, mesh=mesh)
    if mesh.rank == 0:
        torch.save({"history": history, "metrics": metrics}, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker()
