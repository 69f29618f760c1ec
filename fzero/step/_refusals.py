"""The refusals a step makes once, never at a later step: of a module at ``params_of`` and ``step.init`` (tensors
whose memory was given away: ``check_not_freed``; a model FSDP shards already: ``check_not_fsdp``), at the first forward
with a graph, where ``fzero.step._batch.LossFnInContext`` checks what only a forward shows (state params that name a
module's buffer: ``check_no_trained_buffers``; a loss that depends on a parameter of a module's own:
``check_own_params``; under ``dist_mesh``, ranks that ran modules of different structures: ``agree_structure``), and
before an export names a state's tensors by a module (``check_export_model``); and the message of a buffer two models
share (``_shared_buffer_message``), built only when ``Buffers`` refuses one.

Kept apart from ``fzero.step._module`` and ``fzero.step._batch``, whose ``apply``, buffer bank, batch splitting and
gradient run at every step, so that a later step runs through none of this (tests/test_structure.py bounds the fzero
files a step runs functions from).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fzero.layout import freed, named_tensors, same_values


def check_not_freed(named: Any, *, api: str, what: str) -> None:
    """Refuse, by name, tensors whose memory was given away (``freed``): read, they crash the process."""
    gone = [name for name, t in named if isinstance(t, torch.Tensor) and freed(t)]
    if gone:
        raise ValueError(
            f"{api}: the {what} {gone[:4]}{' ...' if len(gone) > 4 else ''} hold no memory: it was given to a state by "
            f"step.init(..., donate=True), and their values are the state's now (reading them here would crash the "
            f"process). Take the values from the state: step.gather(state) gives the params whole, and "
            f"model.load_state_dict(step.state_dict(state, model), assign=True) puts them back into the module."
        )


def _fsdp_classes() -> tuple[type, ...]:
    """FSDP's module classes in this torch (FSDP2's ``FSDPModule`` mixin, FSDP1's wrapper), where torch.distributed is."""
    try:
        import torch.distributed.fsdp as fsdp
    except ImportError:  # a torch built without distributed
        return ()
    return tuple(c for c in (getattr(fsdp, "FSDPModule", None), getattr(fsdp, "FullyShardedDataParallel", None)) if c)


def check_not_fsdp(module: nn.Module, *, api: str) -> None:
    """Refuse a model that FSDP shards already (``fully_shard``, ``FullyShardedDataParallel``). Its parameters are
    FSDP's shards (DTensors, or flat parameters), which FSDP gathers in its own hooks around each forward: read by fzero
    they failed deep inside torch ("Attempted to access the data pointer on an invalid python storage"), with no word
    of FSDP. fzero shards the model itself, so the fix is to leave FSDP out."""
    classes = _fsdp_classes()
    if not classes:
        return
    for path, m in module.named_modules():
        if isinstance(m, classes):
            raise TypeError(
                f"{api}: {f'the submodule {path!r} of {type(module).__name__}' if path else f'the model ({type(m).__name__})'} is sharded "
                f"by FSDP ({type(m).__name__}: fully_shard or FullyShardedDataParallel), whose parameters are shards "
                f"that FSDP gathers in its own hooks, so fzero cannot read or run them. fzero shards the model itself: "
                f"build it without FSDP and compile(..., stages=3) (FSDP2's fully_shard per layer is fzero's units; its "
                f"reshard_after_forward=True is stages=3, False is stages=2); DDP's counterpart is stages=0."
            )


def check_no_trained_buffers(params: Mapping[str, Any], modules: list[nn.Module]) -> None:
    """At the first forward with a graph (stages 0-1): refuse a state whose params name a buffer of a module that
    ``fzero.apply`` ran, and a parameter of none. ``functional_call`` binds a buffer by name as readily as a
    parameter, so the step differentiated it and the optimizer moved it (a running statistic or a constant scale
    trained by AdamW), where torch.optim and DeepSpeed train parameters only: what ``step.init(model.state_dict())``
    or ``step.init(torch.load(path))`` gives, since a state dict holds the buffers beside the parameters. Stages 2-3
    refuse such a name when they build the step's copy of the module (the names of its trainable parameters)."""
    buffers: dict[str, nn.Module] = {}
    held: set[str] = set()
    for module in modules:
        held.update(name for name, _ in named_tensors(module, "_parameters", remove_duplicate=False))
        for name, _ in named_tensors(module, "_buffers", remove_duplicate=False):
            buffers.setdefault(name, module)
    trained = [name for name in params if isinstance(name, str) and name in buffers and name not in held]
    if not trained:
        return
    module = buffers[trained[0]]
    raise ValueError(
        f"fzero.Step: the state's params hold {trained[:4]}{' ...' if len(trained) > 4 else ''}, which "
        f"{'are buffers' if len(trained) > 1 else 'is a buffer'} of {type(module).__name__}, not "
        f"{'parameters' if len(trained) > 1 else 'a parameter'}: the step "
        f"would train {'them' if len(trained) > 1 else 'it'} (an optimizer update of a running statistic or a constant), "
        f"where torch.optim and DeepSpeed train parameters only. A state dict (model.state_dict(), torch.load of a "
        f"checkpoint) holds buffers beside the parameters. Make the state from the parameters: "
        f"step.init(fzero.params_of(model)) after model.load_state_dict(...), or leave the buffers' names out of the "
        f"dict given to init; the step takes the module's buffers itself (step.init(params, buffers=...) sets their "
        f"values)."
    )


def check_export_model(module: Any, held: Any, *, api: str, complete: bool = False, error: type = ValueError) -> None:
    """Refuse to name a state's (or a checkpoint's) tensors by ``module`` where the result would be silently wrong:
    ``module`` is not the model they were made from, yet every name they hold is one of its names.

    - two names the state holds separately are one tied tensor in ``module`` (a state of an untied configuration,
      ``tie_word_embeddings=False``): a state dict would carry both values for one tensor, and whichever loads last wins;
    - a parameter of ``module`` that the state lacks and that is trainable there (``complete``: any, frozen or not):
      an export takes it from the module, which holds its initial values (a state of a configuration with fewer
      layers exported with a deeper one). A frozen parameter comes from the module by design, as ``fzero.apply`` reads
      it. ``complete``: ``held`` lists every parameter of the model it was made from (a checkpoint saved with
      ``model=``, which names its frozen parameters too).

    ``held``: the names of the params held (buffers among them are ignored). Names ``module`` lacks are the
    caller's to report (another model altogether), so nothing is checked then."""
    named = list(module.named_parameters(remove_duplicate=False))
    held = set(held)
    if not held <= {n for n, _ in named} | {n for n, _ in module.named_buffers(remove_duplicate=False)}:
        return
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, p in named:
        groups.setdefault(id(p), (p, []))[1].append(name)
    for _, aliases in groups.values():
        separate = [a for a in aliases if a in held]
        if len(separate) > 1:
            raise error(
                f"{api}: the state holds separate values for {separate}, which are one tied parameter in "
                f"{type(module).__name__}: it was made from a configuration of the model without that tie (e.g. "
                f"tie_word_embeddings=False), and one of the values would be lost. Pass the model the state was made from."
            )
    lacking = [aliases[0] for p, aliases in groups.values() if not any(a in held for a in aliases) and (complete or p.requires_grad)]
    if lacking:
        why = ("the checkpoint was saved with model= and holds every parameter of that model, frozen ones included"
               if complete else "they are trainable there, so they are not frozen values the module holds by design")
        raise error(
            f"{api}: {type(module).__name__} has parameters the state does not hold: {lacking[:4]}"
            f"{' ...' if len(lacking) > 4 else ''}; {why}. They would be exported as the module's own (initial) values: "
            f"the state was made from another configuration of the model (fewer layers, another head). Pass the model it "
            f"was made from" + ("." if complete else "; or, if the module's values of these are the ones wanted (parameters "
            "frozen in training and unfrozen since), freeze them (requires_grad_(False)) first.")
        )


def _shared_buffer_message(module: nn.Module, first: nn.Module, name: str) -> str:
    same = " (another instance of the same class)" if type(first) is type(module) else ""
    return (
        f"fzero.apply: two modules run in this step, a {type(first).__name__} and then a {type(module).__name__}{same}, "
        f"have a persistent buffer "
        f"{name!r}, and a step's state holds the buffers of one model by name (state.buffers, as model.state_dict() "
        f"names them): the second would read and write the first one's values (a teacher's or a discriminator's "
        f"BatchNorm running on the trained model's statistics and writing its own into them), silently. Give the "
        f"other model (a frozen teacher, a GAN's discriminator) its own buffers beside its params: "
        f"fzero.apply(other, {{**other_params, **other_buffers}}, x), with other_buffers = fzero.buffers_of(other) "
        f"(or the buffers of its own step's state, its_step.state_dict(its_state)); or call it directly (other(x) "
        f"under torch.no_grad()), which reads and writes the module's own. If both are parts of the model this step "
        f"trains (its blocks applied one by one), the state cannot tell their buffers apart, and buffers given beside "
        f"the params would not be kept (their updates lost): apply the model itself, or a method of it "
        f"(fzero.apply(model.features, params, x)), so that the state names each buffer by its path in the model; to "
        f"recompute block by block, fzero.compile(..., remat=True)."
    )


def check_own_params(loss: torch.Tensor, modules: list[nn.Module]) -> None:
    """Refuse a loss whose graph reaches a module's own ``nn.Parameter`` (an autograd leaf of its own).

    Inside ``fzero.apply`` the module holds the step's params; outside it, its own tensors, which the step neither
    differentiates nor updates. An L2 term summed over ``model.parameters()`` after ``fzero.apply`` returned would
    count in the loss but add nothing to the gradient (measured: grad norm 0.955 instead of 40.3), silently. One walk
    of the first step's graph finds such leaves; the step's own leaves are plain tensors, never ``nn.Parameter``."""
    found: dict[int, nn.Parameter] = {}
    # Visited nodes by id, each kept alive: a node's Python object can be made on demand and freed once the walk
    # moves on (torch 2.11 does), and a new one could then take its address, so a set of ids alone would skip
    # nodes never visited (on the H100 machine with torch 2.11 the walk saw 3 nodes of this check's own test).
    seen: dict[int, Any] = {}
    todo = [loss.grad_fn]
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(loss):  # under torch.func.grad the module's leaves are in the level below
        loss = functorch.get_unwrapped(loss)
        todo.append(loss.grad_fn)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        leaf = getattr(node, "variable", None)  # AccumulateGrad: the graph reaches this leaf
        if isinstance(leaf, nn.Parameter):
            found[id(leaf)] = leaf
        todo.extend(fn for fn, _ in node.next_functions)
    if not found:
        return
    named = {id(p): name for m in modules for name, p in m.named_parameters(remove_duplicate=False)}
    described = [repr(n) for i, n in named.items() if i in found]  # in the module's order
    described += [f"a parameter of shape {tuple(p.shape)}" for i, p in found.items() if i not in named]
    more = f", ... {len(described) - 4} more" if len(described) > 4 else ""
    raise ValueError(
        f"fzero.Step: the loss depends on the module's own parameters ({', '.join(described[:4])}{more}), not on the "
        f"params loss_fn was given: outside fzero.apply(model, params, ...) the module holds its own tensors, which this "
        f"step neither differentiates nor updates, so such a term would count in the loss but not in the gradient. "
        f"(Inside a method that fzero.apply runs, self.parameters() at stage 3 holds a unit's params only while that "
        f"unit runs; read elsewhere, they are not the step's.) Compute it from params, e.g. an L2 term as "
        f"sum((p ** 2).sum() for p in params.values()) (or weight decay in the optimizer: fzero.optim.adamw(lr, "
        f"weight_decay=...)); a tensor that should not train goes in as a constant (.detach())."
    )


def agree_structure(comm: Any, modules: list[nn.Module]) -> None:
    """Under ``dist_mesh``, check that every rank ran modules of one structure: each submodule's path, type and
    settings (``extra_repr``), in order. Parameter names and shapes are agreed at ``Step.init``; a parameter-free
    op (GELU on one rank, Tanh on another) changes neither, and the ranks would average gradients of different
    models."""
    fields = []
    for i, module in enumerate(modules):
        model = f" of model #{i} fzero.apply ran" if len(modules) > 1 else ""
        fields += [(f"the module at {path or '<root>'!r}{model}", f"{type(m).__qualname__}({m.extra_repr()})")
                   for path, m in module.named_modules()]
    comm.agree(fields, api="fzero.Step.__call__ (the first step's fzero.apply)", fix=(
        "Every rank must run the same model: build it from the same code and config on every rank, and keep "
        "rank-dependent choices out of it."))


def check_params_hold_masters(params: Mapping[str, torch.Tensor], masters: Mapping[str, torch.Tensor], layout: Any, *,
                              rank: int, size: int, sharded: bool, chunk: int = 0,
                              release: Callable[[torch.Tensor, int, int], None] | None = None) -> None:
    """Stages 0-2 with fp32 masters (``precision="bf16"``/``"fp16"``, or an offload that keeps them): each unit's
    params (``params``: the state's flats, the tensors the forward's params view) still hold their masters' values,
    rounded, where this rank owns them. A write through ``.data`` in the forward (``self.weight.data.clamp_(-c, c)``, a
    max-norm constraint) goes around autograd's version counters, so nothing else sees it; the update starts from the
    masters and writes the params again from them, so the write was lost, silently (9.5e-2 off PyTorch after 3 SGD
    steps in bf16), where PyTorch's param keeps it. Read once per masters (``fzero.step._step``): a whole read of the
    params and masters, as much as one update's. ``chunk``: compare that many elements at a time, each master's
    ``release(master, a, b)`` called after its elements ``a:b`` are read (disk offload's mapped files: RAM holds a
    sub-group of them, as its update does); 0, a unit at a time."""
    from fzero.step._hints import DATA_WRITE

    written: list[Any] = []
    with torch.no_grad(), torch._C._DisableFuncTorch():
        for unit in layout.units:
            flat, master = params.get(unit.name), masters.get(unit.name)
            if flat is None or master is None:
                continue
            lo = unit.shard_range(rank, size)[0] if sharded else 0
            master = master.reshape(-1)
            mine = flat.detach().reshape(-1)[lo:lo + master.numel()]
            if mine.numel() != master.numel():
                continue
            step = chunk or max(master.numel(), 1)
            for c in range(0, master.numel(), step):
                d = min(c + step, master.numel())
                if not same_values(mine[c:d], master[c:d].to(mine.device, mine.dtype)):
                    for s in unit.slots:
                        a, b = max(lo + c, s.offset), min(lo + d, s.offset + s.numel)
                        if a < b and s not in written and not same_values(
                                mine[a - lo:b - lo], master[a - lo:b - lo].to(mine.device, mine.dtype)):
                            written.append(s)
                if release is not None:
                    release(master, c, d)
    if written:
        names = [s.path for s in written]
        raise RuntimeError(DATA_WRITE.format(
            how=f"wrote the trainable param(s) {names[:4]}{' ...' if len(names) > 4 else ''}",
            shape=tuple(written[0].shape),
            where="is a low-precision copy of its fp32 master, from which the update writes it again"))
