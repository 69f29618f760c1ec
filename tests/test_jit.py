"""``jit=True`` (issue 15): each unit's forward through ``torch.compile`` at stages 2-3 (regional compilation),
on CPU through inductor's C++ backend. The same results as eager within 1e-5, a compiled graph really
captured (no silent eager fallback), and errors that name the unit where it cannot compile."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import fzero
from fzero.models import GPT, GPTConfig, gpt_loss
from fzero.testing import assert_trees_close
from fzero.zero import shard_grads, shard_optimizer, shard_params
from fzero.zero._jit import UnitCompileError

# inductor imports torch.utils.mkldnn, which uses torch.jit.script_method: torch's own warning, at import time
# and dynamo reads .grad of the unit's params (views of the gathered buffer, not leaves) when it traces them
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")]


def _problem():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=2, d_model=64, n_head=4))

    def loss_fn(p, b):
        return gpt_loss(fzero.apply(model, p, b["x"]), b["y"])

    batches = []
    for k in range(3):
        x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(k))
        batches.append({"x": x, "y": x.roll(1, 1)})
    return model, loss_fn, batches


def _step(loss_fn, *, stage, jit, mesh=None, autodiff="autograd"):
    # SGD: a parameter difference is the gradient difference times lr; Adam would turn the rounding noise of a
    # near-zero gradient element (compiled kernels round differently) into a step of about lr
    s = fzero.train_step(loss_fn, fzero.optim.sgd(0.1), autodiff=autodiff)
    s = shard_grads(shard_optimizer(s, mesh), jit=jit)
    return shard_params(s) if stage == 3 else s


def _run(model, step, batches):
    state = step.init(fzero.params_of(model))
    out = []
    for b in batches:
        state, m = step(state, b)
        out.append((step.gather(state), m["loss"]))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_jit_equals_eager_and_really_compiles(stage):
    model, loss_fn, batches = _problem()
    eager = _run(model, _step(loss_fn, stage=stage, jit=False), batches)
    torch._dynamo.reset()
    counters.clear()
    jitted = _run(model, _step(loss_fn, stage=stage, jit=True, mesh=fzero.local_mesh(1)), batches)
    assert counters["stats"]["unique_graphs"] >= 1  # the block's forward was captured, not run eagerly
    for (p_jit, loss_jit), (p_eager, loss_eager) in zip(jitted, eager):
        assert_trees_close(p_jit, p_eager, rtol=1e-5, atol=1e-5)
        assert loss_jit == pytest.approx(loss_eager, rel=1e-5)
    start = fzero.params_of(model)
    assert max((jitted[-1][0][n] - start[n]).abs().max() for n in start) > 1e-3  # it trained


def test_jit_refuses_what_would_silently_run_eagerly():
    model, loss_fn, batches = _problem()
    with pytest.raises(UnitCompileError, match=r"unit 'blocks.0' runs under a TorchDispatchMode .*local_mesh\(n\) with n > 1"):
        _run(model, _step(loss_fn, stage=3, jit=True, mesh=fzero.local_mesh(2)), batches[:1])
    with pytest.raises(UnitCompileError, match=r"inside torch.func.grad .*autodiff='autograd'"):
        _run(model, _step(loss_fn, stage=2, jit=True, autodiff="func"), batches[:1])
    with pytest.raises(TypeError, match=r"fzero.shard_grads: jit must be True or False, got 'yes'"):
        shard_grads(shard_optimizer(fzero.train_step(loss_fn, fzero.optim.sgd(0.1))), jit="yes")


def test_a_compile_failure_names_the_unit(monkeypatch):
    model, loss_fn, batches = _problem()

    def failing_compile(module, **options):
        def call(*args, **kwargs):
            raise torch._dynamo.exc.Unsupported("data-dependent branch the compiler cannot trace")

        return call

    monkeypatch.setattr("fzero.zero._jit.torch.compile", failing_compile)
    with pytest.raises(UnitCompileError, match=r"torch.compile failed on unit 'blocks.0' \(Block\): Unsupported: data-dependent") as info:
        _run(model, _step(loss_fn, stage=3, jit=True), batches[:1])
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)


def test_jit_leaves_errors_of_the_model_itself_alone():
    model, loss_fn, batches = _problem()
    bad = [{"x": b["x"][:, :8], "y": b["y"]} for b in batches[:1]]  # a target of another length: the loss's own error
    with pytest.raises(Exception) as info:
        _run(model, _step(loss_fn, stage=2, jit=True), bad)
    assert not isinstance(info.value, UnitCompileError)


def test_compile_takes_jit_at_stages_2_3_and_refuses_it_below():
    model, loss_fn, batches = _problem()
    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, jit=True)
    assert step.unit_settings.jit and step.stage == 3
    assert not fzero.compile(loss_fn, stages=2).unit_settings.jit
    with pytest.raises(ValueError, match=r"fzero.compile: jit only applies at stages=2 or 3 .*compile the model yourself"):
        fzero.compile(loss_fn, stages=1, jit=True)
    with pytest.raises(TypeError, match=r"unknown setting 'jti'. Did you mean 'jit'\?"):
        fzero.compile(loss_fn, stages=3, jti=True)


def test_jit_compiles_each_unit_class_once_for_the_steps_life(monkeypatch):
    """torch keeps every backend a ``torch.compile`` call makes until ``torch._dynamo.reset()``, so a step that compiled
    each unit's module anew (a new skeleton every step) grew the host's memory by every unit of every step (about
    0.6 KB each, measured with tracemalloc). The class's forward is compiled once; three steps of two blocks make
    one ``torch.compile`` call, and the second and third steps compile nothing new."""
    model, loss_fn, batches = _problem()
    calls = []
    real = torch.compile

    def counting(fn, *args, **kwargs):
        calls.append(getattr(fn, "__qualname__", type(fn).__name__))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr("fzero.zero._jit.torch.compile", counting)
    torch._dynamo.reset()
    counters.clear()
    step = _step(loss_fn, stage=3, jit=True, mesh=fzero.local_mesh(1))
    state = step.init(fzero.params_of(model))
    state, _ = step(state, batches[0])
    frames = counters["frames"]["total"]
    for b in batches[1:]:
        state, _ = step(state, b)
    assert calls == ["Block.forward"], calls
    assert counters["frames"]["total"] == frames  # later steps reuse the first step's compiled frame


class _SequentialNet(torch.nn.Module):
    """Two units that are nn.Sequential blocks of one class (Linear, optional Dropout, GELU) between two Linears."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        extra = [torch.nn.Dropout(dropout)] if dropout else []
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(16, 16), *extra, torch.nn.GELU()) for _ in range(2)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def test_jit_compiles_a_torch_nn_block_once_and_equals_eager(monkeypatch):
    """Units that are ``nn.Sequential`` blocks (their forward is torch's own, which torch.compile does not start
    tracing at) are compiled once too, through a frame of fzero's, and train as eager."""
    torch.manual_seed(0)
    net = _SequentialNet()

    def loss_fn(p, b):
        return fzero.apply(net, p, b).square().mean()

    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    eager = _run(net, _step(loss_fn, stage=3, jit=False), batches)
    calls = []
    real = torch.compile
    monkeypatch.setattr("fzero.zero._jit.torch.compile", lambda fn, *a, **k: calls.append(fn.__qualname__) or real(fn, *a, **k))
    torch._dynamo.reset()
    counters.clear()
    jitted = _run(net, _step(loss_fn, stage=3, jit=True, mesh=fzero.local_mesh(1)), batches)
    assert calls == ["_inline.<locals>.unit_forward"], calls
    assert counters["stats"]["unique_graphs"] >= 1
    for (p_jit, loss_jit), (p_eager, loss_eager) in zip(jitted, eager):
        assert_trees_close(p_jit, p_eager, rtol=1e-5, atol=1e-5)
        assert loss_jit == pytest.approx(loss_eager, rel=1e-5)


def test_a_hook_inside_one_unit_and_dropout_train_as_eager():
    """Two blocks of one class, a forward hook on a module inside the second only, dropout in both. One graph for the
    class, traced on the first block, ran for the second and its hook never did (torch does not guard on hooks of
    modules inside a compiled frame): 1.5e-3 off eager after two steps; and inductor drew its own dropout masks
    (1.3e-2 off). Now a unit whose inner hooks differ has graphs of its own, and dropout draws from torch's
    generator as eager does."""
    torch.manual_seed(0)
    net = _SequentialNet(dropout=0.3)
    ran = []

    def halve(module, args, out):
        ran.append(1)
        return out * 0.5

    net.blocks[1][0].register_forward_hook(halve)

    def loss_fn(p, b):
        return fzero.apply(net, p, b).square().mean()

    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    torch.manual_seed(1)
    eager = _run(net, _step(loss_fn, stage=3, jit=False), batches)
    assert len(ran) == 2
    torch._dynamo.reset()
    torch.manual_seed(1)
    jitted = _run(net, _step(loss_fn, stage=3, jit=True, mesh=fzero.local_mesh(1)), batches)
    assert len(ran) == 4  # the hook ran in both compiled steps
    for (p_jit, loss_jit), (p_eager, loss_eager) in zip(jitted, eager):
        assert_trees_close(p_jit, p_eager, rtol=1e-5, atol=1e-6)


def test_jit_refuses_units_it_would_run_eagerly_without_a_word():
    """Under fzero.remat (torch.compile falls back to eager under its watch), an RNN in a unit (a graph break), and a
    Hugging Face cache handed to each layer (use_cache=True: one compile per layer, eager past the recompile limit)."""
    model, loss_fn, batches = _problem()
    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=3, jit=True, remat=True)
    with pytest.raises(UnitCompileError, match=r"unit 'blocks.0' runs under fzero.remat \(remat=True\).*Use one of them"):
        _run(model, step, batches[:1])

    class Recurrent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnns = torch.nn.ModuleList([torch.nn.LSTM(4, 4, batch_first=True)])

        def forward(self, x):
            return self.rnns[0](x)[0]

    rnn = Recurrent()
    step = fzero.compile(lambda p, b: fzero.apply(rnn, p, b).sum(), optimizer=fzero.optim.sgd(0.1), stages=3, jit=True)
    with pytest.raises(UnitCompileError, match=r"unit 'rnns.0' \(LSTM\) holds an LSTM, which torch.compile does not compile"):
        _run(rnn, step, [torch.randn(2, 3, 4)])

    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2))
    step = fzero.compile(lambda p, b: fzero.apply(hf, p, input_ids=b, labels=b).loss, optimizer=fzero.optim.sgd(0.1),
                         stages=3, jit=True)
    with pytest.raises(UnitCompileError, match=r"unit 'transformer.h.0' is given a Hugging Face DynamicCache.*use_cache=False"):
        _run(hf, step, [torch.randint(0, 32, (2, 8))])


def _tanh_blocks(widths):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh())
                                 for a, b in zip(widths, widths[1:])])


def _blocks_run(model, *, jit, between=None, steps=3):
    """Params after each SGD step of stage 3 on ``model`` (units: its blocks), ``between(model, k)`` before step k."""
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).square().mean(), optimizer=fzero.optim.sgd(0.1),
                         stages=3, jit=jit)
    state = step.init(fzero.params_of(model))
    out = []
    for k in range(steps):
        if between is not None:
            between(model, k)
        state, _ = step(state, torch.randn(4, model[0][0].in_features, generator=torch.Generator().manual_seed(k)))
        out.append(step.gather(state))
    return out


def test_a_forward_set_on_a_units_module_is_refused_under_jit():
    """``module.forward = ...`` on one block (a layer skipped, accelerate's hooks): eager runs it, but jit called the
    class's compiled forward in its place: 4.7e-2 off PyTorch in the loss, silently."""
    model = _tanh_blocks([6, 6, 6])
    model[1].forward = lambda x: x
    with pytest.raises(UnitCompileError, match=r"unit '1' \(Sequential\) has a forward set on the module itself.*"
                                               r"without jit=True"):
        _blocks_run(model, jit=True, steps=1)


def test_a_global_module_hook_added_after_the_first_step_runs_inside_the_compiled_units():
    """``torch.nn.modules.module.register_module_forward_hook`` between steps: torch guards on no hook, and the first
    step's graph ran without it inside the units (6.96e-3 off eager in the loss), until it joined the graph's key."""
    handles = []

    def between(model, k):
        if k == 1:
            handles.append(torch.nn.modules.module.register_module_forward_hook(
                lambda mod, args, out: out * 0.5 if isinstance(mod, torch.nn.Linear) else None))
        if k == 2:
            handles.pop().remove()

    try:
        eager = _blocks_run(_tanh_blocks([6, 6, 6]), jit=False, between=between)
        torch._dynamo.reset()
        jitted = _blocks_run(_tanh_blocks([6, 6, 6]), jit=True, between=between)
    finally:
        for h in handles:
            h.remove()
    for got, expected in zip(jitted, eager):
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)


def test_units_past_torch_compiles_recompile_limit_are_refused_not_run_eagerly():
    """Each param shape of a class's units is a graph of its own, and torch runs a forward eagerly past its limit of
    graphs (8), with only a log line; every torch class's units shared one budget. Refused by name; the fix (a higher
    limit) trains as eager."""
    widths = [4, 5, 6, 7]  # three units of nn.Sequential, three shapes
    torch._dynamo.reset()
    # torch's config.patch, not pytest's monkeypatch: its undo deletes the option from torch's config module
    refused = r"unit '2' \(Sequential\) needs another compiled graph.*limit of 2.*recompile_limit = 64.*torch._dynamo.reset\(\)"
    with torch._dynamo.config.patch(recompile_limit=2), pytest.raises(UnitCompileError, match=refused):
        _blocks_run(_tanh_blocks(widths), jit=True, steps=1)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=3):
        jitted = _blocks_run(_tanh_blocks(widths), jit=True, steps=2)
    assert counters["stats"]["unique_graphs"] == 3
    for got, expected in zip(jitted, _blocks_run(_tanh_blocks(widths), jit=False, steps=2)):
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False  # the user's setting, back after each unit
    assert torch._dynamo.config.recompile_limit == 8  # and torch's own limit, back after the test


class _TwoAttributeBlocks(torch.nn.Module):
    """Blocks as plain attributes, no ModuleList (a forward set on the instance, closing over the module, would run the
    module's own tensors: refused by fzero.params_of)."""

    def __init__(self):
        super().__init__()
        self.block1, self.block2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.block2(torch.tanh(self.block1(x)))


@pytest.mark.parametrize("stages", [2, 3])
def test_jit_on_a_model_with_no_unit_is_refused_not_run_eagerly(stages):
    """Blocks kept as plain attributes: no default unit, every param in the root unit, which jit does not compile. Before:
    jit=True ran everything eagerly without a word (no frame compiled). Refused at step.init with the fix (units=)."""
    torch.manual_seed(0)
    model = _TwoAttributeBlocks()
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), stages=stages, jit=True)
    with pytest.raises(ValueError, match=r"fzero\.Step\.init: jit=True compiles each unit's forward, but every param is in "
                                         r"the root unit .* so nothing would be compiled\. Name the blocks as units: "
                                         r"units=fzero\.units_of\(model, module_types=YourBlock\)"):
        step.init(fzero.params_of(model))


def _one_wrapper(forward):
    def forward_with_wrapper(self, *args, **kwargs):  # one code object for every class, as transformers 5 wraps each
        return forward(self, *args, **kwargs)  # layer class's forward (GradientCheckpointingLayer)

    return forward_with_wrapper


class _TanhLayer(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    forward = _one_wrapper(lambda self, x: torch.tanh(self.lin(x)))


class _GeluLayer(_TanhLayer):
    forward = _one_wrapper(lambda self, x: torch.nn.functional.gelu(self.lin(x)))


class _SigmoidLayer(_TanhLayer):
    forward = _one_wrapper(lambda self, x: torch.sigmoid(self.lin(x)))


def _wrapped_layers_run(*, jit):
    torch.manual_seed(0)
    model = torch.nn.Sequential(_TanhLayer(6), _GeluLayer(6), _SigmoidLayer(6))
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).square().mean(), optimizer=fzero.optim.sgd(0.1),
                         stages=3, jit=jit)
    state = step.init(fzero.params_of(model))
    out = []
    for k in range(2):
        state, _ = step(state, torch.randn(4, 6, generator=torch.Generator().manual_seed(k)))
        out.append(step.gather(state))
    return out


@pytest.mark.slow  # three compiles
def test_unit_classes_whose_forward_is_one_wrapper_each_get_their_own_graph_budget():
    """transformers 5 wraps every layer class's forward in one function, so torch.compile (whose recompile limit counts
    per code object) drew all those classes' graphs from one budget of 8: after a few Hugging Face models had compiled
    in a process, the next one's units were refused as past the limit. Three classes of one graph each, under a limit
    of 2 graphs, train as eager."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=2):
        jitted = _wrapped_layers_run(jit=True)
    assert counters["stats"]["unique_graphs"] == 3
    for got, expected in zip(jitted, _wrapped_layers_run(jit=False)):
        assert_trees_close(got, expected, rtol=1e-5, atol=1e-6)
