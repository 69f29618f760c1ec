"""What a forward writes on its module is kept, as plain PyTorch keeps it.

fzero runs each step on copies of the user's modules (fzero.layout's clones; at stages 2-3 a skeleton per
micro-batch), so what ``forward`` or a Lightning ``training_step`` wrote on ``self`` (Lightning 2.x's
``self.training_step_outputs.append(...)``, a counter, an auxiliary value read after the step) landed on the copy
and was dropped without an error. Now the public attributes the copies changed are written into the user's modules
when the step call succeeds: the values plain PyTorch would hold after running rank 0's micro-batches."""

import collections
import copy

import pytest
import torch
from torch import nn

import fzero

WIDTH = 4


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x))


class _Recorder(nn.Module):
    """Writes on itself and on its blocks in every way a forward can: a counter, a list appended to, a dict entry,
    a tensor with a graph, an attribute deleted, and a private one (a library's flag, which stays the copy's)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(WIDTH, 1)
        self.calls, self.rows, self.by_size, self.once = 0, [], {}, True

    def forward(self, x):
        self.calls += 1
        self.rows.append(round(float(x[:, 0].sum()), 5))  # what this micro-batch's rows were
        self.by_size[x.shape[0]] = self.by_size.get(x.shape[0], 0) + 1
        if hasattr(self, "once"):
            del self.once
        self._scratch = self.calls  # a private name: the copy's
        for block in self.blocks:
            x = x + block(x)
        self.last = self.head(x)  # a tensor with a graph, as an auxiliary output kept on a module
        return self.last.pow(2).mean()


def _batches(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(8, WIDTH, generator=gen) for _ in range(n)]


def _pytorch(ranks, accum, batches, evaluated):
    """Plain PyTorch on rank 0's micro-batches: rank 0's share of each global batch, cut into ``accum``."""
    model = _Recorder()
    for x in batches:
        for micro in x[: len(x) // ranks].chunk(accum):
            model(micro)
    with torch.no_grad():
        model(evaluated[: len(evaluated) // ranks])
    return model


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_what_the_forward_writes_on_self_is_kept_as_in_pytorch(stages, ranks, accum):
    torch.manual_seed(0)
    model = _Recorder()
    held = model.rows  # a list held elsewhere (a callback's reference) sees the appends: written in place
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.adamw(1e-2), stages=stages,
                         mesh=fzero.local_mesh(ranks), grad_accum=accum)
    state = step.init(fzero.params_of(model))
    batches, evaluated = _batches(3), _batches(4)[-1]
    for x in batches:
        state, _ = step(state, x)
    step.evaluate(state, evaluated)
    want = _pytorch(ranks, accum, batches, evaluated)

    assert model.rows is held and held == want.rows and len(held) == 3 * accum + 1
    assert (model.calls, [b.calls for b in model.blocks]) == (want.calls, [b.calls for b in want.blocks])
    assert model.by_size == want.by_size
    assert not hasattr(model, "once") and not hasattr(model, "_scratch")
    assert model.last.shape == want.last.shape and model.last.grad_fn is None and not model.last.requires_grad


def test_a_step_that_raises_keeps_no_write():
    """As it keeps no update: the module's attributes are those of before the call."""
    model = _Recorder()
    _raise_after_the_forward(model, ranks=1)
    assert (model.calls, model.rows, model.once) == (0, [], True) and not hasattr(model, "last")


def _raise_after_the_forward(model, *, ranks):
    """A stage-3 step of ``model`` whose ``loss_fn`` raises once the forward has run."""

    def loss_fn(params, x):
        fzero.apply(model, params, x)
        raise RuntimeError("after the forward")

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, mesh=fzero.local_mesh(ranks))
    with pytest.raises(RuntimeError, match="after the forward"):
        step(step.init(fzero.params_of(model)), _batches(1)[0])


@pytest.mark.parametrize("stages", [0, 3])
def test_under_torch_func_grad_a_kept_tensor_is_a_plain_tensor(stages):
    """torch.func.grad wraps the forward's tensors; the one kept on the module is the value inside, usable after."""
    model = _Recorder()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(1), autodiff="func")
    state = step.init(fzero.params_of(model))
    x = _batches(1)[0]
    step(state, x)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(model.last)
    assert (model.last + 1).shape == (len(x), 1) and model.last.dtype == torch.float32


def test_under_remat_a_recomputed_block_counts_its_forward_twice_as_torch_checkpoint_does():
    """A recompute runs the block's forward again, as torch.utils.checkpoint does: its writes happen twice there too."""
    from torch.utils.checkpoint import checkpoint

    model, want = _Recorder(), _Recorder()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=3,
                         mesh=fzero.local_mesh(1), remat=True)
    x = _batches(1)[0]
    step(step.init(fzero.params_of(model)), x)
    h = x
    for block in want.blocks:
        h = h + checkpoint(block, h, use_reentrant=False)
    want.head(h).pow(2).mean().backward()
    assert [b.calls for b in model.blocks] == [b.calls for b in want.blocks] == [2, 2]
    assert model.calls == 1


class _KeepsWeight(nn.Linear):
    """A block that keeps its weight on itself: at stage 3, a view of the unit's params gathered for its call, whose
    memory is freed once the unit has run."""

    def forward(self, x):
        self.w = self.weight
        return super().forward(x)


class _KeepsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_KeepsWeight(WIDTH, WIDTH) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def test_a_kept_view_of_a_units_gathered_params_is_refused_by_name_and_the_state_stays_whole():
    """Kept, it held no memory after the step: reading it crashed the process (a segmentation fault on the CPU)."""
    model = _KeepsWeights()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=3,
                         mesh=fzero.local_mesh(1))
    state = step.init(fzero.params_of(model))
    with pytest.raises(RuntimeError, match=r"`blocks\.\d\.w` .*view of a unit's parameters.*\.detach\(\)\.clone\(\)"):
        step(state, _batches(1)[0])
    assert not hasattr(model.blocks[0], "w")
    assert torch.equal(step.gather(state)["blocks.0.weight"], model.blocks[0].weight)  # refused before the update


class _NamesItself(nn.Module):
    """A forward that keeps what names its module: a bound method of it, and a submodule in a list."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.copies = []  # weak references to the modules the forwards ran on (the step's copies)

    def forward(self, x):
        import weakref

        self.copies.append(weakref.ref(self))
        self.run_block = self.blocks[0].forward
        self.path = [self.blocks[1]]
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("stages", [0, 3])
def test_what_names_the_steps_copy_names_the_users_module_after_the_step(stages):
    """As in PyTorch, where ``self.run_block = self.blocks[0].forward`` names the module: kept as it was, it named the
    step's copy, which it kept alive on the user's module (at stage 3 the skeleton, with the step's unit params), and
    calling it ran that copy."""
    import gc

    model = _NamesItself()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(1), grad_accum=2)
    state = step.init(fzero.params_of(model))
    for x in _batches(2):
        state, _ = step(state, x)
    assert model.run_block.__self__ is model.blocks[0] and model.path[0] is model.blocks[1]
    gc.collect()
    assert len(model.copies) == 4 and [r() for r in model.copies] == [None] * 4


class _KeepsActivation(nn.Module):
    """Blocks that keep their output, with its graph, on themselves (an auxiliary tensor read after the step)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.copies = []

    def forward(self, x):
        import weakref

        for block in self.blocks:
            self.copies.append(weakref.ref(block))
            x = block.out = torch.tanh(block(x))
            block._private_out = x
        return x.pow(2).mean()


@pytest.mark.parametrize("stages", [2, 3])
def test_a_tensor_kept_with_its_graph_does_not_keep_the_steps_skeleton_alive(stages):
    """The kept tensor's graph holds the unit's autograd node, which held the skeleton, whose attribute held the
    tensor: a cycle through torch's C++ graph that Python's collector cannot free, so every step's skeleton, graph and
    saved activations stayed allocated for good."""
    import gc

    model = _KeepsActivation()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(1))
    state = step.init(fzero.params_of(model))
    for x in _batches(3):
        state, _ = step(state, x)
    gc.collect()
    assert [r() for r in model.copies] == [None] * 6
    assert model.blocks[1].out.shape == (8, WIDTH) and model.blocks[1].out.grad_fn is None
    assert not hasattr(model.blocks[1], "_private_out")


class _Rebinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 1)
        self.rows = ["before"]

    def forward(self, x):
        self.rows = []  # a new list, as a reset at the start of a forward
        self.rows.append(x.shape[0])
        return self.lin(x).pow(2).mean()


@pytest.mark.parametrize("stages", [0, 3])
def test_a_list_the_forward_rebinds_is_a_new_list_and_one_held_elsewhere_keeps_its_entries(stages):
    """As in PyTorch; written in place, the list a callback held lost its entries to the new one's."""
    model = _Rebinds()
    held = model.rows
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(1), grad_accum=2)
    step(step.init(fzero.params_of(model)), _batches(1)[0])
    assert held == ["before"] and model.rows is not held and model.rows == [4]


class _SetsOnFirstForward(nn.Module):
    """As torchvision's ``MultiScaleRoIAlign``: ``self.scales = None`` until the first forward sets it to a list."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 1)
        self.scales = None

    def forward(self, x):
        if self.scales is None:
            self.scales = [0.25, 0.125]
        return self.lin(x).pow(2).mean()


@pytest.mark.parametrize("stages", [0, 3])
def test_an_attribute_that_was_none_and_is_set_to_a_list_is_kept(stages):
    """Before: the None was taken for the container the copy was made from, and the step raised torch-free
    "'NoneType' object does not support item assignment" after its update (every torchvision detection model)."""
    model = _SetsOnFirstForward()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(1))
    state, _ = step(step.init(fzero.params_of(model)), _batches(1)[0])
    assert model.scales == [0.25, 0.125]
    step(state, _batches(1)[0])
    assert model.scales == [0.25, 0.125]


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls, self.seen = 0, []

    def forward(self, x):
        self.calls += 1
        self.seen.append(x.shape[0])
        return torch.tanh(self.lin(x))


class _Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = _Encoder()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.encoder(x))


@pytest.mark.parametrize("parent_first", [True, False])
@pytest.mark.parametrize("stages", [0, 1])
def test_a_module_run_inside_its_parent_and_on_its_own_keeps_both_forwards_writes(stages, parent_first):
    """One module is one copy in a step call, whichever fzero.apply reaches it first: its two forwards' writes add up,
    as on the one module in PyTorch (with a copy each, one forward's count was lost: 1 call where PyTorch has 2)."""
    model, want = _Siamese(), _Siamese()
    enc = {k[len("encoder."):]: k for k in fzero.params_of(model) if k.startswith("encoder.")}

    def loss_fn(params, x):
        def whole():
            return fzero.apply(model, params, x).mean()

        def encoder():
            return fzero.apply(model.encoder, {k: params[full] for k, full in enc.items()}, x[:2]).pow(2).mean()

        return whole() + encoder() if parent_first else encoder() + whole()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(1))
    state = step.init(fzero.params_of(model))
    for x in _batches(2):
        state, _ = step(state, x)
        want(x)
        want.encoder(x[:2])
    assert model.encoder.calls == want.encoder.calls == 4
    assert sorted(model.encoder.seen) == sorted(want.encoder.seen) == [2, 2, 8, 8]


class _Tallies(nn.Module):
    """Writes inside objects it holds, as training code does: a torchmetrics metric updated in the forward, a list in a
    dict, a defaultdict and a deque, and a tensor (not a buffer) written in place."""

    def __init__(self, metric):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 1)
        self.acc = metric
        self.hist = {"rows": []}
        self.sizes = collections.defaultdict(int)
        self.recent = collections.deque(maxlen=3)
        self.seen = torch.zeros(())

    def forward(self, x):
        y = self.lin(x)[:, 0]
        if self.acc is not None:
            self.acc.update(y.sigmoid(), (x[:, 0] > 0).long())
        self.hist["rows"].append(round(float(x[:, 0].sum()), 5))
        self.sizes[x.shape[0]] += 1
        self.recent.append(x.shape[0])
        self.seen += x.shape[0]
        return y.square().mean()


def _metric():
    torchmetrics = pytest.importorskip("torchmetrics")
    return torchmetrics.classification.BinaryAccuracy()


def _tallies_of(model):
    acc = None if model.acc is None else (int(model.acc.tp + model.acc.fp + model.acc.tn + model.acc.fn), float(model.acc.compute()))
    return acc, model.hist, dict(model.sizes), list(model.recent), float(model.seen)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_objects_the_modules_hold_are_written_by_rank_0_alone_on_a_local_mesh_of_two_ranks(stages, accum):
    """Each rank of a local mesh is a thread of this process, and the objects the modules hold (a metric, a list in
    a dict, a tensor) were shared by the ranks' copies, so both ranks wrote them at once: a metric counted 224 of
    240 rows one run and 240 the next, a list got both ranks' entries. Now each rank writes its own copies, as each
    torchrun process has its own objects, and rank 0's are kept, in place: what PyTorch holds on rank 0's rows,
    also after the user resets the metric between steps."""
    torch.manual_seed(0)
    model = _Tallies(_metric())
    held, held_seen = model.hist["rows"], model.seen
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=stages,
                         mesh=fzero.local_mesh(2), grad_accum=accum)
    state = step.init(fzero.params_of(model))
    want = _Tallies(_metric())
    for i, x in enumerate(_batches(4)):
        want.load_state_dict(step.gather(state), strict=False)  # the params this step's forward runs with
        state, _ = step(state, x)
        for micro in x[: len(x) // 2].chunk(accum):  # rank 0's rows
            want(micro)
        if i == 1:
            model.acc.reset(), want.acc.reset()
    assert _tallies_of(model) == _tallies_of(want)
    assert model.hist["rows"] is held and model.seen is held_seen


def test_a_step_that_raises_on_a_local_mesh_of_two_ranks_writes_no_object_the_modules_hold():
    model = _Tallies(None)
    _raise_after_the_forward(model, ranks=2)
    assert _tallies_of(model) == (None, {"rows": []}, {}, [], 0.0)


def test_a_bound_module_that_cannot_be_copied_for_each_rank_is_named():
    """A module updated through methods bound to it (as a metric is) is copied for each rank of a local mesh; one
    that copy.deepcopy cannot copy is named with the fixes, not written by both ranks at once."""
    import functools
    import threading

    class Locked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lock, self.count = threading.Lock(), 0
            bound = self.update
            self.update = functools.wraps(bound)(lambda n: bound(n))  # a wrapper bound at init, as torchmetrics does

        def update(self, n):
            with self.lock:
                self.count += n

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.counter = nn.Linear(WIDTH, 1), Locked()

        def forward(self, x):
            self.counter.update(x.shape[0])
            return self.lin(x).square().mean()

    model = Counting()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2))
    with pytest.raises(TypeError, match=r"Locked.*local_mesh of several ranks.*deepcopy failed.*torchrun"):
        step(step.init(fzero.params_of(model)), _batches(1)[0])
    one = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(1))
    one(one.init(fzero.params_of(model)), _batches(1)[0])  # one rank: written where it is, as in PyTorch
    assert model.counter.count == 8


class _Held(nn.Module):
    """A Counter the forward counts in, a tensor it only reads, and two objects ``loss_fn`` writes outside the modules."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 1)
        self.sizes = collections.Counter()
        self.table = torch.arange(float(WIDTH))  # read only (as a rotary table held as a plain attribute)
        self.log = {"losses": []}
        self.ema = torch.zeros(())

    def forward(self, x):
        self.sizes[x.shape[0]] += 1
        return self.lin(x * self.table)[:, 0].square().mean()


@pytest.mark.parametrize("autodiff", ["autograd", "func"])
def test_a_local_mesh_rank_writes_back_a_counter_as_counts_and_no_copy_it_left_over_what_loss_fn_wrote(autodiff):
    """Rank 0's copies written back: a Counter's counts (its update() of (key, value) pairs counted the pairs as keys),
    under torch.func too (requires_grad_(False) on a tensor's copy was refused inside torch.func.grad); and a copy the
    rank left as it was does not overwrite what loss_fn wrote on the module's own objects (a list in a dict lost every
    entry, a tensor went back to its old value)."""
    import threading

    model, lock = _Held(), threading.Lock()  # the lock: the two rank threads' adds must not race in the test itself

    def loss_fn(params, x):
        loss = fzero.apply(model, params, x)
        model.log["losses"].append(x.shape[0])
        if autodiff == "autograd":  # (torch.func.grad refuses an in-place write on a captured tensor)
            with torch.no_grad(), lock:
                model.ema.add_(1.0)
        return loss

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2), autodiff=autodiff)
    state = step.init(fzero.params_of(model))
    for x in _batches(3):
        state, _ = step(state, x)
    assert model.sizes == collections.Counter({4: 3})  # rank 0's rows
    assert model.log == {"losses": [4] * 6}  # both rank threads', written where they are
    assert float(model.ema) == (6.0 if autodiff == "autograd" else 0.0)
    assert torch.equal(model.table, torch.arange(float(WIDTH)))


def test_a_tensor_computed_from_the_modules_params_is_refused_on_a_local_mesh_of_two_ranks_as_on_one():
    """A public tensor with a graph back to the module's own parameters (not the state's) is refused as on one rank:
    the rank's copy of it had been a detached clone, which trained silently on a constant."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, 1)
            self.alpha = self.lin.weight.sum() * 0 + 1

        def forward(self, x):
            return (self.lin(x) * self.alpha).square().mean()

    model = Scaled()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x), optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2))
    with pytest.raises(ValueError, match="the module's own parameters"):
        step(step.init(fzero.params_of(model)), _batches(1)[0])


class _DrawsFromItsGenerator(nn.Module):
    """Noise drawn in the forward from a ``torch.Generator`` the module holds (``generator=self.gen``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        x = x + torch.randn(x.shape, generator=self.gen)
        return self.blocks[1](self.blocks[0](x))


def _assert_two_ranks_train_as(model: nn.Module, ref: nn.Module, x: torch.Tensor, stages: int) -> None:
    """``model`` trained by fzero's SGD(0.1) on ``local_mesh(2)`` over the batches ``x`` (loss: the output's mean
    square) holds ``ref``'s params, name by name (``ref``: DDP's arithmetic, done by the caller)."""
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                         stages=stages, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    for b in x:
        state, _ = step(state, b)
    full = step.gather(state)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stages", [0, 3])
def test_a_generator_the_module_holds_is_each_ranks_own_on_a_local_mesh_of_two_ranks(stages):
    """Found by the diffusers sweep: the rank threads of a local_mesh(2) shared the module's generator, so the ranks drew
    from one stream in the order the threads ran, where each torchrun process draws from its own copy (seeded alike):
    3e-2 off DDP after 3 SGD steps, varying from run to run. Now each rank copies it, as a tensor the module holds, and
    rank 0's is written back."""
    x = torch.randn(3, 4, WIDTH, generator=torch.Generator().manual_seed(1))
    ref = _DrawsFromItsGenerator()  # DDP: each rank's replica with its own generator, seeded alike
    gens = [torch.Generator().manual_seed(5) for _ in range(2)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in x:
        opt.zero_grad()
        for r, rows in enumerate(b.chunk(2)):
            ref.gen = gens[r]
            (ref(rows).pow(2).mean() / 2).backward()
        opt.step()
    model = _DrawsFromItsGenerator()
    _assert_two_ranks_train_as(model, ref, x, stages)
    assert torch.equal(model.gen.get_state(), gens[0].get_state())  # rank 0's generator, as torchrun's rank 0 holds it


def _streams() -> dict:
    import random

    import numpy as np

    return {"numpy_randomstate": (lambda: np.random.RandomState(5), lambda g, n: g.rand(n)),
            "numpy_generator": (lambda: np.random.default_rng(5), lambda g, n: g.random(n)),
            "python_random": (lambda: random.Random(5), lambda g, n: [g.random() for _ in range(n)]),
            # under a private name a torch.Generator was shared too (the public one is the test above's)
            "torch_private": (lambda: torch.Generator().manual_seed(5), lambda g, n: torch.rand(n, generator=g).tolist())}


class _MasksFromItsStream(nn.Module):
    """Features dropped in the forward by a NumPy or Python random stream the module holds, under a private name (as
    augmentation code keeps ``self._rng = np.random.default_rng(seed)``)."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        make, self.draw = _streams()[kind]
        self._rng = make()

    def forward(self, x):
        keep = torch.as_tensor([float(u > 0.3) for u in self.draw(self._rng, x.shape[-1])], dtype=x.dtype)
        return self.blocks[1](self.blocks[0](x) * keep)


@pytest.mark.parametrize("kind", ["numpy_randomstate", "numpy_generator", "python_random", "torch_private"])
@pytest.mark.parametrize("stages", [0, 3])
def test_a_numpy_or_python_random_stream_the_module_holds_is_each_ranks_own_on_a_local_mesh_of_two_ranks(stages, kind):
    """Found by a sweep of models nobody here wrote: as a torch.Generator did, a NumPy ``RandomState``/``Generator`` or a
    Python ``random.Random`` kept on the module (or a torch.Generator under a private name) was shared by the rank threads of a local_mesh(2), so rank 1 drew what
    rank 0 left (or the threads interleaved), where each torchrun process draws from its own copy, seeded alike: 7e-3
    off DDP after 4 AdamW steps, silently. Now each rank copies it, and rank 0's state is written back."""
    x = torch.randn(3, 4, WIDTH, generator=torch.Generator().manual_seed(1))
    ref = _MasksFromItsStream(kind)  # DDP: each rank's replica with its own stream, seeded alike
    streams = [_streams()[kind][0]() for _ in range(2)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in x:
        opt.zero_grad()
        for r, rows in enumerate(b.chunk(2)):
            ref._rng = streams[r]
            (ref(rows).pow(2).mean() / 2).backward()
        opt.step()
    model = _MasksFromItsStream(kind)
    _assert_two_ranks_train_as(model, ref, x, stages)
    draw = _streams()[kind][1]
    assert list(draw(model._rng, 4)) == list(draw(streams[0], 4))  # rank 0's stream, as torchrun's rank 0 holds it


class _DrawsPerKeptRow(_MasksFromItsStream):
    """One draw from a stream the module holds (``self._rng``) per row whose first feature is positive: how many values
    a rank draws depends on its rows, as a module drawing one number per non-padding token does."""

    def forward(self, x):
        scale = [1.0 + float(self.draw(self._rng, 1)[0]) if float(row[0]) > 0 else 1.0 for row in x]
        return self.blocks[1](self.blocks[0](x) * torch.tensor(scale, dtype=x.dtype)[:, None])


def _uneven_rows(steps: int) -> torch.Tensor:
    """``steps`` global batches of 4 rows whose halves (the two ranks' shares) keep other numbers of rows (2 and 0,
    then 0 and 1, ...): the ranks draw other amounts at every step, and their streams are never at one count of
    draws after a step (2-0, 2-1, 4-1, 4-2, 5-4)."""
    x = torch.randn(steps, 4, WIDTH, generator=torch.Generator().manual_seed(1)).abs()
    signs = [[1, 1, -1, -1], [-1, -1, 1, -1], [1, 1, -1, -1], [-1, -1, 1, -1], [1, -1, 1, 1]]
    x[..., 0] *= torch.tensor([signs[s % len(signs)] for s in range(steps)], dtype=x.dtype)
    return x


def _two_processes(kind: str, x: torch.Tensor, between=None) -> tuple[list[list[float]], list[dict], list]:
    """What two torchrun processes give, each with its own replica of the module, its stream advanced by its own draws
    only (DDP: the gradient averaged): the loss and the params after each step, and each process's stream at the end.
    ``between(step, streams)``: run between steps (a draw each process makes from its own stream)."""
    ref = _DrawsPerKeptRow(kind)
    streams = [_streams()[kind][0]() for _ in range(2)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, params = [], []
    for i, b in enumerate(x):
        opt.zero_grad()
        loss = 0.0
        for r, rows in enumerate(b.chunk(2)):
            ref._rng = streams[r]
            l = ref(rows).pow(2).mean()
            (l / 2).backward()
            loss += l.item() / 2
        opt.step()
        losses.append(loss)
        params.append({k: p.detach().clone() for k, p in ref.named_parameters()})
        if between is not None:
            between(i, streams)
    return losses, params, streams


def _on_local_mesh(kind: str, x: torch.Tensor, *, stages: int, mesh=None, model=None, between=None):
    """The same steps on local_mesh(2): the loss and gathered params after each step, and the module."""
    model = _DrawsPerKeptRow(kind) if model is None else model
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                         stages=stages, mesh=fzero.local_mesh(2) if mesh is None else mesh)
    state = step.init(fzero.params_of(model))
    losses, params = [], []
    for i, b in enumerate(x):
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        params.append(step.gather(state))
        if between is not None:
            between(i, model)
    return losses, params, model


@pytest.mark.parametrize("stages,kind", [(0, k) for k in ("numpy_generator", "numpy_randomstate", "python_random",
                                                          "torch_private")] + [(3, "numpy_generator")])
def test_a_stream_the_module_holds_goes_on_from_each_ranks_own_state_when_the_ranks_draw_other_amounts(stages, kind):
    """A stream the module holds (a NumPy ``Generator``/``RandomState``, a Python ``random.Random``, a private
    ``torch.Generator``) drawn from a number of times that depends on the rank's rows (one draw per kept row, as per
    non-padding token): each rank of local_mesh(2) drew from its own copy for the step, but every step started both
    copies from rank 0's state (the one written back on the module), where each torchrun process goes on from where its
    own stream left off: rank 1 drew rank 0's numbers from step 2 on, 2.6e-3 to 8.6e-3 off torchrun in the params
    after 4 SGD steps (losses up to 3.5e-2 off from step 2), silently. Each rank's copy now goes on from its own end state, and the module still holds rank 0's."""
    x = _uneven_rows(4)
    ref_losses, ref_params, streams = _two_processes(kind, x)
    losses, params, model = _on_local_mesh(kind, x, stages=stages)
    for i in range(len(x)):
        assert losses[i] == pytest.approx(ref_losses[i], rel=1e-6, abs=1e-7), f"step {i + 1}"
        for name, p in ref_params[i].items():
            torch.testing.assert_close(params[i][name], p, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {i + 1}, {name}: {m}")
    draw = _streams()[kind][1]
    assert list(draw(model._rng, 4)) == list(draw(streams[0], 4))  # rank 0's stream, as torchrun's rank 0 holds it


def _assert_params(got: dict, want: dict, what: str) -> None:
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}, {name}: {m}")


def test_each_ranks_held_stream_goes_on_through_a_checkpoint_load_and_restarts_from_a_reseed(tmp_path):
    """What the carried per-rank states of a module-held stream do around a checkpoint and a reseed. A checkpoint saves
    no module attribute but its tensors (nor does a torchrun job's: each process's module keeps its own stream), so a
    load leaves every rank's stream where it was and the ranks go on from their own states (the load must not reset
    them to rank 0's). A reseed of the module's stream between steps (``model._rng.seed(7)`` in every process) starts
    every rank from it: a carried state is never used once the object no longer holds what the last step left in it."""
    x = _uneven_rows(5)
    ref = _DrawsPerKeptRow("numpy_randomstate")
    streams = [_streams()["numpy_randomstate"][0]() for _ in range(2)]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    saved = None
    for i, b in enumerate(x):  # two processes: save after step 2, step 3, load, step 4; reseed; step 5
        if i == 3:
            ref.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        if i == 4:
            for g in streams:
                g.seed(7)
        opt.zero_grad()
        for r, rows in enumerate(b.chunk(2)):
            ref._rng = streams[r]
            (ref(rows).pow(2).mean() / 2).backward()
        opt.step()
        if i == 1:
            saved = copy.deepcopy((ref.state_dict(), opt.state_dict()))
        if i == 3:
            want_after_load = {k: p.detach().clone() for k, p in ref.named_parameters()}
    model = _DrawsPerKeptRow("numpy_randomstate")
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                         stages=0, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    for i, b in enumerate(x):
        if i == 3:
            state = fzero.checkpoint.load(tmp_path / "ck", like=step)
        if i == 4:
            model._rng.seed(7)  # in place: the object is the one the last step left, its state is not
        state, _ = step(state, b)
        if i == 1:
            fzero.checkpoint.save(tmp_path / "ck", state)
        if i == 3:
            _assert_params(step.gather(state), want_after_load, "the step after the load")
    _assert_params(step.gather(state), {k: p.detach() for k, p in ref.named_parameters()}, "the step after the reseed")
    assert list(model._rng.rand(4)) == list(streams[0].rand(4))


def test_two_steps_over_one_model_draw_from_each_ranks_one_stream_on_one_mesh_or_two_and_a_one_rank_step_restarts_it():
    """Two step objects over the same model share its held stream: on one mesh, or on two meshes of the same size (the
    same processes of one job, each with one module object that every step draws from), each rank goes on from where
    any step left its stream, as torchrun's processes do. After a step on one rank (no mesh) drew from the stream, a
    step starts every rank from the module's state (rank 0's), never from the states carried from before, which are
    stale."""
    x = _uneven_rows(4)
    model = _DrawsPerKeptRow("numpy_generator")
    mesh = fzero.local_mesh(2)

    def compiled(m):
        step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                             stages=0, mesh=m)
        return step, step.init(fzero.params_of(model))

    (a, sa), (b, sb) = compiled(mesh), compiled(mesh)
    refs = [_DrawsPerKeptRow("numpy_generator") for _ in range(2)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in refs]
    streams = [_streams()["numpy_generator"][0]() for _ in range(2)]

    def reference(which: int, batch: torch.Tensor) -> None:
        opts[which].zero_grad()
        for r, rows in enumerate(batch.chunk(2)):
            refs[which]._rng = streams[r]
            (refs[which](rows).pow(2).mean() / 2).backward()
        opts[which].step()

    for i, batch in enumerate(x):  # a, b, a, b on one mesh: one stream per rank, as in each torchrun process
        if i % 2 == 0:
            sa, _ = a(sa, batch)
        else:
            sb, _ = b(sb, batch)
        reference(i % 2, batch)
    for step, state, ref, what in ((a, sa, refs[0], "step a"), (b, sb, refs[1], "step b")):
        _assert_params(step.gather(state), {k: p.detach() for k, p in ref.named_parameters()}, what)

    c, sc = compiled(fzero.local_mesh(2))  # another mesh of 2 ranks: the same two processes, each going on
    sc, _ = c(sc, x[0])
    with torch.no_grad():  # (its draws alone matter here: c's params are not compared)
        for r, rows in enumerate(x[0].chunk(2)):
            refs[1]._rng = streams[r]
            refs[1](rows)
    sa, _ = a(sa, x[1])
    reference(0, x[1])
    _assert_params(a.gather(sa), {k: p.detach() for k, p in refs[0].named_parameters()}, "step a after another mesh's")

    d, sd = compiled(None)  # one rank: it draws from the module's stream itself, from rank 0's state
    sd, _ = d(sd, x[2])
    with torch.no_grad():
        refs[1]._rng = streams[0]
        refs[1](x[2])
    sa, _ = a(sa, x[3])  # the stream moved since the ranks left it: both start from rank 0's, not stale ones
    streams[1] = copy.deepcopy(streams[0])
    reference(0, x[3])
    _assert_params(a.gather(sa), {k: p.detach() for k, p in refs[0].named_parameters()}, "step a after one rank's")
    assert list(model._rng.random(4)) == list(streams[0].random(4))


@pytest.mark.parametrize("draws", ["module_held", "global_generator"])
def test_two_steps_each_on_its_own_local_mesh_alternated_equal_them_on_one_shared_mesh(draws):
    """Two step objects, each given its own ``fzero.local_mesh(2)`` (a GAN's generator and discriminator steps, two
    ``fzero.compile`` calls in a notebook), alternated, with ranks that draw other amounts (a module-held stream, or a
    data-dependent ``torch.rand(k)`` from torch's global generator in ``loss_fn``). Both meshes stand for the same two
    processes, so each rank's streams go on through both steps, as on one shared mesh (which equals torchrun, the test
    above): each mesh carried its own per-rank states, stale once the other mesh's step ran, so every rank restarted
    from rank 0's state at each alternation (2.0e-2 and 7.7e-2 off in the params after 4 steps, silently). A run after
    them that reseeds gives the first run's numbers again: nothing carried leaks past a ``torch.manual_seed``."""
    x = _uneven_rows(4)

    def run(shared: bool) -> list[dict]:
        torch.manual_seed(0)
        model = _DrawsPerKeptRow("numpy_generator") if draws == "module_held" else nn.Linear(WIDTH, WIDTH)

        def loss_fn(p, b):
            out = fzero.apply(model, p, b)
            if draws == "global_generator":  # one value per kept row, from the rank's own stream
                out = out * (1 + torch.rand(int((b[:, 0] > 0).sum())).sum())
            return out.pow(2).mean()

        mesh = fzero.local_mesh(2)
        steps = [fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0,
                               mesh=mesh if shared else fzero.local_mesh(2)) for _ in range(2)]
        states = [s.init(fzero.params_of(model)) for s in steps]
        for i, b in enumerate(x):
            states[i % 2], _ = steps[i % 2](states[i % 2], b)
        return [s.gather(st) for s, st in zip(steps, states)]

    one = run(shared=True)
    for what, got in (("two meshes", run(shared=False)), ("one mesh again, reseeded", run(shared=True))):
        for j in range(2):
            for name, p in one[j].items():
                assert torch.equal(got[j][name], p), (what, j, name, (got[j][name] - p).abs().max().item())


def test_a_local_mesh_evaluate_inside_another_local_meshs_loss_fn_starts_its_ranks_from_the_enclosing_ranks_stream():
    """A local mesh run inside a rank's program (an ``evaluate`` that ``loss_fn`` calls) stands for ranks inside that
    rank's process: its ranks start from the enclosing rank's stream, never from the states the process carries for
    the enclosing mesh's size (given those, the inner run in rank 0's thread gave its rank 1 the enclosing rank 1's
    numbers once the outer ranks had drawn other amounts)."""
    x = _uneven_rows(2)
    torch.manual_seed(0)
    inner_model, outer_model = nn.Linear(WIDTH, 1), nn.Linear(WIDTH, WIDTH)
    inner = fzero.compile(lambda p, b: (fzero.apply(inner_model, p, b).pow(2).mean(), torch.rand(1)),
                          optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2))
    inner_state = inner.init(fzero.params_of(inner_model))
    drawn: list = []
    nested = [False]  # the second step's loss_fn runs the inner evaluate, before its own draws

    def loss_fn(p, b):
        if nested[0]:
            drawn.append([float(u) for u in inner.evaluate(inner_state, torch.zeros(2, WIDTH))["aux_per_rank"]])
        out = fzero.apply(outer_model, p, b)
        return (out * (1 + torch.rand(int((b[:, 0] > 0).sum())).sum())).pow(2).mean()

    outer = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2))
    state, _ = outer(outer.init(fzero.params_of(outer_model)), x[0])  # the ranks draw 2 and 0 values
    nested[0] = True
    outer(state, x[1])
    assert len(drawn) == 2 and all(a == b for a, b in drawn), drawn  # each inner call: both ranks from one stream
    assert drawn[0] != drawn[1]  # (the enclosing ranks' streams, apart after the first step)


class _AuxOnSelf(nn.Module):
    """An auxiliary loss kept on the module by its forward (as MoE layers keep theirs), for loss_fn to add."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.lin(x)
        self.aux_loss = h.pow(2).mean()
        return self.head(torch.tanh(h))

    def with_aux(self, x):
        return self(x), self.aux_loss


@pytest.mark.parametrize("stages", [0, 3])
def test_an_aux_loss_read_off_the_module_in_loss_fn_is_named_and_a_method_returning_it_trains_as_pytorch(stages):
    """``loss = task + model.aux_loss`` after ``fzero.apply`` read the user's module, which the step's copy writes only
    when the step returns: a bare "'_AuxOnSelf' object has no attribute 'aux_loss'" at the first step (and, with the
    attribute set before, the old value without a gradient: 4e-2 off PyTorch after 3 steps). The error now says why and
    names the fix, a bound method run through fzero.apply, which trains as PyTorch."""
    torch.manual_seed(0)
    model = _AuxOnSelf()
    reference = copy.deepcopy(model)
    batches = _batches(3)
    bad = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean() + model.aux_loss,
                        optimizer=fzero.optim.adamw(1e-2), stages=stages)
    with pytest.raises(AttributeError, match=r"fzero.apply\(model.method, params, x\)"):
        bad(bad.init(fzero.params_of(model)), batches[0])

    def loss_fn(p, x):
        out, aux = fzero.apply(model.with_aux, p, x)
        return out.pow(2).mean() + aux

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=stages)
    state = step.init(fzero.params_of(model))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x in batches:
        state, _ = step(state, x)
        opt.zero_grad()
        out = reference(x)
        (out.pow(2).mean() + reference.aux_loss).backward()
        opt.step()
    got = step.gather(state)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-6)


class _AuxSetInInit(_AuxOnSelf):
    """``_AuxOnSelf`` with the attribute set in ``__init__`` (as many MoE layers do), and a constant the forward rebuilds
    each call with the same value (a cached mask), a dict of statistics it rebinds, and a tensor it counts in place."""

    def __init__(self):
        super().__init__()
        self.aux_loss = torch.zeros(())
        self.mask = torch.ones(WIDTH)
        self.stats = {"norm": torch.zeros(())}
        self.calls = torch.zeros(())

    def forward(self, x):
        self.mask = torch.ones(WIDTH)
        self.stats = {"norm": x.norm()}
        self.calls.add_(1)
        return super().forward(x * self.mask)


@pytest.mark.parametrize("stages", [0, 1, 2, 3])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_value_the_forward_replaced_read_off_the_module_is_refused_by_name_before_any_update(stages, ranks):
    """Where ``__init__`` (or an earlier step) set ``self.aux_loss``, ``loss = task + model.aux_loss`` after
    ``fzero.apply`` read the value from before the step, without a gradient: it trained silently wrong (4e-2 off
    PyTorch after 3 steps). The first step now refuses a use of the attribute read after the forward replaced it on
    fzero's copy, naming its path and the fix, before any update (the state trains on unchanged afterwards). What is
    current is let through: a value rebuilt equal (a cached mask), a tensor changed in place, and the value read
    before the forward (the last step's, used on purpose)."""
    torch.manual_seed(0)
    model = _AuxSetInInit()
    batches = _batches(2)
    mesh = fzero.local_mesh(ranks) if ranks > 1 else None
    settings = dict(optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=mesh)
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean() + model.aux_loss, **settings)
    state = step.init(fzero.params_of(model))
    with pytest.raises(ValueError, match=r"`aux_loss` \(_AuxSetInInit.aux_loss\).*fzero.apply\(model.with_aux"):
        step(state, batches[0])
    assert type(model.aux_loss) is torch.Tensor  # the module's own tensor again after the refusal

    def current(p, x):  # reads only what is current, or read on purpose before the forward
        before = model.aux_loss
        out = fzero.apply(model, p, x)
        return out.pow(2).mean() + 0.0 * before + out.mean() * model.mask.sum() * 0.0 + model.calls * 0.0

    good = fzero.compile(current, **settings)
    plain = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), **settings)
    state_good = good.init(fzero.params_of(model))
    state_plain = plain.init(fzero.params_of(model))
    for x in batches:
        state_good, _ = good(state_good, x)
        state_plain, _ = plain(state_plain, x)
        state, _ = plain(state, x)  # the state the refused steps were given: intact
    for name, p in plain.gather(state_plain).items():
        torch.testing.assert_close(good.gather(state_good)[name], p, rtol=0, atol=0)
        torch.testing.assert_close(plain.gather(state)[name], p, rtol=0, atol=0)


@pytest.mark.parametrize("stages", [0, 3])
def test_the_stale_read_check_leaves_what_is_not_read_off_the_module_after_the_forward_as_pytorch_runs_it(stages):
    """The first version of the check was a ``TorchFunctionMode`` over all of the first ``loss_fn`` call, refusing any use
    of the replaced tensor object: torch's fast paths were off outside the forward, so a frozen ``nn.TransformerEncoder``
    teacher called directly in ``loss_fn`` (distillation, as docs/migrating.md says) with a padding mask returned other
    values on the first step (loss 1.40 for PyTorch's 1.17); a warning torch raised from an op in ``loss_fn`` named
    fzero's file, not the user's line; and a tensor the module held and the forward replaced was refused where
    ``loss_fn`` used it through another name (a shared table). Now the user's module holds a refusing alias of it,
    so only a read of the attribute after the forward is refused, and no mode is entered."""
    import warnings

    import torch.nn.functional as F

    torch.manual_seed(0)
    width = 8
    teacher = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 2, 16, dropout=0.0, batch_first=True), 2).eval()
    teacher.requires_grad_(False)
    student = _TableStudent(width)
    reference = copy.deepcopy(student)
    x = torch.randn(3, 5, width)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True

    def distill(run, x):
        with torch.no_grad():
            target = teacher(x, src_key_padding_mask=mask)
        out = run(x)
        return F.mse_loss(out, target) + F.mse_loss(out[:, 0], target[:, :1, 0]) + 0.1 * (out * _TABLE).mean()

    step = fzero.compile(lambda p, x: distill(lambda t: fzero.apply(student, p, t), x),
                         optimizer=fzero.optim.sgd(0.1), stages=stages)
    state = step.init(fzero.params_of(student))
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state, metrics = step(state, x)
        assert {w.filename for w in seen if "target size" in str(w.message)} == {__file__}
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = distill(reference, x)
        loss.backward()
        opt.step()
        assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(step.gather(state)[name], p.detach(), rtol=0, atol=1e-6)
    assert torch._C._len_torch_function_stack() == 0


_TABLE = torch.linspace(0, 1, 8)  # a table shared by the module and the loss


class _TableStudent(nn.Module):
    """Holds the shared table under a public name, which its forward replaces with a copy (as a cache is rebuilt)."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.table = _TABLE

    def forward(self, x):
        self.table = self.table * 1.0 + x.new_zeros(()).detach() + 1.0
        return self.lin(x)


class _MomentumKey(nn.Module):
    """MoCo's shape: a key layer kept frozen and moved toward the trained query layer inside ``forward``."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH).requires_grad_(False)

    def forward(self, x):
        if self.how is not None:
            with torch.no_grad():
                if self.how == "data":  # the MoCo reference code's form
                    self.k.weight.data = self.k.weight.data * 0.5 + self.q.weight.data * 0.5
                else:
                    self.k.weight.mul_(0.5).add_(self.q.weight, alpha=0.5)
        return (self.q(x) * self.k(x)).sum()


@pytest.mark.parametrize("how", ["data", "in place"])
@pytest.mark.parametrize("stages", [0, 2])
def test_a_frozen_param_the_forward_writes_moves_once_a_step_or_is_refused_on_a_local_mesh_of_two_ranks(stages, how):
    """The rank threads shared the module's frozen tensor, so each wrote it: moved twice a step on local_mesh(2)
    (0.0625 of the way left after 2 steps where torchrun's processes leave 0.25), silently."""
    def run(ranks, how):
        torch.manual_seed(0)
        model = _MomentumKey(how)
        k0, q0 = model.k.weight.detach().clone(), model.q.weight.detach().clone()
        step = fzero.compile(lambda p, b: fzero.apply(model, p, b), optimizer=fzero.optim.sgd(0.0), stages=stages,
                             mesh=fzero.local_mesh(ranks) if ranks > 1 else None)
        state = step.init(fzero.params_of(model))
        for _ in range(2):
            state, _ = step(state, torch.ones(4, WIDTH))
        return ((model.k.weight - q0) / (k0 - q0)).mean().item()

    assert run(1, how) == pytest.approx(0.25)  # as PyTorch: once a step
    with pytest.raises(ValueError, match=r"(?s)fzero.Step.__call__: the forward wrote the frozen param\(s\) \['k.weight'\] "
                                         r"of _MomentumKey.*local_mesh of 2 ranks.*step.gather\(state\).*register_buffer"):
        run(2, how)
    assert run(2, None) == pytest.approx(1.0)  # a forward that only reads it: not refused


@pytest.mark.parametrize("stages", [0, 2])  # (at stage 3 a forward gathers with the other ranks: no rank's ends first)
def test_on_a_local_mesh_a_rank_reading_the_value_before_its_forward_is_not_refused_for_another_ranks_check(stages):
    """The rank threads of a local mesh share the user's module, and every rank's check refused any alias: a rank that
    read ``model.aux_loss`` before its own forward (the last step's value, used on purpose, as on one rank) got the
    alias of a rank whose forward had ended first, and was refused at random, as the threads ran. An alias now
    refuses only in the ``loss_fn`` of the rank that put it in. Forced here: one rank pauses after its forward (its
    alias in the module) while the other reads the value before its forward."""
    import threading
    import time

    from fzero.step._stale import StaleAlias

    torch.manual_seed(0)
    model = _AuxSetInInit()
    lock, entered = threading.Lock(), []

    def loss_fn(p, x):
        with lock:
            entered.append(None)
            first = len(entered) == 1
        if first:  # its forward, then other work in loss_fn while the other rank begins
            out = fzero.apply(model, p, x)
            time.sleep(0.3)
            return out.pow(2).mean()
        waited = time.monotonic()
        while not isinstance(model.__dict__["aux_loss"], StaleAlias) and time.monotonic() - waited < 2:
            time.sleep(0.005)
        before = model.aux_loss  # the value from before the step, read before this rank's forward
        out = fzero.apply(model, p, x)
        return out.pow(2).mean() + 0.0 * before

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    state, metrics = step(state, _batches(1)[0])
    assert type(model.__dict__["aux_loss"]) is torch.Tensor


@pytest.mark.parametrize("stages", [0, 3])
def test_a_copy_of_the_module_made_while_it_holds_an_alias_copies_the_tensor_and_is_not_refused(stages):
    """``copy.deepcopy(model)`` after the forward in the first ``loss_fn`` call (a teacher made there), or in a thread
    of the user's while that call runs, met the alias: refused in ``loss_fn`` as a use of ``aux_loss`` (the copy uses
    no value in the loss), and in the user's thread torch's "default implementation of __deepcopy__() for non-wrapper
    subclasses" error; ``torch.save(model)`` pickled the alias with fzero's class and the whole module in its state.
    A copy now copies the tensor the alias stands for."""
    import io
    import threading

    torch.manual_seed(0)
    model = _AuxSetInInit()
    made = {}

    def loss_fn(p, x):
        out = fzero.apply(model, p, x)
        made["teacher"] = copy.deepcopy(model)
        thread = threading.Thread(target=lambda: made.__setitem__("thread", copy.deepcopy(model)))
        thread.start()
        thread.join()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        made["saved"] = buffer.getvalue()
        return out.pow(2).mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=stages)
    state = step.init(fzero.params_of(model))
    before = model.aux_loss
    step(state, _batches(1)[0])
    for copied in (made["teacher"], made["thread"]):
        assert type(copied.aux_loss) is torch.Tensor and torch.equal(copied.aux_loss, before)
    assert b"StaleAlias" not in made["saved"]
    loaded = torch.load(io.BytesIO(made["saved"]), weights_only=False)
    assert type(loaded.aux_loss) is torch.Tensor


class _Wrapped(torch.Tensor):
    """A wrapper tensor subclass (as DTensor is one): its own ``__torch_dispatch__`` over an inner tensor."""

    @staticmethod
    def __new__(cls, inner):
        t = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        out = func(*tree_map(lambda x: x.inner if isinstance(x, _Wrapped) else x, args), **(kwargs or {}))
        return tree_map(lambda x: _Wrapped(x) if isinstance(x, torch.Tensor) else x, out)

    __torch_function__ = torch._C._disabled_torch_function_impl


class _HoldsOtherTensors(nn.Module):
    """Rebuilds in each forward a sparse adjacency (equal each time, a cache), a nested tensor, and a wrapper tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.adj = torch.eye(WIDTH).to_sparse()
        self.ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        self.tagged = _Wrapped(torch.zeros(2))

    def forward(self, x):
        self.adj = torch.eye(WIDTH).to_sparse()
        self.ragged = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        self.tagged = _Wrapped(x.detach().mean(0)[:2])
        return torch.sparse.mm(self.adj, self.lin(x).t()).t()


@pytest.mark.parametrize("stages", [0, 3])
def test_the_stale_read_check_takes_sparse_nested_and_wrapper_tensors_a_forward_replaced(stages):
    """The first step's check compared a replaced tensor with ``torch.equal`` and aliased it with ``_make_subclass``:
    a module whose forward rebuilt a sparse tensor failed the first step with "Could not run 'aten::equal' with
    arguments from the 'SparseCPU' backend", a nested one with "NestedTensorImpl doesn't support sizes", and a wrapper
    subclass (DTensor's kind) with "Creating a new Tensor subclass StaleAlias but the raw Tensor object is already
    associated to a python object", though loss_fn read nothing stale. A sparse cache rebuilt equal is current, as a
    dense one is: loss_fn may use it."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's: nested tensors are a prototype
        model = _HoldsOtherTensors()
        step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean() + torch.sparse.sum(model.adj) * 0.0,
                             optimizer=fzero.optim.sgd(0.1), stages=stages)
        state = step.init(fzero.params_of(model))
        for x in _batches(2):
            state, _ = step(state, x)
    assert type(model.tagged) is _Wrapped and model.adj.layout == torch.sparse_coo


class _SwitchingBlock(nn.Module):
    """Swaps a submodule for good at its first forward, as Hugging Face BigBird's forward does (``set_attention_type``
    puts a full-attention module in place of the block-sparse one when the sequence is too short for it), or adds one."""

    def __init__(self, how):
        super().__init__()
        self.lin, self.act, self.how, self.mode = nn.Linear(WIDTH, WIDTH), nn.Tanh(), how, "tanh"

    def forward(self, x):
        if self.mode == "tanh":
            self.mode = "relu"
            if self.how == "replaced":
                self.act = nn.ReLU()
            else:
                self.extra = nn.ReLU()
        return self.act(self.lin(x)) + (self.extra(x) if hasattr(self, "extra") else 0)


@pytest.mark.parametrize("how", ["replaced", "added"])
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("stages", [0, 1, 2, 3])
def test_a_submodule_the_forward_replaces_or_adds_is_refused_by_name(stages, ranks, how):
    """PyTorch keeps the new submodule on the module; fzero's copy was dropped after the step, so the next step ran the
    module as it was (while ``mode`` was written back: 0.7 off PyTorch after 3 SGD steps, silently), and the new
    module's public attributes were written onto the old one (``inplace`` onto the Tanh)."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ModuleList([_SwitchingBlock(how)])[0])  # a unit at stages 2-3
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), optimizer=fzero.optim.sgd(0.1),
                         stages=stages, mesh=fzero.local_mesh(ranks))
    state = step.init(fzero.params_of(model))
    what = "replaced the submodule `1.act` \\(Tanh\\) with a ReLU" if how == "replaced" else "added the submodule `1.extra`"
    with pytest.raises(RuntimeError, match=f"(?s)fzero.apply: the forward of Sequential {what}.*before fzero.params_of"):
        step(state, _batches(1)[0])
    block = model[1]
    assert type(block.act) is nn.Tanh and "inplace" not in vars(block.act) and block.mode == "tanh"
    assert not hasattr(block, "extra")
