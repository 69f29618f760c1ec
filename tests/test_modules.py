"""fzero's own walks of a module tree (``fzero.layout``) give what torch's give, and its clones are freed as soon as
they are dropped.

A step walks and clones the user's module every step; fzero does it with one stack walk rather than torch's nested
generators (host time a GPU waits for). These walks must name the same tensors in the same order as torch's
``named_parameters``/``named_buffers``, on models we did not write and on the cases torch's walk has rules for: a
submodule reached by two paths, a weight tied between two modules, a ``None`` slot.
"""

import gc
import weakref

import pytest
import torch
from torch import nn

from fzero.layout import clone_structure, named_tensors


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inner = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.a, self.b = inner, inner  # one submodule, two paths
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight  # a tied weight
        self.register_parameter("absent", None)
        self.register_buffer("mask", torch.ones(3), persistent=False)


def _models():
    yield "shared", _Shared()
    pytest.importorskip("transformers")
    import zoo

    for name in ("gpt2", "llama", "t5", "bn_cnn", "qwen2_moe_router", "whisper_encoder"):
        yield name, zoo.ZOO[name].build()


@pytest.mark.parametrize("remove_duplicate", [True, False])
def test_named_tensors_equal_torchs_walks(remove_duplicate):
    for name, model in _models():
        for kind, torchs in (("_parameters", model.named_parameters), ("_buffers", model.named_buffers)):
            ours = [(n, id(t)) for n, t in named_tensors(model, kind, remove_duplicate=remove_duplicate)]
            theirs = [(n, id(t)) for n, t in torchs(remove_duplicate=remove_duplicate)]
            assert ours == theirs, f"{name} {kind}: {ours[:4]} ... against torch's {theirs[:4]} ..."


def test_a_dropped_clone_is_freed_without_the_cyclic_collector():
    model = _Shared()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        clone = clone_structure(model, param=lambda p: p.detach().clone(), buffer=lambda b: b.clone())
        assert clone.a is clone.b and clone.head.weight is clone.emb.weight  # shared stays shared, tied stays tied
        assert clone.a is not model.a and clone.head.weight is not model.head.weight
        gone = weakref.ref(clone.a[0])
        weight = weakref.ref(clone.head.weight)
        del clone
        assert gone() is None and weight() is None, "the clone outlived its last reference (a reference cycle)"
    finally:
        if was_enabled:
            gc.enable()


def test_a_module_that_wraps_its_own_methods_is_shared_not_cloned():
    """A module that keeps in its ``__dict__`` a wrapper of its own bound method (torchmetrics' Metric wraps update and
    compute so) cannot be cloned faithfully: the clone would call the original's wrapper. Without tensors of its own
    it is shared; a module that holds a parameter is cloned as before (the step binds its tensors into the clone)."""
    import functools

    from torch import nn

    from fzero.layout import clone_structure

    class Counting(nn.Module):
        def __init__(self, width: int = 0):
            super().__init__()
            self.count = 0
            self.update = functools.wraps(self.update)(self._counted(self.update))
            if width:
                self.lin = nn.Linear(width, width)

        def _counted(self, fn):
            def wrapped(*args):
                return fn(*args)
            return wrapped

        def update(self):
            self.count += 1

    root = nn.Sequential(nn.Linear(2, 2), Counting(), Counting(width=2))
    clone = clone_structure(root)
    assert clone[1] is root[1] and clone[2] is not root[2] and clone[0] is not root[0]
    clone[1].update()
    assert root[1].count == 1
