"""Step.init from a meta-device model: params made one unit at a time (``materialize=``), never whole."""

import pytest
import torch

import fzero
from fzero.memory import LiveBytes
from fzero.models import GPT, GPTConfig, gpt_loss
from fzero.testing import assert_trees_equal


def _models(cfg):
    torch.manual_seed(0)
    real = GPT(cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(cfg)
    return real, meta


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_materialized_init_equals_init_from_the_built_model(stages, precision):
    real, meta = _models(GPTConfig.tiny())
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(real, p, b["x"]), b["y"]), stages=stages,
                         mesh=fzero.local_mesh(2), precision=precision)
    expected = step.init(fzero.params_of(real))
    got = step.init(fzero.params_of(meta, copy=False), materialize=meta.init_value)
    assert_trees_equal(step.gather(got), step.gather(expected))
    assert all(not t.is_meta for s in got.states for t in s.params.values())


def test_materialized_init_holds_one_unit_and_the_shards_not_the_model():
    cfg = GPTConfig(n_layer=8, n_head=2, d_model=64, seq_len=16)
    _, meta = _models(cfg)
    psi = sum(p.numel() for p in meta.parameters())
    block = sum(p.numel() for p in meta.blocks[0].parameters())
    step = fzero.compile(lambda p, b: None, stages=3, mesh=fzero.local_mesh(2), optimizer=fzero.optim.sgd(0.1))
    with LiveBytes() as lb:
        state = step.init(fzero.params_of(meta, copy=False), materialize=meta.init_value)
    shards = sum(t.numel() * 4 for s in state.states for t in s.params.values())
    assert shards >= 4 * psi  # both ranks' shards of every unit: all of the params, once
    # the peak above them: one unit being packed (its values and its flat buffer), not the whole model
    assert lb.peak - shards <= 2 * 4 * block * 1.1 + 4 * 256 * 64 * 2, (lb.peak, shards, block)


def test_materialize_must_return_the_parameter():
    _, meta = _models(GPTConfig.tiny())
    step = fzero.compile(lambda p, b: None, stages=3)
    with pytest.raises(ValueError, match=r"materialize\('.*', \.\.\.\) returned shape \(3,\).*a CPU or CUDA tensor of shape"):
        step.init(fzero.params_of(meta, copy=False), materialize=lambda path, t: torch.zeros(3))
    with pytest.raises(TypeError, match=r"materialize must be a function"):
        step.init(fzero.params_of(meta, copy=False), materialize=3)
    with pytest.raises(ValueError, match=r"params hold meta tensors .* on a single rank, and no materialize="):
        step.init(fzero.params_of(meta, copy=False))


def test_params_of_without_copy_gives_the_module_tensors():
    real, _ = _models(GPTConfig.tiny())
    params = fzero.params_of(real, copy=False)
    assert params["tok_emb.weight"].data_ptr() == real.tok_emb.weight.data_ptr()
    assert not params["tok_emb.weight"].requires_grad
    assert fzero.params_of(real)["tok_emb.weight"].data_ptr() != real.tok_emb.weight.data_ptr()


# -- donate=True: the given params' memory goes as the state is made -------------------------------------------------


def _train_two(model, step, state):
    torch.manual_seed(1)
    batches = [{"x": torch.randint(0, 64, (4, 16)), "y": torch.randint(0, 64, (4, 16))} for _ in range(2)]
    for batch in batches:
        state, _ = step(state, batch)
    return step.gather(state)


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_donated_init_equals_init_and_trains_the_same(stages):
    """The state made from donated params equals the one made from copies, and training from it (the module
    running through fzero.apply after its own parameters lost their memory) is bitwise the same."""
    cfg = GPTConfig.tiny()
    runs = []
    for donate in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg)
        step = fzero.compile(lambda p, b, model=model: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=stages,
                             mesh=fzero.local_mesh(2), precision="bf16")
        state = step.init(fzero.params_of(model, copy=False), donate=donate)
        first = step.gather(state)
        freed = [p.is_meta for p in model.parameters()]  # memory given to the state: the module's params are meta now
        assert all(freed) if donate else not any(freed)
        runs.append((first, _train_two(model, step, state)))
    assert_trees_equal(runs[1][0], runs[0][0])
    assert_trees_equal(runs[1][1], runs[0][1])


def test_donated_init_holds_the_module_and_about_one_unit_not_the_module_plus_the_state():
    """Live bytes while a built model's state is made at stage 3 (fp32, SGD: the state is the params' shards, the
    model once): with donation the module's memory goes unit by unit as the shards come, so the peak is the model
    plus the unit being packed (its flat buffer and both ranks' shards of it, made before the module's copy of it is
    freed: two units); without it, the model twice."""
    cfg = GPTConfig(n_layer=8, n_head=2, d_model=64, seq_len=16)
    step = fzero.compile(lambda p, b: None, stages=3, mesh=fzero.local_mesh(2), optimizer=fzero.optim.sgd(0.1))
    peaks = {}
    for donate in (False, True):
        with LiveBytes() as lb:
            torch.manual_seed(0)
            model = GPT(cfg)
            model_bytes = lb.live
            lb.reset_peak()
            state = step.init(fzero.params_of(model, copy=False), donate=donate)
        unit_bytes = max(u.padded for u in state.states[0].meta.layout.units) * 4
        assert 2 * unit_bytes < model_bytes / 3  # the bounds below tell "about one unit" from "the model again"
        peaks[donate] = lb.peak
        del state, model
    assert peaks[False] >= 1.9 * model_bytes, peaks  # the module and the state side by side
    assert peaks[True] <= model_bytes + 2 * unit_bytes, (peaks, model_bytes, unit_bytes)


def test_donated_views_of_one_buffer_are_freed_after_the_last_one_is_packed():
    """Params that are views of one storage, in different units: the storage stays until every one of them is
    packed (freeing it at the first unit would zero the others' values in the state)."""
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    params = fzero.params_of(model)
    flat = torch.cat([p.reshape(-1) for p in params.values()])
    views, at = {}, 0
    for k, p in params.items():
        views[k] = flat[at : at + p.numel()].view(p.shape)
        at += p.numel()
    step = fzero.compile(lambda p, b: None, stages=3, mesh=fzero.local_mesh(2))
    assert len(step.init(params).states[0].meta.layout.units) > 2
    expected = step.gather(step.init(params))
    got = step.gather(step.init(views, donate=True))
    assert flat.untyped_storage().nbytes() == 0
    assert_trees_equal(got, expected)


def test_donate_errors_name_the_setting_and_the_param():
    real, _ = _models(GPTConfig.tiny())
    step = fzero.compile(lambda p, b: None, stages=3)
    params = fzero.params_of(real, copy=False)
    with pytest.raises(TypeError, match=r"fzero.Step.init: donate must be True or False, got 'yes'"):
        step.init(params, donate="yes")
    import numpy as np

    outside = dict(params, **{"tok_emb.weight": torch.from_numpy(np.zeros(tuple(params["tok_emb.weight"].shape), np.float32))})
    with pytest.raises(ValueError, match=r"donate=True, but the memory of params\['tok_emb.weight'\] cannot be freed"):
        step.init(outside, donate=True)
    assert all(p.untyped_storage().nbytes() > 0 for p in real.parameters())  # refused before anything was freed


@pytest.mark.parametrize("stages", [0, 3])
def test_a_donated_modules_parameters_turn_meta_so_reads_fail_by_name_not_by_crashing(stages):
    """After step.init(params_of(model, copy=False), donate=True) the module's parameters had no memory but kept their
    shapes, and torch read their values from freed memory: fzero.params_of(model) again (a notebook cell run twice),
    model(x) or a print crashed the process (a segmentation fault). Now they are meta tensors (the same objects), as
    under fzero.empty_params(): each such read is an error, and the step trains as before."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    weight = model.tok_emb.weight  # a reference the user holds
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=stages)
    given = fzero.params_of(model, copy=False)
    state = step.init(given, donate=True)
    assert all(p.is_meta for p in model.parameters()) and weight.is_meta and model.tok_emb.weight is weight
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    assert all(t.is_meta for t in given.values())
    with pytest.raises(ValueError, match=r"params hold meta tensors .* donate=True\) holds meta tensors since: its values "
                                         r"are that state's \(step.gather\(state\)\)"):
        step.init(fzero.params_of(model, copy=False), donate=True)  # the cell run again
    try:  # torch's meta-tensor error, or a meta result (no values): never values read from freed memory
        assert model(torch.zeros(1, 4, dtype=torch.long)).is_meta
    except RuntimeError as e:
        assert "meta" in str(e)
    state, _ = step(state, {"x": torch.randint(0, 64, (4, 16)), "y": torch.randint(0, 64, (4, 16))})
    model.load_state_dict(step.state_dict(state, model), assign=True)  # the fix the errors name: the values back
    assert_trees_equal(fzero.params_of(model), step.gather(state))
    assert all(p.requires_grad and not p.is_meta for p in model.parameters())


@pytest.mark.parametrize("stages,ranks,precision,fault", [(3, 1, "fp32", "memory"), (3, 2, "bf16", "memory"),
                                                         (1, 1, "fp32", "disk full"), (3, 2, "fp32", "disk full")])
def test_an_init_that_fails_after_donating_puts_the_modules_values_back(tmp_path, stages, ranks, precision, fault):
    """step.init(params_of(model, copy=False), donate=True) frees each unit's params as it packs them. An init that
    failed after that (out of memory packing a later unit, a full disk under disk offload, Ctrl-C) dropped the state
    being made, the only holder of those values: the module's parameters stayed meta, its weights lost (measured: 12 of
    the tiny GPT's 15 at stage 3 when the third unit failed, all 15 at a full offload disk), and the next init blamed "a
    state" they were given to. Now the values are put back into the same objects (and the error says so), and init
    again trains as an init that never failed."""
    from types import SimpleNamespace
    from unittest import mock

    import fzero.layout._layout as layout_module
    import fzero.zero._offload as offload_module

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weight = model.blocks[0].attn.qkv.weight  # a reference the user holds
    offload = fzero.DiskOffload(str(tmp_path)) if fault == "disk full" else None
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=stages, precision=precision,
                         mesh=fzero.local_mesh(ranks) if ranks > 1 else None, offload=offload)
    if fault == "memory":
        pack, calls = layout_module.Layout.pack_unit, []

        def failing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == (5 if precision == "bf16" else 3):  # the third unit (bf16: each packed twice, with its masters)
                raise MemoryError("out of memory")
            return pack(self, *args, **kwargs)

        fault_in = mock.patch.object(layout_module.Layout, "pack_unit", failing)
        raised = MemoryError
    else:
        fault_in = mock.patch.object(offload_module.shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9, free=10))
        raised = OSError
    given = fzero.params_of(model, copy=False)
    with fault_in, pytest.raises(raised) as failure:
        step.init(given, donate=True)
    assert "donate=True had freed the memory of" in str(failure.value.__notes__)
    assert "their values were put back" in str(failure.value.__notes__)
    assert not any(p.is_meta for p in model.parameters()) and model.blocks[0].attn.qkv.weight is weight
    assert_trees_equal(dict(model.state_dict()), before)
    assert_trees_equal({k: v.clone() for k, v in given.items()}, {k: before[k] for k in given})
    state = step.init(given, donate=True)  # again, as the note says: and it donates as before
    assert all(p.is_meta for p in model.parameters())
    assert_trees_equal(step.gather(state), {k: before[k] for k in given})


def test_a_donated_parameter_that_cannot_turn_meta_is_refused_by_name():
    """A parameter with a weak reference cannot be swapped for a meta tensor: it keeps its shape with no memory, and
    fzero's entry points name it instead of reading freed memory."""
    import weakref

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    held = weakref.ref(model.tok_emb.weight)  # noqa: F841 - what keeps torch from swapping it
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]))
    step.init(fzero.params_of(model, copy=False), donate=True)
    assert not model.tok_emb.weight.is_meta and model.tok_emb.weight.untyped_storage().nbytes() == 0
    for call, api in ((lambda: fzero.params_of(model), "fzero.params_of"),
                      (lambda: step.init({n: p.detach() for n, p in model.named_parameters()}), "fzero.Step.init")):
        with pytest.raises(ValueError, match=rf"{api}: the .*\['tok_emb.weight'\] hold no memory: it was given to a state by "
                                             r"step.init\(..., donate=True\)"):
            call()


class _TaggedParameter(torch.nn.Parameter):
    """A parameter subclass, as libraries mark parameters with one (or with attributes)."""


def test_a_donated_parameter_keeps_its_class_and_attributes():
    """Found in review: torch.utils.swap_tensors swaps __class__ and __dict__ too, so a donated module's parameter
    became a plain nn.Parameter and lost the attributes code had set on it (p.no_decay = True), which code reading
    the module's parameters after init (a mask built from them) then saw silently as unset."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[0].weight = _TaggedParameter(model[0].weight.detach().clone())
    model[1].bias.no_decay = True
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), optimizer=fzero.optim.sgd(1e-2))
    given = fzero.params_of(model, copy=False)
    step.init(given, donate=True)
    assert all(p.is_meta for p in model.parameters())
    assert type(model[0].weight) is _TaggedParameter and model[0].weight.requires_grad
    assert model[1].bias.no_decay is True
    assert all(not t.__dict__ for t in given.values())  # the views no longer hold the module's parameters


def test_a_donated_storage_that_also_holds_a_frozen_parameter_is_kept():
    """A trainable and a frozen parameter cut from one flat buffer: donating the trainable one freed the whole buffer,
    and the frozen one, which every step reads from the module, read freed memory (a crash of the process). Such a
    storage is kept now: nothing else is freed with it, and the step trains as without donation."""
    class Cut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            flat = torch.randn(8 * 4 + 8 * 4, generator=torch.Generator().manual_seed(0))
            self.a = torch.nn.Parameter(flat[:32].view(8, 4))
            self.b = torch.nn.Parameter(flat[32:].view(8, 4), requires_grad=False)

        def forward(self, x):
            return x @ self.a.t() + x @ self.b.t()

    runs = []
    for donate in (False, True):
        model = Cut()
        step = fzero.compile(lambda p, b, model=model: (fzero.apply(model, p, b) ** 2).mean(), optimizer=fzero.optim.sgd(0.1))
        state = step.init(fzero.params_of(model, copy=False), donate=donate)
        assert not model.a.is_meta and model.b.untyped_storage().nbytes() == 64 * 4  # kept: b's values are still there
        state, _ = step(state, torch.ones(2, 4))
        runs.append(step.gather(state))
    assert_trees_equal(runs[1], runs[0])


def test_a_donation_lost_in_a_lower_precision_is_not_blamed_on_shards():
    """Precision(compute=bf16, master=False) holds an fp32 model's params in bf16 alone: an init that failed after
    donating some units loses their fp32 values, and says so. The note blamed shards ("only in part, a shard per rank")
    on one process holding every rank, because a unit not packed yet (nothing of it freed) read as a missing shard."""
    from unittest import mock

    import fzero.layout._layout as layout_module

    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    step = fzero.compile(lambda p, b: gpt_loss(fzero.apply(model, p, b["x"]), b["y"]), stages=3,
                         precision=fzero.Precision(compute=torch.bfloat16, master=False))
    pack, calls = layout_module.Layout.pack_unit, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third unit: the first two freed, the rest not packed
            raise MemoryError("out of memory")
        return pack(self, *args, **kwargs)

    with mock.patch.object(layout_module.Layout, "pack_unit", failing), pytest.raises(MemoryError) as failure:
        step.init(fzero.params_of(model, copy=False), donate=True)
    notes = str(failure.value.__notes__)
    assert "are lost" in notes and "only in a lower precision" in notes and "shard per rank" not in notes


def test_a_failed_donated_init_puts_back_unswappable_views_of_one_storage_whole():
    """Two params that are views of one flat buffer, each with a weak reference (so torch cannot turn them meta: their
    storage is only resized away), and an init that fails after both were packed: the give-back resized the storage to
    the first view's extent only, and the second view's copy wrote past its end. Both come back whole now."""
    import weakref
    from unittest import mock

    import fzero.step._init as init_module

    torch.manual_seed(0)
    flat = torch.randn(64 + 32)
    params = {"a": flat[:64].view(8, 8), "b": flat[64:].view(4, 8)}
    held = [weakref.ref(t) for t in params.values()]  # noqa: F841 - what keeps torch from swapping them
    expected = {k: v.clone() for k, v in params.items()}
    step = fzero.compile(lambda p, b: None, stages=1, unit_elements=64)

    def failing(*args, **kwargs):  # after both leaves' units were packed and their storage freed
        raise MemoryError("out of memory")

    with mock.patch.object(init_module, "_init_rank", failing), pytest.raises(MemoryError):
        step.init(params, donate=True)
    assert flat.untyped_storage().nbytes() >= 96 * 4
    assert_trees_equal({k: v.clone() for k, v in params.items()}, expected)
