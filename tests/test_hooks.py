"""Hooks, captured outputs and recompute train as in plain PyTorch, and the user's module is never written (issue 26).

The parity of hooked models (Hugging Face ``output_hidden_states``, MoE router logits, user-written forward,
pre- and full backward hooks feeding the loss) against PyTorch is in the zoo (tests/zoo.py, tests/test_zoo.py).
Here: the invariants around it. fzero runs clones of the user's module (``fzero.layout._modules``), so hooks that
a forward installs (as transformers does, lazily) land in the clone, never in the user's module; hooks see the
calls an eager forward makes, step after step, without piling up; a stage-3 skeleton shows the user's module
tree; and ``remat`` neither repeats buffer writes nor silently recomputes with a changed Hugging Face cache.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

import fzero
from zoo import ZOO, Entry, TokenModel, Blocks, _lm_loss, _tokens, check, fzero_run, gemma, llama, reference_run

pytestmark = pytest.mark.usefixtures("one_thread")

STAGES = (0, 1, 2, 3)
MESHES = (1, 2)


def _hf_loss_fn(model):
    def loss_fn(params, b):
        out = fzero.apply(model, params, input_ids=b, labels=b, output_hidden_states=True)
        if len(out.hidden_states) != 3:
            raise ValueError(f"{len(out.hidden_states)} hidden states, not 3")
        return out.loss + 0.1 * out.hidden_states[1].pow(2).mean()
    return loss_fn


def _module_picture(model: nn.Module) -> dict:
    """Everything fzero must leave as it is: per submodule, its ``__dict__`` keys, every hook dictionary's
    entries, its class; and the values of every parameter and buffer. One thing fzero adds on purpose is left out: the
    forward pre-hook and the state_dict pre-hook that refuse a direct call or a save of a module a step has trained
    (``tests/test_untrained_module.py``)."""
    from fzero.step._module import _refuse_untrained_call, _refuse_untrained_state_dict

    picture = {}
    for name, m in model.named_modules():
        hooks = {k: [key for key, h in v.items() if h is not _refuse_untrained_call and h is not _refuse_untrained_state_dict]
                 for k, v in m.__dict__.items()
                 if k.endswith("hooks") or "hooks_" in k}
        picture[name] = (type(m), sorted(m.__dict__), hooks)
    picture["tensors"] = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    return picture


def _assert_same_picture(before: dict, after: dict) -> None:
    assert set(before) == set(after)
    for name in before:
        if name == "tensors":
            continue
        assert before[name] == after[name], f"fzero changed the user's module {name or '(root)'}"
    for k, v in before["tensors"].items():
        assert torch.equal(v, after["tensors"][k]), f"fzero wrote into the user's {k}"


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", STAGES)
def test_the_users_module_is_never_written_with_hf_output_capture(stages, ranks):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = gemma().train()
    x = torch.randint(0, 128, (4, 8))
    before = _module_picture(model)
    step = fzero.compile(_hf_loss_fn(model), stages=stages, mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    for _ in range(3):
        state, _ = step(state, x)
    step.evaluate(state, x)
    step.gather(state)
    _assert_same_picture(before, _module_picture(model))
    # and the user's own forward afterwards is what it was: 3 hidden states (transformers installs its hooks now,
    # into the user's module, as it would without fzero), the same values as a fresh copy of the model gives
    torch.manual_seed(0)
    fresh = gemma().train()
    with pytest.raises(RuntimeError, match="called directly after a fzero.Step trained it"):  # it is behind the state
        model(input_ids=x)
    model.load_state_dict(fresh.state_dict())  # its own values again, loaded: a direct call runs
    with torch.no_grad():
        got = model(input_ids=x, output_hidden_states=True)
        want = fresh(input_ids=x, output_hidden_states=True)
    assert len(got.hidden_states) == 3
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)


def test_hooks_do_not_pile_up_over_many_steps():
    """transformers installs its capture hooks once per module object; fzero gives each step fresh clones, so each
    step's forward fires each hook once: counted, not timed (a growing count is what made steps slower)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = gemma().train()
    fired = []
    lock = threading.Lock()

    def count(module, args, output):
        with lock:
            fired.append(1)

    model.model.layers[0].register_forward_hook(count)
    step = fzero.compile(_hf_loss_fn(model), stages=1, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    x = torch.randint(0, 128, (4, 8))
    per_step = []
    for _ in range(50):
        n = len(fired)
        state, _ = step(state, x)  # the loss raises if hidden_states is not 3 long
        per_step.append(len(fired) - n)
    assert per_step == [2] * 50  # one call per rank per step, from the first step to the fiftieth
    assert sum(len(m._forward_hooks) for m in model.modules()) == 1  # the user's own hook, nothing added


_CALLS: list = []
_LOCK = threading.Lock()


def _note(kind):
    def hook(*_):
        with _LOCK:
            _CALLS.append(kind)
    return hook


def _counted_model():
    torch.manual_seed(0)
    model = TokenModel(Blocks()).train()
    model.register_forward_pre_hook(_note("pre"))
    model.body.blocks[1][0].register_forward_hook(_note("forward"))  # inside a unit
    model.body.blocks[0].register_forward_hook(_note("unit forward"))  # on a unit
    model.body.blocks[0].register_full_backward_hook(_note("backward"))
    return model


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", STAGES)
def test_hooks_see_the_calls_an_eager_forward_and_backward_make(stages, ranks):
    batches = [torch.randint(0, 64, (4, 8)) for _ in range(3)]
    model = _counted_model()
    _CALLS.clear()
    for x in batches:  # eager: each rank's replica runs forward and backward once per step
        for part in x.chunk(ranks):
            model(part).sum().backward()
    eager = sorted(_CALLS)
    model = _counted_model()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).sum(), stages=stages, mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    _CALLS.clear()
    for x in batches:
        state, _ = step(state, x)
    assert sorted(_CALLS) == eager


@pytest.mark.parametrize("stages", [2, 3])
def test_the_skeleton_shows_the_users_module_tree(stages):
    """Units keep their place and class in the skeleton a stage-2/3 step runs (what walks named_children(), as
    transformers does to install its hooks, reaches them); the user's module keeps its own classes."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = llama().train()
    seen = {}

    def loss_fn(params, b):
        out = fzero.apply(model, params, input_ids=b, labels=b)
        skeleton = fzero.zero._sharded.UnitParams.skeleton(params, model)
        seen["tree"] = [(n, type(m).__name__, isinstance(m, type(model.get_submodule(n))))
                        for n, m in skeleton.named_modules()]
        return out.loss

    step = fzero.compile(loss_fn, stages=stages)
    step(step.init(fzero.params_of(model)), torch.randint(0, 128, (2, 8)))
    assert seen["tree"] == [(n, type(m).__name__, True) for n, m in model.named_modules()]
    assert all(type(m).__module__.startswith(("transformers", "torch")) for m in model.modules())


# -- recompute ------------------------------------------------------------------------------------------------


def _llama_no_cache():
    model = llama()
    model.config.use_cache = False
    return model


@pytest.mark.parametrize("ranks", MESHES)
def test_remat_on_an_hf_decoder_with_its_default_cache_raises_before_any_update(ranks):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = llama().train()  # use_cache=True, the default: each layer appends to one DynamicCache
    step = fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b, labels=b).loss, stages=3, remat=True,
                         mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    first = step.gather(state)
    with pytest.raises(RuntimeError, match=r"(?s)unit 'model\.layers\.0' changed an argument .*DynamicCache.*"
                                           r"pass use_cache=False to the model.s forward"):
        step(state, torch.randint(0, 128, (4, 8)))
    assert all(torch.equal(v, first[k]) for k, v in fzero.params_of(model).items())


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", [0, 2, 3])
@pytest.mark.parametrize("name, build", [("llama", _llama_no_cache), ("bn_cnn", None), ("spectral_norm", None)])
def test_remat_trains_as_pytorch_without_remat(name, build, ranks, stages):
    """``remat=True`` against plain PyTorch without recompute, at stage 0 (module units found on the model), 2 and 3:
    the same params every step, and buffers (BatchNorm's running means, variances and ``num_batches_tracked``;
    spectral norm's vectors) written once per step."""
    if name == "llama":
        pytest.importorskip("transformers")
    entry = ZOO[name]
    if build is not None:
        entry = dataclasses.replace(entry, build=lambda: (torch.manual_seed(0), build().train())[1])
    ref = reference_run(entry, ranks)
    run = fzero_run(dataclasses.replace(entry, settings={**entry.settings, "remat": True}), stages=stages, ranks=ranks)
    check(entry, ref, run)
    if name == "bn_cnn":
        assert int(run.state_dict["0.1.num_batches_tracked"]) == 4  # 4 steps, not 8


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("name", ["user_hooks", "side_channel", "qwen2_moe_router"])
def test_remat_refuses_a_tensor_that_leaves_a_unit_besides_its_return_value(name, stages):
    """A forward hook inside a unit that stores its module's output (the zoo's ``user_hooks``, Hugging Face's
    ``output_router_logits`` in Qwen2-MoE) or an attribute a unit's forward sets (``side_channel``), used by the loss:
    remat ran the unit without a graph, so the loss's use of it gave no gradient (4e-3 to 6e-3 off plain PyTorch
    after one step, silently). Plain autograd keeps that gradient (the zoo passes these without remat); remat now
    refuses, naming the unit and the fixes, before any update. (Hugging Face's own checkpointing, non-reentrant,
    keeps the router logits' graph: the zoo's ``qwen2_moe_router_checkpointing`` trains as PyTorch at every stage.)"""
    entry = ZOO[name]
    if entry.hf:
        pytest.importorskip("transformers")
        loss = entry.loss
        entry = dataclasses.replace(entry, loss=lambda call, b: loss(lambda *a, **k: call(*a, use_cache=False, **k), b))
    entry = dataclasses.replace(entry, settings={**entry.settings, "remat": True})
    with pytest.raises(RuntimeError, match=r"(?s)fzero.remat: unit '[\w.]+' made 1 tensor\(s\) from its differentiable "
                                           r"arguments that outlive its forward.*no gradient through it.*remat=False.*"
                                           r"gradient_checkpointing_enable"):
        fzero_run(entry, stages=stages, ranks=1)


def test_fzero_remat_writes_buffers_once_at_stages_0_to_2():
    """``fzero.remat`` around a BatchNorm block inside loss_fn: the running statistics as without remat."""
    def run(use_remat, stages):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()

        def loss_fn(params, x):
            f = lambda p, x: fzero.apply(block, p, x)  # noqa: E731
            return (fzero.remat(f) if use_remat else f)(dict(params) if stages < 2 else
                                                         {k: params[k] for k in params}, x).pow(2).mean()

        step = fzero.compile(loss_fn, stages=stages, mesh=fzero.local_mesh(2) if stages else None)
        state = step.init(fzero.params_of(block))
        before = {k: v.clone() for k, v in block.state_dict().items()}
        for i in range(3):
            state, _ = step(state, torch.randn(8, 4, generator=torch.Generator().manual_seed(i)))
        assert all(torch.equal(v, before[k]) for k, v in block.state_dict(keep_vars=True).items())  # the recompute too
        return step.state_dict(state, block)

    for stages in (0, 1, 2):
        plain, rematted = run(False, stages), run(True, stages)
        assert int(rematted["1.num_batches_tracked"]) == 3
        for k in plain:
            torch.testing.assert_close(rematted[k], plain[k], rtol=0, atol=0)


class ReentrantCheckpointed(nn.Module):
    """An embedding, two blocks each run under ``torch.utils.checkpoint(use_reentrant=True)`` (as Hugging Face's
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})`` runs its layers) and a
    head. ``adapter``: the embedding frozen and its output made to require grad by a forward hook (Hugging Face's
    ``enable_input_require_grads``, which its checkpointing turns on), so that only the blocks and the head train, as
    a LoRA adapter with a trained classifier (peft's ``modules_to_save``) does."""

    def __init__(self, *, adapter: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)
        if adapter:
            self.embed.weight.requires_grad_(False)
            self.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return self.head(h).mean()


@pytest.mark.parametrize("ranks, stages", [(1, 0), (1, 1), (1, 2), (1, 3), (2, 3)])
@pytest.mark.parametrize("adapter", [True, False], ids=["frozen_embedding", "all_trainable"])
def test_reentrant_torch_checkpoint_is_refused_naming_the_fix(adapter, stages, ranks):
    """fzero takes the gradient with respect to the state's params only, so a reentrant checkpoint's backward
    (which recomputes the block and adds into each param's ``.grad``) cannot give it the block's gradients. Where the
    backward reaches it, torch refused with its own words (it knows neither fzero nor the Hugging Face switch);
    behind a frozen embedding (peft's LoRA under ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={
    "use_reentrant": True})``) autograd skipped it: the blocks got no gradient while the head trained, with no
    error and no warning (plain PyTorch trains both). Both now stop before any update, naming the non-reentrant
    switches and compile(remat=True)."""
    torch.manual_seed(0)
    model = ReentrantCheckpointed(adapter=adapter)
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.adamw(1e-2), stages=stages,
                         mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    named = r"so these params got no gradient: blocks\.0\.\w+, blocks\.0\.\w+, blocks\.1\.\w+ and 1 more" if adapter else ""
    with pytest.raises(RuntimeError, match=r"(?s)fzero\.Step: the model runs torch\.utils\.checkpoint with use_reentrant=True"
                                           rf"[,.] ?{named}.*before any update.*use_reentrant.: False.*remat=True"):
        step(state, torch.randint(0, 16, (4, 5)))


class FrozenCheckpointedBackbone(nn.Module):
    """A frozen backbone whose blocks run under reentrant checkpoints (one given as the module, one as a closure, as
    older Hugging Face code's ``create_custom_forward(module)``), its input made to require grad (Hugging Face's
    ``enable_input_require_grads``), a trained head, and a trainable pooler the loss never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.pooler = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.embed.requires_grad_(False)
        self.blocks.requires_grad_(False)
        self.embed.register_forward_hook(lambda module, args, out: out.requires_grad_(True))

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.blocks[0], self.embed(x), use_reentrant=True)

        def create_custom_forward(module):
            def custom_forward(h):
                return torch.tanh(module(h))
            return custom_forward

        h = torch.utils.checkpoint.checkpoint(create_custom_forward(self.blocks[1]), h, use_reentrant=True)
        return self.head(h).square().mean()


@pytest.mark.parametrize("ranks, stages", [(1, 0), (1, 3), (2, 2)])
def test_reentrant_checkpoint_of_a_frozen_block_beside_an_unused_param_trains_as_torch(stages, ranks):
    """Autograd skips the backward of a reentrant checkpoint whose block holds no trainable param, as it costs nothing:
    the params no gradient reached there (an unused pooler) are unused as in plain PyTorch, which trains the head and
    leaves the pooler. The refusal above was given here too, naming the pooler as the params the checkpoint starved."""
    torch.manual_seed(0)
    model = FrozenCheckpointedBackbone()
    xs = [torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for x in xs:
        opt.zero_grad()
        (sum(ref(part) for part in x.chunk(ranks)) / ranks).backward()  # DDP's mean over the ranks' shares
        opt.step()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.adamw(1e-2, weight_decay=0.0),
                         stages=stages, mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    for x in xs:
        state, _ = step(state, x)
    got = step.state_dict(state, model)
    assert not torch.equal(got["head.weight"], model.head.weight) and torch.equal(got["pooler.weight"], model.pooler.weight)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)


def _clamped(g):
    return g.clamp(-2e-3, 2e-3)  # not a rescale: AdamW's update is invariant to a gradient's scale, not to a clamp


class _HookInForward(nn.Module):
    """A block that registers a gradient hook on its weight in its forward: the way to change a param's gradient that
    fzero runs (on the tensor that step's forward reads; one hook per forward, none left over)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        if self.lin.weight.requires_grad:
            self.lin.weight.register_hook(_clamped)
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", STAGES)
def test_a_gradient_hook_on_the_modules_own_param_is_refused_by_name(stages, ranks):
    """``p.register_hook(fn)`` on the module's params (per-element clipping, a mask keeping an embedding's old rows
    frozen): fzero's gradient is of the state's tensors, so the hook never ran and the clamp was silently lost (4
    AdamW steps at lr 1e-2: 2.6e-2 off PyTorch on one rank). Refused, naming the param and the fix; evaluate (no
    gradient) still runs."""
    torch.manual_seed(0)
    model = TokenModel(Blocks()).train()
    model.body.blocks[1][0].weight.register_hook(_clamped)
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), stages=stages, mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    x = torch.randint(0, 64, (4, 8))
    with pytest.raises(ValueError, match=r"fzero.apply.*\['body.blocks.1.0.weight'\] of TokenModel carry gradient hooks"
                                         r".*never run.*self.weight.register_hook\(fn\)"):
        step(state, x)
    assert float(step.evaluate(state, x)["loss"]) > 0


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", STAGES)
def test_a_gradient_hook_registered_in_the_forward_trains_as_pytorch(stages, ranks):
    """The fix the refusal above names: the hook registered in the forward, on the param that forward reads."""
    entry = Entry(_seeded_hook_model, _tokens(64, seed=27), _lm_loss)
    check(entry, reference_run(entry, ranks), fzero_run(entry, stages=stages, ranks=ranks))


def _seeded_hook_model():
    torch.manual_seed(0)
    return TokenModel(Blocks(block=_HookInForward)).train()


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_a_module_applied_twice_in_one_loss_fn_trains_as_pytorch(stages, autodiff):
    """A per-image loop (a detector's images of their own sizes) or a siamese pair calls fzero.apply on one module
    more than once per forward. Under plain autograd at stages 0-1 the module holds the step's params from its first
    call until the backward, and those carry fzero's own gradient hooks: the second call was refused as if the user's
    params had hooks ("['weight', 'bias'] of Conv2d carry gradient hooks"), so no such model trained there."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 2, 1)
    reference = copy.deepcopy(model)  # (the model itself is behind the state after the step: a direct call refuses)
    images = [torch.randn(3, 4 + i, 5) for i in range(3)]

    def loss_fn(params, batch):
        return torch.stack([fzero.apply(model, params, img[None]).square().mean() for img in batch]).mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, autodiff=autodiff)
    state, metrics = step(step.init(fzero.params_of(model)), images)
    loss = torch.stack([reference(img[None]).square().mean() for img in images]).mean()
    loss.backward()
    assert float(metrics["loss"]) == pytest.approx(loss.item(), rel=1e-6)
    got = step.gather(state)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach() - 0.1 * p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stages", [0, 1, 2])
def test_a_module_applied_again_with_other_params_in_one_loss_fn_trains_as_pytorch(stages):
    """The second call of a module in one forward with params of its own making (first-order MAML's fast weights, a
    pair whose second half runs a masked weight) met, at stages 0-1, the step's tensors the module held from the first
    call: their hooks, fzero's own, were taken for the user's ("['weight', 'bias'] of Linear carry gradient hooks")."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    reference = nn.Linear(4, 1)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 4)

    def pair(run, params, x):
        inner = run(params, x[:4]).square().mean()
        grads = torch.autograd.grad(inner, list(params.values()))
        fast = {k: v - 0.1 * g.detach() for (k, v), g in zip(params.items(), grads)}  # first-order MAML
        return run(fast, x[4:]).square().mean()

    step = fzero.compile(lambda p, b: pair(lambda q, xx: fzero.apply(model, q, xx), p, b),
                         optimizer=fzero.optim.sgd(0.1), stages=stages)
    state, metrics = step(step.init(fzero.params_of(model)), x)
    pair(lambda q, xx: torch.func.functional_call(reference, q, (xx,)), dict(reference.named_parameters()), x).backward()
    got = step.gather(state)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach() - 0.1 * p.grad, rtol=1e-6, atol=1e-7)


# a forward hook on a unit, and one on a module inside another unit, each keeping what its module returned: the loss
# reads only those captures, never the tower's own output, as Llava reads the hidden state its vision_feature_layer
# picks (captured by transformers' output hooks on each encoder layer) and leaves the vision tower's output unused
_KEPT = threading.local()


def _keep(module, args, output):
    _KEPT.seen[module.__dict__["_tag"]] = output


class _Tower(nn.Module):
    def __init__(self, d: int = 16, vocab: int = 64) -> None:  # (post gets no gradient: None in torch, left as it is)
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(3)])
        self.post = nn.Linear(d, d)  # the tower's own output, which the loss leaves unused
        self.blocks[1].__dict__["_tag"] = "unit"  # the unit itself
        self.blocks[2][0].__dict__["_tag"] = "inner"  # a module inside the last unit
        self.blocks[1].register_forward_hook(_keep)
        self.blocks[2][0].register_forward_hook(_keep)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.post(h)


def _captures_loss(call, b):
    _KEPT.seen = {}
    call(b["input_ids"])
    features = _KEPT.seen["unit"] + _KEPT.seen["inner"]
    readout = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    return torch.nn.functional.cross_entropy(features.flatten(0, 1) @ readout, b["labels"].flatten())


def _tower():
    torch.manual_seed(0)
    return _Tower().train()


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", STAGES)
def test_a_hooks_capture_as_the_only_way_into_a_unit_trains_as_pytorch(stages, ranks):
    """At stage 3 a unit's buffer is refilled for its backward when the gradient reaches its return value; a tensor a
    forward hook kept (on the unit, or on a module inside it) leaves the unit beside it. Where the return value reaches
    nothing in the loss, the refill never came and the backward read the freed buffer: torch's bare "setStorage: sizes
    [16, 16] ... out of bounds for storage of size 0" (Hugging Face Llava at its default vision_feature_layer=-2 failed
    so at stage 3). Now what the hooks are handed refills the unit before its backward."""
    entry = Entry(_tower, _tokens(64, seed=3), _captures_loss)
    check(entry, reference_run(entry, ranks), fzero_run(entry, stages=stages, ranks=ranks))


@pytest.mark.parametrize("ranks", MESHES)
def test_a_hooks_capture_as_the_only_way_into_a_unit_under_torch_func_is_refused_by_name(ranks):
    """Under autodiff="func" no hook may gather in the backward (torch.func.grad refuses a collective there), so the
    case above cannot be trained at stage 3: the backward's read of the freed buffer is named with its cause and fixes
    (it was torch's bare "setStorage: ... out of bounds for storage of size 0")."""
    entry = Entry(_tower, _tokens(64, seed=3), _captures_loss, settings={"autodiff": "func"})
    with pytest.raises(RuntimeError, match=r'(?s)fzero.Step: the backward raised .*storage of size 0.*At stage 3 .*'
                                           r'reached nothing in it .*autodiff="autograd" trains that.*units=\.\.\. without it'):
        fzero_run(entry, stages=3, ranks=ranks)
    check(entry, reference_run(entry, ranks), fzero_run(entry, stages=2, ranks=ranks))


def _keep_input(module, args, output):
    _KEPT.seen[module.__dict__["_tag"]] = args[0]


def _keep_input_pre(module, args):
    _KEPT.seen[module.__dict__["_tag"]] = args[0]


class _InputTower(nn.Module):
    """A hook keeping its module's input, made inside the unit by the layers before it (transformers' output capture
    keeps the first layer's input as hidden_states[0]): a forward hook's ``args``, or a forward pre-hook's."""

    def __init__(self, pre: bool, d: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)) for _ in range(3)])
        self.post = nn.Linear(d, d)
        kept = self.blocks[1][2]
        kept.__dict__["_tag"] = "input"
        if pre:
            kept.register_forward_pre_hook(_keep_input_pre)
        else:
            kept.register_forward_hook(_keep_input)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.post(h)


def _input_loss(call, b):
    _KEPT.seen = {}
    call(b["input_ids"])
    readout = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    return torch.nn.functional.cross_entropy(_KEPT.seen["input"].flatten(0, 1) @ readout, b["labels"].flatten())


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("pre", [False, True], ids=["forward_hook_args", "forward_pre_hook"])
def test_a_hooks_captured_input_as_the_only_way_into_a_unit_trains_as_pytorch(pre, ranks):
    """As above, with the hook keeping its module's input rather than its output: only the output was watched, and a
    forward pre-hook not at all, so the backward read the unit's freed params (named as if the hook's capture were
    refilled for)."""
    def build():
        torch.manual_seed(0)
        return _InputTower(pre).train()

    entry = Entry(build, _tokens(64, seed=3), _input_loss)
    check(entry, reference_run(entry, ranks), fzero_run(entry, stages=3, ranks=ranks))


class _FrozenTower(nn.Module):
    def __init__(self, d: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)) for _ in range(3)])
        self.post = nn.Linear(d, d)
        self.blocks[1].requires_grad_(False)  # a unit of frozen params alone under frozen=
        self.blocks[1][0].__dict__["_tag"] = "frozen"
        self.blocks[1][0].register_forward_hook(_keep)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.post(h)


@pytest.mark.parametrize("ranks", MESHES)
def test_a_hooks_capture_as_the_only_way_into_a_unit_of_frozen_params_alone(ranks):
    """step.init(..., frozen=...) at stage 3: a unit of frozen params alone has no trainable views, and its hooks were
    not watched; where the loss reads only its hook's capture, the backward (to the embedding below it) read its freed
    frozen params. It trains as PyTorch now."""
    def loss_of(run):
        _KEPT.seen = {}
        run()
        readout = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
        return (_KEPT.seen["frozen"].flatten(0, 1) @ readout).pow(2).mean()

    torch.manual_seed(0)
    model = _FrozenTower()
    ref = copy.deepcopy(model)
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    expected = loss_of(lambda: ref(x))
    expected.backward()
    step = fzero.compile(lambda p, b: loss_of(lambda: fzero.apply(model, p, b)), optimizer=fzero.optim.sgd(0.1), stages=3,
                         mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model), frozen=fzero.frozen_of(model))
    state, metrics = step(state, x)
    torch.testing.assert_close(float(metrics["loss"]), expected.item(), rtol=1e-6, atol=1e-7)
    got = step.gather(state)
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[name], p.detach() - 0.1 * p.grad if p.grad is not None else p.detach(),
                                       rtol=1e-6, atol=1e-7)
