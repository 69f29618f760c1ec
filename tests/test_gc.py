"""A step leaves nothing for Python's cyclic garbage collector: what it made is freed by reference counting when
the step returns.

An object in a reference cycle outlives its last use until the collector happens to run, and everything it
reaches with it: a step's clone of the module (with its cast buffers and frozen params), its gradient views and
the buffers they hold stayed allocated into the next step, on the device too, and every collector pass walked
them on the host. Three cycles did this: the recursive closure that cloned the module held its own memo, and two
gradient views kept a function that captured the view. The test runs steps with the collector off and
``gc.DEBUG_SAVEALL``, so every object only the collector could free is kept in ``gc.garbage``, and names what
it found: no tensor, no module, no object of fzero's may be among them (a few of torch's own small closures are,
from ``torch.utils._pytree.tree_map``, and hold none of those).
"""

import gc

import pytest
import torch

import fzero
from fzero.models import GPT, GPTConfig

CONFIGS = {
    "stage0": dict(stages=0),
    "stage1": dict(stages=1),
    "stage2": dict(stages=2),
    "stage3": dict(stages=3),
    "stage0-remat": dict(stages=0, remat=True),
    "stage3-remat": dict(stages=3, remat=True),
    "stage3-cpu-offload": dict(stages=3, offload="cpu"),
    "stage2-cpu-offload": dict(stages=2, offload="cpu"),
    "stage3-accum": dict(stages=3, grad_accum=2),
    "stage3-clip": dict(stages=3, clip_grad_norm=1.0),
    "stage2-mesh2": dict(stages=2, mesh=2),
    "stage3-mesh2": dict(stages=3, mesh=2),
}


def _held(objects) -> list[str]:
    """What of ``objects`` a step must not leave to the collector: tensors, modules, fzero's own objects."""
    return sorted({type(o).__qualname__ for o in objects
                   if isinstance(o, (torch.Tensor, torch.nn.Module)) or type(o).__module__.startswith("fzero")})


def _garbage_of(run) -> tuple[int, list[str]]:
    """``run()`` with the collector off and every object only it could free kept: how many, and what of them is held."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return len(gc.garbage), _held(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


def _gpt():
    """A 3-block GPT whose position table is frozen, its loss_fn and a batch."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, d_model=16, n_head=2, seq_len=8, vocab_size=32, bias=True))
    model.pos_emb.weight.requires_grad_(False)  # a frozen param: cast to bf16 for each step's clone of the module
    tokens = torch.randint(0, 32, (4, 9))
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def loss_fn(params, b):
        logits = fzero.apply(model, params, b["x"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["y"].flatten())

    return model, loss_fn, batch


def _assert_steps_leave_no_garbage(step, state, batch, name):
    """After a first step (its one-time work: checks, compiled kernels), two steps and an evaluate leave nothing to the
    cyclic collector, twice over: what both rounds leave is the step's. Why twice: an earlier test's object that
    becomes garbage while a round runs (its thread ending late, seen once on a 16-core GPU machine under xdist: a
    failed stage-3 step's frames) is left in one round only, where a cycle the step makes is left in every round."""
    state, _ = step(state, batch)
    box = {"state": state}

    def run():
        for _ in range(2):
            box["state"], _ = step(box["state"], batch)
        step.evaluate(box["state"], batch)

    (count, held), (again, held_again) = _garbage_of(run), _garbage_of(run)
    both = sorted(set(held) & set(held_again))
    assert not both, f"{name}: {count} and {again} objects were left to the cyclic collector, among them {both} both times"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_step_leaves_no_cyclic_garbage(name):
    settings = dict(CONFIGS[name])
    settings["mesh"] = fzero.local_mesh(settings.get("mesh", 1))
    model, loss_fn, batch = _gpt()
    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3, weight_decay=0.01),
                         precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32), **settings)
    _assert_steps_leave_no_garbage(step, step.init(fzero.params_of(model)), batch, name)


@pytest.mark.parametrize("settings", [{}, {"bucket_elements": 1 << 16}], ids=["default", "buckets"])
def test_sharded_frozen_params_leave_no_cyclic_garbage(settings):
    """Stage 3 with ``frozen=``, a block frozen whole (a unit of frozen params alone, whose backward ends at a hook on
    its inputs: the hook held the unit's call, and through it the step, until a later step dropped them as cyclic
    garbage) and the position table frozen (the root's frozen group)."""
    model, loss_fn, batch = _gpt()
    model.blocks[0].requires_grad_(False)
    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(2), **settings)
    state = step.init(fzero.params_of(model), frozen=fzero.frozen_of(model))
    fzero.free_frozen(model, state)
    assert any(not u.slots for u in state[0].meta.layout.units)
    _assert_steps_leave_no_garbage(step, state, batch, "frozen=")


@pytest.mark.parametrize("entry", ["llama", "gpt2_checkpointing", "t5", "gemma_hidden_states", "bn_cnn", "hook_aux"])
@pytest.mark.parametrize("stages", [0, 3])
def test_models_we_did_not_write_leave_no_cyclic_garbage(entry, stages):
    """The same over the zoo's models (``tests/zoo.py``): Hugging Face's lazily installed output-capturing hooks and
    activation checkpointing, BatchNorm's buffers, a user's forward hooks."""
    pytest.importorskip("transformers")
    import zoo

    e = zoo.ZOO[entry]
    model, batches = e.build(), e.batches()

    def loss_fn(params, b):
        return e.loss(lambda *args, **kwargs: fzero.apply(model, params, *args, **kwargs), b)

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=stages, mesh=fzero.local_mesh(1), **e.settings)
    box = {"state": step(step.init(fzero.params_of(model)), batches[0])[0]}

    def run():
        box["state"], _ = step(box["state"], batches[1])

    count, held = _garbage_of(run)
    assert not held, f"{entry} at stage {stages}: {count} objects were left to the cyclic collector, among them {held}"


class _Adapted(torch.nn.Module):
    """Frozen base layers with small trainable adapters beside them (the shape of a LoRA fine-tune)."""

    def __init__(self, width: int = 256, rank: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(layers)])
        self.down = torch.nn.ModuleList([torch.nn.Linear(width, rank, bias=False) for _ in range(layers)])
        self.up = torch.nn.ModuleList([torch.nn.Linear(rank, width, bias=False) for _ in range(layers)])
        self.base.requires_grad_(False)

    def forward(self, x):
        for base, down, up in zip(self.base, self.down, self.up):
            x = torch.tanh(base(x) + up(down(x)))
        return x.square().mean()


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_frozen_params_cast_for_a_step_are_freed_with_it(stages):
    """Under a bf16 policy each step runs the frozen params as bf16 copies. Those copies were kept by the step's
    skeleton (stages 2-3), which a reference cycle kept alive after the step: with the collector not running, each
    step added the frozen model's size in bf16 to what stayed allocated (measured: 4, 8, 12, 16 MiB of live bytes
    over steps 2-5 with 4 MiB frozen). Each step's peak must be the first's, within a few bytes."""
    import dataclasses

    from fzero.memory import LiveBytes

    torch.manual_seed(0)
    model = _Adapted()
    frozen = sum(p.numel() * 2 for p in model.base.parameters())  # bytes of their bf16 copies
    counters = {}
    mesh = dataclasses.replace(fzero.local_mesh(1), rank_context=lambda r: counters.setdefault(r, LiveBytes()))
    step = fzero.compile(lambda params, x: fzero.apply(model, params, x), optimizer=fzero.optim.adamw(1e-3), stages=stages,
                         mesh=mesh, precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32))
    state = step.init(fzero.params_of(model))
    x = torch.randn(4, 256)
    peaks = []
    was_enabled = gc.isenabled()
    gc.disable()  # as between two of the collector's passes, which a long step on a GPU may well be
    try:
        for _ in range(5):
            state, _ = step(state, x)
            peaks.append(counters[0].peak)
    finally:
        if was_enabled:
            gc.enable()
    assert peaks[0] >= frozen  # the bf16 copies are counted: the measurement can see what it tests
    # a few bytes of scalars (the step count) may join after the first step; a leak is the frozen size per step
    assert max(peaks) - peaks[0] < frozen / 100, f"stage {stages}: live bytes peaked at {peaks} over 5 steps ({frozen} bytes frozen in bf16)"
