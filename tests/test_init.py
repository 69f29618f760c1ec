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
