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
    assert shared(inner["fast"][0].mu, inner["slow"][0].mu) and shared(inner["fast"][0].nu, inner["slow"][0].nu)


def shared(a, b):
    """Two param-shaped trees whose tensors are the very same objects."""
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


@pytest.mark.parametrize("which", ["adamw_mask", "multi_transform"])
def test_disk_offload_sub_groups_that_cut_params_keep_the_groups(tmp_path, which):
    """Disk offload updates each shard in sub-groups of 200 elements, which cut through parameters."""
    if which == "adamw_mask":
        opt, reference = fo.adamw(LR, weight_decay=WD, mask=fo.decay_mask), decay_groups
    else:
        opt = fo.multi_transform({"fast": fo.adamw(FAST_LR, weight_decay=WD), "slow": fo.adamw(LR, weight_decay=0.0)}, labels)
        reference = two_lr_groups
    got, _, _ = fzero_run(opt, 3, fzero.DiskOffload(str(tmp_path), sub_group_size=200))
    assert_every_step_close(got, torch_run(reference))


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


def test_the_pure_update_path_on_shards_equals_torch_and_keeps_the_shared_state():
    """A chain around ``multi_transform`` has no fused step, so the step runs the pure ``update`` on the shards."""
    multi = fo.multi_transform({"fast": fo.adamw(FAST_LR, weight_decay=WD), "slow": fo.adamw(LR, weight_decay=0.0)}, labels)
    got, state, _ = fzero_run(fo.chain(fo.identity(), multi), 3, "cpu")
    assert_every_step_close(got, torch_run(two_lr_groups))
    for rank_state in state.states:
        inner = rank_state.opt_state[1].inner
        assert shared(inner["fast"][0].mu, inner["slow"][0].mu)  # one tensor for both groups, step after step


# -- on a params pytree directly (no train step) -------------------------------------------------------------------------


def pytree():
    g = torch.Generator().manual_seed(3)
    params = {"enc": {"w": torch.randn(5, 4, generator=g), "b": torch.randn(4, generator=g)},
              "ln_f": {"weight": torch.randn(4, generator=g)}, "wpe": {"weight": torch.randn(6, 4, generator=g)}}
    grads = [fo.apply_updates(params, params) for _ in range(3)]  # any values: 2 * params
    return params, grads


def test_on_a_pytree_each_group_gets_its_transform_and_fused_equals_pure():
    params, grads = pytree()
    opt = fo.multi_transform({"adam": fo.adamw(0.1, weight_decay=0.5), "sgd": fo.sgd(0.01), "frozen": fo.set_to_zero()},
                             {"enc": {"w": "adam", "b": "sgd"}, "ln_f": "frozen", "wpe": "adam"})  # a prefix: one label per subtree
    fused = {k: {n: t.clone() for n, t in v.items()} for k, v in params.items()}
    state = opt.init(fused)
    pure, pure_state = {k: {n: t.clone() for n, t in v.items()} for k, v in params.items()}, opt.init(params)
    adam = fo.adamw(0.1, weight_decay=0.5)
    alone = {"w": params["enc"]["w"].clone(), "wpe": params["wpe"]["weight"].clone()}
    adam_state = adam.init(alone)
    for g in grads:
        state = fo.apply_inplace(opt, g, state, fused)
        updates, pure_state = opt.update(g, pure_state, pure)
        pure = fo.apply_updates(pure, updates)
        adam_state = fo.apply_inplace(adam, {"w": g["enc"]["w"], "wpe": g["wpe"]["weight"]}, adam_state, alone)
    assert_trees_close(fused, pure, rtol=1e-6, atol=1e-7)
    assert torch.equal(fused["ln_f"]["weight"], params["ln_f"]["weight"])  # frozen
    torch.testing.assert_close(fused["enc"]["b"], params["enc"]["b"] - 0.01 * 2 * params["enc"]["b"] * 3)
    assert torch.equal(fused["enc"]["w"], alone["w"]) and torch.equal(fused["wpe"]["weight"], alone["wpe"])


def test_decay_mask_names_what_it_excludes():
    shapes = {
        "transformer.wte.weight": (50, 8), "transformer.wpe.weight": (16, 8), "transformer.h.0.ln_1.weight": (8,),
        "transformer.h.0.attn.c_attn.weight": (8, 24), "transformer.h.0.attn.c_attn.bias": (24,), "transformer.ln_f.weight": (8,),
        "model.layers.0.input_layernorm.weight": (8,), "model.norm.weight": (8,), "model.embed_tokens.weight": (50, 8),
        "bert.embeddings.LayerNorm.weight": (8,), "bert.embeddings.position_embeddings.weight": (16, 8),
        "model.decoder.embed_positions.weight": (18, 8), "vit.pos_embed": (1, 5, 8), "conv.bias": (3, 3),
        "blocks.0.norm1.weight": (2, 8), "mlp.fc.weight": (8, 8), "lm_head.weight": (50, 8),
    }
    mask = fo.decay_mask({k: torch.empty(s, device="meta") for k, s in shapes.items()})
    assert sorted(k for k, v in mask.items() if v) == [
        "lm_head.weight", "mlp.fc.weight", "model.embed_tokens.weight", "transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"]
    hf = fo.no_decay_names(["bias", "LayerNorm.weight"])({k: torch.empty(s, device="meta") for k, s in shapes.items()})
    assert [k for k, v in hf.items() if not v] == ["transformer.h.0.attn.c_attn.bias", "bert.embeddings.LayerNorm.weight", "conv.bias"]


# -- errors -------------------------------------------------------------------------------------------------------------


def init_error(opt, exc, match):
    """The step refuses a bad rule at ``step.init``, naming the API, the param and the fix."""
    model, loss_fn, _ = problem()
    step = fzero.compile(loss_fn, optimizer=opt, stages=3, mesh=fzero.local_mesh(2))
    with pytest.raises(exc, match=match):
        step.init(fzero.params_of(model))


def test_a_mask_of_the_wrong_structure_is_refused():
    init_error(fo.adamw(LR, mask={"wte.weight": True, "h": {"0": True}}), ValueError,
               r"fzero\.optim\.adamw: mask does not have the structure of the params pytree \(or of a prefix of it\); params it "
               r"does not cover .*'h\.0\.fc\.bias'.*; paths that are not params: 'h\.0'.*\n  params: PyTreeSpec.*\n  mask: .*"
               r"\nBuild it from the params")
    init_error(fo.masked(fo.add_decayed_weights(WD), lambda p: [True, False]), ValueError,
               r"fzero\.optim\.masked: the mask function returned a pytree that does not have the structure of the params")
    init_error(fo.adamw(LR, mask=lambda p: {k: v.ndim for k, v in p.items()}), TypeError,
               r"fzero\.optim\.adamw: mask must hold a bool for every param \(True: the param is decayed\); the param "
               r"'h\.0\.fc\.bias' has int 1")


def test_labels_naming_no_transform_are_refused():
    init_error(fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)}, lambda p: {k: "fats" for k in p}), ValueError,
               r"fzero\.optim\.multi_transform: the param 'h\.0\.fc\.bias' is labelled 'fats', which names no transform; transforms "
               r"has \['fast', 'slow'\]\. Add transforms\['fats'\], or label the param with one of those\.")


def test_a_param_without_a_label_is_refused():
    params = fzero.params_of(problem()[0])
    init_error(fo.multi_transform({"a": fo.adamw(LR)}, {**{k: "a" for k in params}, "head.bias": None}), ValueError,
               r"fzero\.optim\.multi_transform: labels does not have the structure .* params it does not cover \(a None leaf "
               r"covers none\): 'head\.bias'")
    init_error(fo.multi_transform({"a": fo.adamw(LR)}, lambda p: {k: 1 for k in p}), TypeError,
               r"labels must hold a str for every param \(a key of transforms: \['a'\]\); the param 'h\.0\.fc\.bias' has int 1")


def test_on_a_pytree_a_bad_mask_fails_at_the_first_update():
    params, grads = pytree()
    opt = fo.masked(fo.sgd(0.1), {"enc": True})
    state = opt.init(params)  # init may see a stand-in tree (the memory estimator's): no check there
    with pytest.raises(ValueError, match=r"fzero\.optim\.masked: mask does not have the structure .*'ln_f\.weight'"):
        opt.update(grads[0], state, params)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: fo.multi_transform({"a": None}, fo.decay_mask), TypeError,
         r"fzero\.optim\.multi_transform: transforms\['a'\] must be a GradientTransformation, got NoneType None\. To freeze "
         r"that group use fzero\.optim\.set_to_zero\(\)"),
        (lambda: fo.multi_transform({}, fo.decay_mask), TypeError, r"transforms must be a non-empty dict of label -> GradientTransformation"),
        (lambda: fo.multi_transform({1: fo.sgd(0.1)}, fo.decay_mask), TypeError, r"every label \(key of transforms\) must be a str, got int 1"),
        (lambda: fo.multi_transform(fo.sgd(0.1), fo.decay_mask), TypeError, r"transforms must be a non-empty dict"),
        (lambda: fo.masked(fo.sgd(0.1), None), TypeError, r"fzero\.optim\.masked: mask is required"),
        (lambda: fo.masked(fo.decay_mask, fo.sgd(0.1)), TypeError, r"fzero\.optim\.masked: inner must be a GradientTransformation"),
        (lambda: fo.adamw(LR, mask=fo.sgd(0.1)), TypeError, r"fzero\.optim\.adamw: mask is a GradientTransformation"),
        (lambda: fo.no_decay_names("bias"), TypeError, r"fzero\.optim\.no_decay_names: names must be a list of non-empty str"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# -- the DeepSpeed config reader: HF's no-decay list ------------------------------------------------------------------------


def read_with_no_decay(optimizer, no_decay):
    """``fzero.config.from_deepspeed`` with a ``no_decay`` argument (it refuses one the config does not use)."""
    from fzero.config import from_deepspeed

    cfg = {"optimizer": optimizer, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    return from_deepspeed(cfg, no_decay=no_decay)


HF_NO_DECAY = ["bias", "ln"]  # this model's LayerNorms are named ln / ln_f


def hf_groups(names):
    decay = [n for n in names if not any(s in n for s in HF_NO_DECAY)]
    return [(decay, LR, WD), ([n for n in names if n not in decay], LR, 0.0)]


def test_config_adamw_with_a_no_decay_list_equals_torch_with_two_param_groups():
    settings = read_with_no_decay({"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, HF_NO_DECAY)
    assert "mask=fzero.optim.no_decay_names(['bias', 'ln'])" in settings.optimizer_description
    got, _, _ = fzero_run(settings.optimizer, 2, "cpu")
    assert_every_step_close(got, torch_run(hf_groups))


@pytest.mark.parametrize("optimizer", [
    {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False}},  # L2: decay added to the gradient
    {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}},
    {"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0.5, "momentum": 0.9}},
    {"type": "Lion", "params": {"lr": 0.1, "weight_decay": 0.5}},
])
def test_config_maps_no_decay_for_adam_sgd_and_lion(optimizer):
    """Each param as the same config would train it alone: with its weight decay if decayed, with 0 if not."""
    from fzero.config._read import read_config

    def run(opt, params, grads):
        params = {k: v.clone() for k, v in params.items()}
        state = opt.init(params)
        for g in grads:
            state = fo.apply_inplace(opt, {k: g[k] for k in params}, state, params)
        return params

    def plain(wd):
        cfg = {"optimizer": {**optimizer, "params": {**optimizer["params"], "weight_decay": wd}},
               "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
        return read_config(cfg, {}, None)[0].optimizer

    tree, grads = pytree()
    params, grads = tree["enc"], [g["enc"] for g in grads]
    got = run(read_with_no_decay(optimizer, ["b"]).optimizer, params, grads)
    torch.testing.assert_close(got["w"], run(plain(0.5), {"w": params["w"]}, grads)["w"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got["b"], run(plain(0.0), {"b": params["b"]}, grads)["b"], rtol=1e-6, atol=1e-7)
    assert (got["b"] - run(plain(0.5), {"b": params["b"]}, grads)["b"]).abs().max() > 1e-3  # the decay would show


def test_config_refuses_what_it_cannot_map():
    with pytest.raises(NotImplementedError, match=r"fzero\.config\.from_deepspeed: no_decay=\['bias'\] asks for a no-decay "
                                                  r"parameter group, but fzero's lamb .* cannot be masked"):
        read_with_no_decay({"type": "Lamb", "params": {"lr": 0.1, "weight_decay": 0.01}}, ["bias"])
    with pytest.raises(TypeError, match=r"fzero\.config\.from_deepspeed: no_decay must be a list of parameter-name substrings .* "
                                        r"got 'bias'"):
        read_with_no_decay({"type": "AdamW", "params": {"lr": 0.1}}, "bias")
    settings = read_with_no_decay({"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}, ["bias"])
    assert any(n.startswith("no_decay=['bias']: no effect") for n in settings.notes)


# -- params without a gradient (torch's grad=None) skip the step in their group ---------------------------------------


def unused_reference(groups_of, ranks):
    """torch.optim.AdamW with param groups on tests/test_unused.py's Net, fed DDP's gradients (None where no rank used it)."""
    import test_unused as tu

    case = tu.CASES["net"]
    model = case.build()
    leaves = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([{"params": [leaves[n] for n in names], "lr": lr, "weight_decay": wd}
                             for names, lr, wd in groups_of(list(leaves))])
    out, used = [], []
    for batch in case.batches():
        grads = tu.ddp_grads(case, model, {n: p.detach() for n, p in leaves.items()}, batch, ranks)
        used.append({n for n, g in grads.items() if g is not None})
        for n, p in leaves.items():
            p.grad = grads[n]
        opt.step()
        out.append({n: p.detach().clone() for n, p in leaves.items()})
    return tu.Reference(out, used)


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_params_without_a_gradient_skip_the_step_in_their_group(stages):
    import test_unused as tu

    def weights_vs_biases(names):
        return [([n for n in names if n.endswith("weight")], 1e-2, 0.1), ([n for n in names if not n.endswith("weight")], 3e-2, 0.0)]

    opt = fo.multi_transform({"w": fo.adamw(1e-2, weight_decay=0.1), "b": fo.adamw(3e-2, weight_decay=0.0)},
                             lambda p: {k: "w" if k.endswith("weight") else "b" for k in p})
    case = tu.CASES["net"]
    model = case.build()
    step = fzero.compile(lambda params, b: case.loss(lambda *a, **k: fzero.apply(model, params, *a, **k), b), optimizer=opt,
                         stages=stages, mesh=fzero.local_mesh(2), **({"unit_elements": 1024} if stages < 2 else {}))
    state, history = step.init(fzero.params_of(model)), []
    for batch in case.batches():
        state, _ = step(state, batch)
        history.append(step.gather(state))
    ref = unused_reference(weights_vs_biases, 2)
    assert not any("heads.unused.bias" in u for u in ref.used) and not all("side.bias" in u for u in ref.used)
    tu.assert_matches(history, ref, f"multi_transform at stage {stages}")


def test_a_state_given_to_a_step_whose_labels_moved_a_param_is_refused_and_the_fix_trains():
    """A notebook compiles its step again with new ``multi_transform`` labels and gives it the old state: before, it
    trained without a word, the moved layer starting its AdamW from SGD's momentum and a second moment of zeros (5.6
    off after one step at lr 1e-3), where ``checkpoint.load`` of the same state refuses the move. The labels of the
    step that made the state are compared, at every stage; the same labels (a step compiled again unchanged) pass."""
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([4, 8, 8, 2])

    def step_with(first: str, stages: int):
        opt = fo.multi_transform({"sgd": fo.sgd(0.1, momentum=0.9), "adamw": fo.adamw(1e-3)},
                                 lambda p: {k: first if k.startswith("layers.0") else "adamw" for k in p})
        return fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=opt,
                             stages=stages, mesh=fzero.local_mesh(2))

    batch = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), "y": torch.zeros(8, 2)}
    for stages in (0, 3):
        old = step_with("sgd", stages)
        state, _ = old(old.init(fzero.params_of(model)), batch)
        again, _ = step_with("sgd", stages)(state, batch)  # compiled again, the same labels: trains on
        moved = step_with("adamw", stages)
        with pytest.raises(ValueError, match=r"^fzero\.Step\.__call__: params changed group since the step that made this "
                                             r"state: 'layers\.0\.bias' from 'sgd' to 'adamw'; 'layers\.0\.weight' from "
                                             r"'sgd' to 'adamw'\. .* new_step\.init\(old_step\.gather\(state\)\)"):
            moved(again, batch)
        moved(moved.init(old.gather(again)), batch)  # the fix


def test_a_state_whose_groups_no_longer_share_their_adam_state_is_refused_when_a_step_compiled_again_moves_a_layer(tmp_path):
    """Two ``adamw`` groups of other learning rates share one Adam state, so a step compiled again with a layer moved
    from one to the other follows the move (``test_a_step_compiled_again_or_a_checkpoint_loaded_with_labels_that_move_a_layer_to_another_lr_group_follows_it_as_torch``).
    A state copied leaf by leaf (each group's moments a tensor of its own) and trained on holds stale moments for the
    layer in its new group: following the move there was 7.2e-3 off torch.optim after 2 steps. Refused, as a labels
    function's move is judged on the state it is given, and so is a checkpoint of it loaded into that step (its
    ``fzero.json`` records that the groups' entries are apart); the state that still shares its tensors follows."""
    import dataclasses

    import optree
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([4, 8, 8, 2])
    batch = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), "y": torch.zeros(8, 2)}

    def step_with(first: str):
        opt = fo.multi_transform({"slow": fo.adamw(1e-4), "fast": fo.adamw(1e-2)},
                                 lambda p: {k: first if k.startswith("layers.0") else "fast" for k in p})
        return fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=opt,
                             stages=0, mesh=fzero.local_mesh(2))

    def copied(s):
        return dataclasses.replace(s, opt_state=optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, s.opt_state))

    old = step_with("slow")
    state, _ = old(old.init(fzero.params_of(model)), batch)
    apart, _ = old(type(state)(tuple(copied(s) for s in state.states)), batch)
    with pytest.raises(ValueError, match=r"^fzero\.Step\.__call__: params changed group since the step that made this "
                                         r"state: 'layers\.0\.bias' from 'slow' to 'fast'; 'layers\.0\.weight' from "
                                         r"'slow' to 'fast'\. "):
        step_with("fast")(apart, batch)
    path = fzero.checkpoint.save(tmp_path / "apart", apart)  # its checkpoint: each group's entry apart, refused alike
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"params changed group since the checkpoint .* was saved: "
                                                               r"'layers\.0\.bias' from 'slow' to 'fast'; "):
        fzero.checkpoint.load(path, like=step_with("fast"))
    state, _ = old(state, batch)
    step_with("fast")(state, batch)  # one Adam state: the move is followed


def test_a_masked_adam_whose_mask_let_a_param_in_since_the_state_was_made_is_refused():
    """optax's ``masked(adam, mask)`` keeps Adam's moments for every param, zeros for those the mask passed through. A
    step compiled again with a wider mask, given the old state, started the newly masked layer from moments of zeros
    against the step count: 9.9e-3 off ``torch.optim.Adam.add_param_group`` after 2 steps, without a word. Refused as
    a moved ``multi_transform`` label is; a mask over a stateless transform (``adamw(mask=decay_mask)``'s decay) may
    change, as a torch group's weight decay may."""
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([4, 8, 8, 2])
    batch = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), "y": torch.zeros(8, 2)}

    def step_with(opt):
        return fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=opt, stages=1,
                             mesh=fzero.local_mesh(2))

    def adam_on(first: bool):
        return fo.chain(fo.masked(fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(1e-2)),
                                  lambda p: {k: first or not k.startswith("layers.0") for k in p}),
                        fo.masked(fo.set_to_zero(), lambda p: {k: not first and k.startswith("layers.0") for k in p}))

    old = step_with(adam_on(False))
    state, _ = old(old.init(fzero.params_of(model)), batch)
    with pytest.raises(ValueError, match=r"params changed group since the step that made this state: 'layers\.0\.bias' "
                                         r"from 'passed through' to 'masked'"):
        step_with(adam_on(True))(state, batch)
    decay = step_with(fo.adamw(1e-2, weight_decay=0.1, mask=fo.decay_mask))
    state, _ = decay(decay.init(fzero.params_of(model)), batch)
    step_with(fo.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: True for k in p}))(state, batch)  # decay widened: trains


# -- a labels / mask function whose answer changes between steps ---------------------------------------------------------


def torch_run_moving(groups_at, *, move_at=2):
    """torch.optim.AdamW whose param groups are ``groups_at(before)`` (``[(names, lr, weight_decay)]``) up to step
    ``move_at`` and ``groups_at(False)`` from there on, the params moved between ``param_groups`` entries as a loop
    does (``state[p]`` kept)."""
    model, loss_fn, batches = problem()
    params = {k: v.clone().requires_grad_() for k, v in fzero.params_of(model).items()}
    opt = torch.optim.AdamW([{"params": [params[n] for n in names], "lr": lr, "weight_decay": wd}
                             for names, lr, wd in groups_at(True)], fused=True)
    history = []
    for i, b in enumerate(batches):
        if i == move_at:
            for group, (names, lr, wd) in zip(opt.param_groups, groups_at(False)):
                group["params"] = [params[n] for n in names]
        opt.zero_grad(set_to_none=True)
        loss_fn(params, b).backward()
        opt.step()
        history.append({k: v.detach().clone() for k, v in params.items()})
    return history


def moving_run(opt, before, stages, *, move_at=2, **settings):
    """fzero's params after each step, ``before["on"]`` (read by the rule function) turned False before ``move_at``."""
    model, loss_fn, batches = problem()
    step = fzero.compile(loss_fn, optimizer=opt, stages=stages, mesh=fzero.local_mesh(2),
                         **({"unit_elements": 1024} if stages < 2 else {}), **settings)
    state, history = step.init(fzero.params_of(model)), []
    for i, b in enumerate(batches):
        before["on"] = before["on"] and i != move_at
        state, _ = step(state, b)
        history.append(step.gather(state))
    return history


@pytest.mark.parametrize("stages, donate", [(0, True), (3, False)])
def test_a_labels_function_that_moves_a_layer_to_another_lr_group_is_followed_as_torch_moves_its_param_group(stages, donate):
    """optax calls a labels function at every update; a notebook's layer-wise lr groups (``group_of`` edited between
    calls) or a schedule of groups may answer otherwise later. Before, fzero kept its first answer for good, silently:
    the head moved from the slow group to the fast one trained on at the slow lr (4.1e-3 off torch.optim after 4
    AdamW steps here). Between groups of one transform type (their Adam state is shared), the move is followed, as
    torch.optim keeps ``state[p]`` when a param changes ``param_groups``; also with ``donate=False``, whose copy of
    the state keeps the groups' one Adam state one (copied leaf by leaf, each group had its own, and the move was
    refused)."""
    before = {"on": True}
    mask = fo.decay_mask(fzero.params_of(problem()[0]))

    def group(name: str, on: bool) -> str:
        return "slow" if name.startswith("head.") and on or not mask[name] else "fast"

    opt = fo.multi_transform({"fast": fo.adamw(FAST_LR, weight_decay=WD), "slow": fo.adamw(LR, weight_decay=WD)},
                             lambda p: {k: group(k, before["on"]) for k in p})

    def groups_at(on):
        names = list(mask)
        return [([n for n in names if group(n, on) == "fast"], FAST_LR, WD), ([n for n in names if group(n, on) == "slow"], LR, WD)]

    assert_every_step_close(moving_run(opt, before, stages, donate=donate), torch_run_moving(groups_at))


def recompiled_run(opt_at, stages, how, tmp_path, *, move_at=2):
    """fzero's params after each step: ``opt_at(True)`` up to step ``move_at``, then a step compiled again with
    ``opt_at(False)`` given the state (``how="state"``) or loading a checkpoint saved by the first (``"checkpoint"``)."""
    model, loss_fn, batches = problem()

    def compiled(on):
        return fzero.compile(loss_fn, optimizer=opt_at(on), stages=stages, mesh=fzero.local_mesh(2),
                             **({"unit_elements": 1024} if stages < 2 else {}))

    step = compiled(True)
    state, history = step.init(fzero.params_of(model)), []
    for i, b in enumerate(batches):
        if i == move_at:
            new = compiled(False)
            if how == "checkpoint":
                fzero.checkpoint.save(str(tmp_path / "ckpt"), state)
                state = fzero.checkpoint.load(str(tmp_path / "ckpt"), like=new)
            step = new
        state, _ = step(state, b)
        history.append(step.gather(state))
    return history


@pytest.mark.parametrize("stages, how", [(0, "state"), (3, "state"), (0, "checkpoint"), (3, "checkpoint")])
def test_a_step_compiled_again_or_a_checkpoint_loaded_with_labels_that_move_a_layer_to_another_lr_group_follows_it_as_torch(
        stages, how, tmp_path):
    """The move a labels function makes between steps (the head from the slow AdamW group to the fast one) made by
    compiling the step again with the new labels and giving it the state, or by loading a checkpoint into that step:
    before, refused ("params changed group") although the groups share one Adam state and the move is exact, where the
    labels function's move is followed. Judged by the same rule (``Groups.refused``): followed, as torch.optim keeps
    ``state[p]`` when a param changes ``param_groups``; a move the state cannot follow is still refused
    (``test_a_state_given_to_a_step_whose_labels_moved_a_param_is_refused_and_the_fix_trains``)."""
    mask = fo.decay_mask(fzero.params_of(problem()[0]))

    def group(name: str, on: bool) -> str:
        return "slow" if name.startswith("head.") and on or not mask[name] else "fast"

    def opt_at(on):
        return fo.multi_transform({"fast": fo.adamw(FAST_LR, weight_decay=WD), "slow": fo.adamw(LR, weight_decay=WD)},
                                  {k: group(k, on) for k in mask})

    def groups_at(on):
        names = list(mask)
        return [([n for n in names if group(n, on) == "fast"], FAST_LR, WD), ([n for n in names if group(n, on) == "slow"], LR, WD)]

    assert_every_step_close(recompiled_run(opt_at, stages, how, tmp_path), torch_run_moving(groups_at))


def test_a_labels_function_that_moves_a_param_where_its_state_cannot_follow_is_refused_before_the_step():
    """Gradual unfreezing by labels (``set_to_zero()`` to AdamW) or a layer moved from SGD-momentum to AdamW: the
    param's state in its new group is not that transform's (moments of zeros against the group's step count; SGD's
    momentum read as Adam's first moment). Before, the first labels were kept for good and the layer stayed frozen
    without a word (2e-2 off ``torch.optim.AdamW.add_param_group`` after 2 steps). Refused by name before the step
    writes anything: the state trains on once the function answers as before, and the fix (a new optimizer, its state
    started from the params) trains."""
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([4, 8, 8, 2])
    batch = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), "y": torch.zeros(8, 2)}
    group_of = {"layers.0.weight": "frozen", "layers.0.bias": "frozen"}

    def step_with(transforms, stages):
        opt = fo.multi_transform(transforms, lambda p: {k: group_of.get(k, "train") for k in p})
        return fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), optimizer=opt,
                             stages=stages, mesh=fzero.local_mesh(2))

    for stages, frozen in ((0, fo.set_to_zero()), (3, fo.sgd(0.1, momentum=0.9))):
        group_of.update({"layers.0.weight": "frozen", "layers.0.bias": "frozen"})
        step = step_with({"frozen": frozen, "train": fo.adamw(1e-3)}, stages)
        state, _ = step(step.init(fzero.params_of(model)), batch)
        group_of.update({"layers.0.weight": "train", "layers.0.bias": "train"})
        with pytest.raises(ValueError, match=r"^fzero\.optim\.multi_transform: the labels function now puts params in other "
                                             r"groups than it did for this optimizer's state: 'layers\.0\.bias' from 'frozen' "
                                             r"to 'train'; 'layers\.0\.weight' from 'frozen' to 'train'\. .*The params were "
                                             r"not updated\. .*new_step\.init\(step\.gather\(state\)\)"):
            step(state, batch)
        trained = step.gather(state)  # the state is whole
        new = step_with({"frozen": frozen, "train": fo.adamw(1e-3)}, stages)  # the fix: a new optimizer, a new state
        new(new.init(trained), batch)
        group_of.update({"layers.0.weight": "frozen", "layers.0.bias": "frozen"})
        step(state, batch)  # the function answers as before: the old state trains on


def test_a_mask_function_that_changes_is_followed_where_no_state_depends_on_it_and_refused_where_it_does():
    """``adamw(mask=fn)``'s decay mask and ``masked(add_decayed_weights(wd), fn)`` hold no state: a mask that decays
    the head from step 2 on is followed, as torch.optim's loop moving the head to its decayed group (before: kept
    undecayed, 5.0e-5 off after 4 steps). ``masked`` over Adam keeps moments for every param: a param let in later
    would start from zeros against the count, so that is refused; one let out passes its update through (optax's
    ``masked``), and is followed."""
    before = {"on": True}
    mask = fo.decay_mask(fzero.params_of(problem()[0]))

    def decayed(name: str) -> bool:
        return mask[name] and not (name.startswith("head.") and before["on"])

    def groups_at(on):
        def decays(n):
            return mask[n] and not (n.startswith("head.") and on)
        return [([n for n in mask if decays(n)], LR, WD), ([n for n in mask if not decays(n)], LR, 0.0)]

    expected = torch_run_moving(groups_at)
    assert_every_step_close(moving_run(fo.adamw(LR, weight_decay=WD, mask=lambda p: {k: decayed(k) for k in p}), before, 1),
                            expected)
    before["on"] = True
    chained = fo.chain(fo.scale_by_adam(), fo.masked(fo.add_decayed_weights(WD), lambda p: {k: decayed(k) for k in p}),
                       fo.scale_by_learning_rate(LR))
    assert_every_step_close(moving_run(chained, before, 3), expected)

    before["on"] = True
    adam = fo.chain(fo.masked(fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(LR)),
                              lambda p: {k: not k.startswith("head.") or not before["on"] for k in p}),
                    fo.masked(fo.set_to_zero(), lambda p: {k: k.startswith("head.") and before["on"] for k in p}))
    with pytest.raises(ValueError, match=r"^fzero\.optim\.masked: the mask function now puts params in other groups than "
                                         r"it did for this optimizer's state: 'head\.bias' from 'passed through' to 'masked'"):
        moving_run(adam, before, 2)
    inside = {"on": True}
    out = fo.masked(fo.chain(fo.scale_by_adam(), fo.scale_by_learning_rate(LR)), lambda p: {k: inside["on"] for k in p})
    moving_run(out, inside, 0)  # every param let out at step 2: followed


def test_a_labels_function_is_called_with_the_same_stand_ins_at_every_stage():
    """Under a train step the function is called on meta tensors of each param's shape (not the module's params,
    whose ``requires_grad`` or device a function might read), the same at stages 0-3: one answer at every stage."""
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([4, 8, 8, 2])
    batch = {"x": torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), "y": torch.zeros(8, 2)}
    seen = {}
    for stages in (0, 1, 2, 3):
        def labels(p, stages=stages):
            seen.setdefault(stages, set()).add(tuple((k, v.device.type, v.dtype, tuple(v.shape), v.requires_grad) for k, v in p.items()))
            return {k: "a" if v.ndim > 1 else "b" for k, v in p.items()}

        step = fzero.compile(lambda p, b: ((fzero.apply(model, p, b["x"]) - b["y"]) ** 2).mean(), stages=stages,
                             optimizer=fo.multi_transform({"a": fo.adamw(1e-3), "b": fo.adamw(1e-2)}, labels), mesh=fzero.local_mesh(2))
        step(step.init(fzero.params_of(model)), batch)
    assert all(views == seen[0] for views in seen.values()) and len(seen[0]) == 1
    assert {device for k, device, *_ in next(iter(seen[0]))} == {"meta"}


def _groups_on_disk_and_in_memory(tmp_path):
    """Two ``adamw`` groups (``head.weight`` faster) at stage 3 on ``local_mesh(2)``, trained 2 steps under
    ``offload='disk'`` (each group's state in files of its own) and in memory (one Adam state the groups share):
    (disk step, memory step, their states, the optimizer's maker, loss_fn, the batches)."""
    model, loss_fn, batches = problem()

    def opt():
        return fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)},
                                  lambda p: {k: "fast" if k == "head.weight" else "slow" for k in p})

    (tmp_path / "run").mkdir()
    disk = fzero.compile(loss_fn, optimizer=opt(), stages=3, mesh=fzero.local_mesh(2), offload="disk",
                         offload_dir=str(tmp_path / "run"))
    memory = fzero.compile(loss_fn, optimizer=opt(), stages=3, mesh=fzero.local_mesh(2))
    on_disk, in_memory = disk.init(fzero.params_of(model)), memory.init(fzero.params_of(model))
    for b in batches[:2]:
        on_disk, _ = disk(on_disk, b)
        in_memory, _ = memory(in_memory, b)
    return disk, memory, on_disk, in_memory, opt, loss_fn, batches


def test_a_disk_checkpoint_of_groups_kept_apart_is_refused_by_a_step_whose_groups_share_their_state(tmp_path):
    """Under ``offload='disk'`` each ``multi_transform`` group keeps its optimizer state in files of its own, each
    holding that group's values for its own params only; in memory two ``adamw`` groups share one Adam state. Loaded
    from the one into the other, each group's entries were written over the shared tensor in turn, so params resumed
    with the other group's moments: 4.2e-3 off the run that never stopped, after one step, silently. Refused, naming
    both ways that load it; the disk step resumes it exactly, and a checkpoint of the in-memory state loads into it."""
    disk, memory, on_disk, in_memory, opt, loss_fn, batches = _groups_on_disk_and_in_memory(tmp_path)
    saved = fzero.checkpoint.save(tmp_path / "disk_ck", on_disk)
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"keeps each parameter group's optimizer state apart.*"
                                                               r"Load it into a step with offload='disk'"):
        fzero.checkpoint.load(saved, like=memory)
    (tmp_path / "again").mkdir()
    again = fzero.compile(loss_fn, optimizer=opt(), stages=3, mesh=fzero.local_mesh(2), offload="disk",
                          offload_dir=str(tmp_path / "again"))
    resumed, _ = again(fzero.checkpoint.load(saved, like=again), batches[2])
    in_memory, _ = memory(in_memory, batches[2])
    from_memory = fzero.checkpoint.load(fzero.checkpoint.save(tmp_path / "mem_ck", in_memory), like=disk)
    assert_trees_close(again.gather(resumed), memory.gather(in_memory), rtol=0, atol=1e-6)
    assert_trees_equal(disk.gather(from_memory), memory.gather(in_memory))


def _without_groups_share_state(path) -> None:
    """The checkpoint at ``path`` as an fzero that did not record ``groups_share_state`` wrote it: the key removed
    from its ``fzero.json``, the marker's checksums written again."""
    import json
    import os

    from fzero.checkpoint._verify import crc32_file, marker_bytes

    info = json.loads((path / "fzero.json").read_text())
    del info["groups_share_state"]
    (path / "fzero.json").write_text(json.dumps(info))
    (path / "COMPLETE").write_bytes(marker_bytes(str(path), {f: crc32_file(str(path / f)) for f in os.listdir(path) if f != "COMPLETE"}))


def test_a_disk_checkpoint_saved_before_groups_share_state_is_judged_by_the_values_it_holds(tmp_path):
    """A checkpoint saved before ``fzero.json`` recorded ``groups_share_state`` (made here by saving one and removing
    the key from its ``fzero.json``) does not say whether its ``multi_transform`` groups shared their Adam state. One
    saved under ``offload='disk'`` (each group's moments in files of their own, each holding its own params' values)
    loaded into an in-memory step whose two ``adamw`` groups share one tensor: each group's entries were read over
    the one tensor, so params resumed with the other group's moments, 4.2e-3 off the run that never stopped after one
    step, silently. Judged by what it holds: the groups' entries differ, so it is refused, naming the entries and
    params; the disk step resumes it exactly, and an old checkpoint of the in-memory state (its entries alike) loads
    into the in-memory step exactly, unrefused."""
    disk, memory, on_disk, in_memory, opt, loss_fn, batches = _groups_on_disk_and_in_memory(tmp_path)
    from_disk, from_memory = (fzero.checkpoint.save(tmp_path / name, s) for name, s in (("disk", on_disk), ("mem", in_memory)))
    _without_groups_share_state(tmp_path / "disk")
    _without_groups_share_state(tmp_path / "mem")
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"keeps each parameter group's optimizer state apart: its "
                                                               r"entries 'opt/inner\.fast\.0\.mu' and 'opt/inner\.slow\.0\.mu' "
                                                               r"hold different values for 'h\.0\.fc\.bias'.*"
                                                               r"Load it into a step with offload='disk'"):
        fzero.checkpoint.load(from_disk, like=memory)
    expected = memory.gather(memory(in_memory, batches[2])[0])
    resumed = fzero.checkpoint.load(from_memory, like=memory)
    assert_trees_equal(memory.gather(memory(resumed, batches[2])[0]), expected)
    (tmp_path / "again").mkdir()
    again = fzero.compile(loss_fn, optimizer=opt(), stages=3, mesh=fzero.local_mesh(2), offload="disk",
                          offload_dir=str(tmp_path / "again"))
    resumed = fzero.checkpoint.load(from_disk, like=again)
    assert_trees_close(again.gather(again(resumed, batches[2])[0]), expected, rtol=0, atol=1e-6)


def test_a_disk_checkpoint_whose_groups_entries_are_still_alike_loads_into_a_step_whose_groups_share_them(tmp_path):
    """A disk-offload checkpoint saved before its groups' entries diverged (before the first step: every group's
    moments zeros) holds what one shared Adam state holds, so it loads into an in-memory step and trains on exactly
    as that step's own state. Before, its recorded ``groups_share_state`` (False) refused it before reading anything."""
    model, loss_fn, batches = problem()
    opt = lambda: fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)},  # noqa: E731
                                     lambda p: {k: "fast" if k == "head.weight" else "slow" for k in p})
    disk = fzero.compile(loss_fn, optimizer=opt(), stages=3, mesh=fzero.local_mesh(2), offload="disk",
                         offload_dir=str(tmp_path))
    memory = fzero.compile(loss_fn, optimizer=opt(), stages=3, mesh=fzero.local_mesh(2))
    saved = fzero.checkpoint.save(tmp_path / "ck", disk.init(fzero.params_of(model)))
    resumed, _ = memory(fzero.checkpoint.load(saved, like=memory), batches[0])
    own, _ = memory(memory.init(fzero.params_of(model)), batches[0])
    assert_trees_equal(memory.gather(resumed), memory.gather(own))


def test_a_move_between_lr_groups_under_disk_offload_is_refused_before_the_step(tmp_path):
    """Disk offload keeps each group's tensors in files of their own: the group a param moves to never updated its
    elements there, so the move is refused, before the step (the state trains on once the function answers as before);
    and so is the same move made by a step compiled again with the new labels, or by loading a checkpoint of that
    state (its groups' entries diverged in their files), where a state in memory follows it."""
    model, loss_fn, batches = problem()
    group_of = {}
    opt = fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)}, lambda p: {k: group_of.get(k, "slow") for k in p})
    step = fzero.compile(loss_fn, optimizer=opt, stages=3, mesh=fzero.local_mesh(2), offload="disk", offload_dir=str(tmp_path))
    state, _ = step(step.init(fzero.params_of(model)), batches[0])
    group_of["head.weight"] = "fast"
    with pytest.raises(ValueError, match=r"'head\.weight' from 'slow' to 'fast'\. .*The params were not updated"):
        step(state, batches[1])
    del group_of["head.weight"]
    state, _ = step(state, batches[1])
    # the same move by a step compiled again with the new labels, or by a checkpoint of the disk state: refused alike
    moved = fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)}, lambda p: {k: "fast" if k == "head.weight" else "slow" for k in p})
    (tmp_path / "again").mkdir()
    again = fzero.compile(loss_fn, optimizer=moved, stages=3, mesh=fzero.local_mesh(2), offload="disk", offload_dir=str(tmp_path / "again"))
    with pytest.raises(ValueError, match=r"^fzero\.Step\.__call__: params changed group since the step that made this state: "
                                         r"'head\.weight' from 'slow' to 'fast'\. "):
        again(state, batches[2])
    path = fzero.checkpoint.save(tmp_path / "ck", state)
    in_memory = fzero.compile(loss_fn, optimizer=moved, stages=3, mesh=fzero.local_mesh(2))
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"params changed group since the checkpoint .* was saved: "
                                                               r"'head\.weight' from 'slow' to 'fast'\. "):
        fzero.checkpoint.load(path, like=in_memory)


def _on_rank1() -> bool:
    """Whether the caller runs as rank 1 of a ``local_mesh`` (its rank thread's name): what a labels function that
    reads ``torch.distributed.get_rank()`` under torchrun reads."""
    import threading

    return threading.current_thread().name == "fzero-rank1"


def rank_dependent_labels(params):
    return {k: "fast" if k == "head.weight" and not _on_rank1() else "slow" for k in params}


def rank_dependent_mask(params):
    return {k: not (k == "head.weight" and _on_rank1()) for k in params}


@pytest.mark.parametrize("stages, disk", [(0, False), (3, False), (3, True)])
@pytest.mark.parametrize("which", ["labels", "mask"])
def test_a_labels_function_that_answers_otherwise_on_each_rank_is_refused_naming_it(tmp_path, stages, disk, which):
    """Every rank calls a labels (or mask) function itself, as each torchrun process does. One that reads rank-dependent
    state (here the rank thread's name, standing for ``torch.distributed.get_rank()``) gave each rank its own groups:
    on local_mesh(2) each rank updated ``head.weight`` with another learning rate (or decay), silently: at stage 0
    the ranks' replicas drifted apart (6.0e-3 after 3 AdamW steps; 7.5e-5 for the decay mask), at stage 1 the
    gathered params were 6.0e-3 off (rank 1's shard holds part of it; at stage 3 here rank 0's holds all of it, by
    the layout's chance); under an SGD group it was refused as a change over time that nothing made. Now the ranks
    compare their answers at each update and refuse, naming the function and the param, before the update writes
    anything; under disk offload, whose update runs sub-group by sub-group, at its first sub-group."""
    model, loss_fn, batches = problem()
    if which == "labels":
        opt, name = fo.multi_transform({"fast": fo.adamw(FAST_LR), "slow": fo.adamw(LR)}, rank_dependent_labels), "labels"
    else:
        opt, name = fo.adamw(LR, weight_decay=WD, mask=rank_dependent_mask), "mask"
    offload = fzero.DiskOffload(str(tmp_path), sub_group_size=256) if disk else None
    step = fzero.compile(loss_fn, optimizer=opt, stages=stages, mesh=fzero.local_mesh(2), offload=offload)
    state = step.init(fzero.params_of(model))
    with pytest.raises(ValueError, match=rf"the {which} function rank_dependent_{name} put params in other groups on "
                                         rf"rank \d than on another rank: 'head\.weight' \(here '.*'\)\. .*get_rank"):
        step(state, batches[0])
