"""Weights in: a Hugging Face model built under ``fzero.empty_params()`` trains from ``step.init`` streaming the
checkpoint ``save_pretrained`` wrote (``fzero.checkpoint.pretrained``), exactly as the same training started from
``from_pretrained``; what cannot load is named before anything is read; a meta buffer is named before the forward.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from zoo import gpt2, llama

import fzero
from fzero.memory import LiveBytes
from fzero.testing import assert_trees_equal

MODELS = {"llama": llama, "gpt2": gpt2}
STEPS = 3


def _random(build):
    torch.manual_seed(7)  # the pretrained weights: any values, but not the ones a fresh model would draw
    return build()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (whole-file dir, sharded dir): save_pretrained of a same-config model with random weights."""
    out = {}
    for name, build in MODELS.items():
        model = _random(build)
        whole, sharded = tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(name + "_sharded")
        model.save_pretrained(whole)
        model.save_pretrained(sharded, max_shard_size="20KB")
        assert not os.path.exists(whole / "model.safetensors.index.json")
        assert len(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())) >= 3
        out[name] = (str(whole), str(sharded))
    return out


def _empty(name):
    with fzero.empty_params():
        return MODELS[name]()


def _loss(model):
    return lambda p, b: fzero.apply(model, p, input_ids=b["x"], labels=b["x"]).loss


def _train(model, stages, n, **init):
    step = fzero.compile(_loss(model), optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(n))
    state = step.init(fzero.params_of(model, copy=False), **init)
    first = step.gather(state)
    torch.manual_seed(0)  # dropout (GPT-2's defaults) draws the same masks in both runs
    for k in range(STEPS):
        state, _ = step(state, {"x": torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(k))})
    return first, step.gather(state)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_streamed_init_trains_as_from_pretrained(saved, name, stages, n):
    whole, _ = saved[name]
    ref = type(_empty(name)).from_pretrained(whole).train()  # from_pretrained gives eval mode; fine-tuning trains
    expected_init, expected = _train(ref, stages, n)
    meta = _empty(name)
    got_init, got = _train(meta, stages, n, materialize=fzero.checkpoint.pretrained(whole, model=meta))
    assert_trees_equal(got_init, expected_init)  # the values from_pretrained loads, tied head included
    assert_trees_equal(got, expected)
    assert any(not torch.equal(got[k], got_init[k]) for k in got)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_sharded_checkpoint_streams_as_the_whole_file(saved, name):
    whole, sharded = saved[name]
    meta = _empty(name)
    expected = _train(meta, 3, 2, materialize=fzero.checkpoint.pretrained(whole, model=meta))
    got = _train(meta, 3, 2, materialize=fzero.checkpoint.pretrained(sharded, model=meta))
    assert_trees_equal(got, expected)


@pytest.mark.torchrun
@pytest.mark.parametrize("stages", [1, 3])
def test_streamed_init_under_torchrun_trains_as_two_simulated_ranks(saved, stages, tmp_path, one_thread):
    """Two processes under dist_mesh, each with the model on meta and a reader: each rank reads the part of every
    unit it keeps from the files itself (its shard at stage 3, the whole params at stage 1) and nothing of the
    model crosses between ranks; the params after init and after training equal those of the same run on
    local_mesh(2), bitwise (fp32, one thread per rank)."""
    from launch import torchrun

    whole, _ = saved["llama"]
    out = tmp_path / "run.pt"
    torchrun([os.path.join(os.path.dirname(__file__), "pretrained_worker.py"), "--dir", whole, "--stages", str(stages),
              "--out", str(out)])
    got = torch.load(out, weights_only=False)
    meta = _empty("llama")
    expected_init, expected = _train(meta, stages, 2, materialize=fzero.checkpoint.pretrained(whole, model=meta))
    assert_trees_equal(got["first"], expected_init)
    assert_trees_equal(got["last"], expected)
    params = sum(t.numel() for t in meta.parameters())
    for rank in got["ranks"]:
        assert rank["moved"] < 100, rank  # the init's collectives: a count and the agreement, no values
        if stages == 3:  # its shard alone (the padding of each unit's shards is not read)
            assert rank["read"] <= rank["kept"] < params * 0.51, rank
        else:  # the whole params, kept by every rank
            assert rank["read"] == params, rank


def test_init_holds_the_state_and_about_one_unit_never_the_model_twice(tmp_path):
    """Peak live bytes during a stage-3 init from a checkpoint: the state (both ranks' shards: the model once)
    plus one unit's values and its packed buffer, well under the model twice."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                      num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with fzero.empty_params():
        meta = LlamaForCausalLM(cfg)
    model_bytes = sum(p.numel() * 4 for p in meta.parameters())
    step = fzero.compile(lambda p, b: None, stages=3, mesh=fzero.local_mesh(2), optimizer=fzero.optim.sgd(0.1))
    source = fzero.checkpoint.pretrained(tmp_path, model=meta)
    with LiveBytes() as lb:
        state = step.init(fzero.params_of(meta, copy=False), materialize=source)
    unit_bytes = max(u.padded for u in state.states[0].meta.layout.units) * 4
    assert 2 * unit_bytes < model_bytes / 3  # the bound below is far from "the whole model again"
    shards = sum(t.numel() * 4 for s in state.states for t in s.params.values())
    assert model_bytes <= shards <= model_bytes * 1.001  # both ranks' shards: the model once (and padding)
    assert lb.peak <= shards + 2 * unit_bytes, (lb.peak, shards, unit_bytes)


# -- what from_pretrained handles -------------------------------------------------------------------------------


def _read(directory, key):
    """One tensor of a one-file checkpoint, as safetensors stores it."""
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))[key]


def _rewrite(src_dir, dst, change):
    """dst/model.safetensors: the tensors of src_dir's file, changed by ``change(dict)``."""
    with safe_open(os.path.join(src_dir, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_a_tied_head_loads_from_either_name_and_ignored_keys_pass(saved, tmp_path):
    whole, _ = saved["gpt2"]
    meta = _empty("gpt2")
    expected = fzero.checkpoint.pretrained(whole, model=meta)
    assert expected.keys["transformer.wte.weight"] == "transformer.wte.weight" and "lm_head.weight" not in expected.keys

    def head_name_and_old_masks(t):
        t["lm_head.weight"] = t.pop("transformer.wte.weight")
        t["transformer.h.0.attn.bias"] = torch.ones(1, 1, 32, 32)  # GPT2LMHeadModel._keys_to_ignore_on_load_unexpected
    other = fzero.checkpoint.pretrained(_rewrite(whole, tmp_path, head_name_and_old_masks), model=meta)
    meta_wte = meta.transformer.wte.weight
    assert torch.equal(other("transformer.wte.weight", meta_wte), expected("transformer.wte.weight", meta_wte))


def test_a_base_models_checkpoint_loads_into_the_model_with_a_head(tmp_path):
    from transformers import GPT2LMHeadModel

    base = _random(gpt2).transformer  # GPT2Model: keys without the "transformer." prefix
    base.save_pretrained(tmp_path)
    meta = _empty("gpt2")
    source = fzero.checkpoint.pretrained(tmp_path, model=meta)
    assert source.keys["transformer.h.0.attn.c_attn.weight"] == "h.0.attn.c_attn.weight"
    ref = GPT2LMHeadModel.from_pretrained(tmp_path)
    for path, t in fzero.params_of(meta, copy=False).items():
        assert torch.equal(source(path, t), ref.state_dict()[path]), path


def test_stored_dtype_is_cast_to_the_params(saved, tmp_path):
    whole, _ = saved["llama"]
    half = _rewrite(whole, tmp_path, lambda t: t.update({k: v.bfloat16() for k, v in t.items()}))
    meta = _empty("llama")
    source = fzero.checkpoint.pretrained(half, model=meta)
    assert source.casts["model.norm.weight"] == (torch.bfloat16, torch.float32)
    got = source("model.embed_tokens.weight", meta.model.embed_tokens.weight)
    with safe_open(os.path.join(whole, "model.safetensors"), "pt") as f:
        expected = f.get_tensor("model.embed_tokens.weight").bfloat16().float()
    assert got.dtype == torch.float32 and torch.equal(got, expected)


# -- what cannot load is named ----------------------------------------------------------------------------------


def test_missing_and_unexpected_keys_are_named(saved, tmp_path):
    whole, _ = saved["llama"]
    meta = _empty("llama")
    lacks = _rewrite(whole, tmp_path / "lacks", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"pretrained: .* the model has 1 key\(s\) the checkpoint lacks: \['model.layers.1.mlp.up_proj.weight'\]"):
        fzero.checkpoint.pretrained(lacks, model=meta)
    extra = _rewrite(whole, tmp_path / "extra", lambda t: t.update({"model.adapter.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"the checkpoint has 1 key\(s\) the model lacks: \['model.adapter.weight'\].*"
                                         r"AutoConfig.from_pretrained.*pass unexpected='ignore'"):
        fzero.checkpoint.pretrained(extra, model=meta)
    # as from_pretrained (which warns): the key is left out, listed, and every other value is the checkpoint's
    source = fzero.checkpoint.pretrained(extra, model=meta, unexpected="ignore")
    assert source.ignored == ("model.adapter.weight",)
    assert torch.equal(source("model.norm.weight", meta.model.norm.weight), _read(whole, "model.norm.weight"))
    with pytest.raises(ValueError, match=r"unexpected='warn'; pass 'error'"):
        fzero.checkpoint.pretrained(extra, model=meta, unexpected="warn")


def test_a_shape_mismatch_names_the_key_and_both_shapes(saved, tmp_path):
    whole, _ = saved["llama"]
    wrong = _rewrite(whole, tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(48)}))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(48,\) in the checkpoint .* but \(32,\) in LlamaForCausalLM"):
        fzero.checkpoint.pretrained(wrong, model=_empty("llama"))


def test_a_buffer_left_on_meta_is_named_before_the_forward(saved):
    whole, _ = saved["llama"]
    with torch.device("meta"):
        meta = llama()
    with pytest.raises(ValueError, match=r"pretrained: .*non-persistent buffers \['model.rotary_emb.inv_freq'.* are meta tensors.*fzero.empty_params"):
        fzero.checkpoint.pretrained(whole, model=meta)
    # made another way, the forward is refused before it runs, naming the buffer and the fix
    step = fzero.compile(_loss(meta), stages=3, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(meta, copy=False), materialize=lambda path, t: torch.zeros(t.shape))
    with pytest.raises(ValueError, match=r"fzero.apply: the non-persistent buffer 'model.rotary_emb.inv_freq' of LlamaForCausalLM is a meta tensor.*fzero.empty_params"):
        step(state, {"x": torch.zeros(2, 8, dtype=torch.long)})


def test_a_param_left_on_meta_is_named_before_the_forward():
    meta = _empty("gpt2")
    meta.transformer.wpe.weight.requires_grad_(False)  # frozen: params_of leaves it out, so nothing makes it
    step = fzero.compile(_loss(meta), stages=0)
    state = step.init(fzero.params_of(meta, copy=False), materialize=lambda path, t: torch.zeros(t.shape))
    with pytest.raises(ValueError, match=r"fzero.apply: the parameter 'transformer.wpe.weight' of GPT2LMHeadModel is a meta tensor and it is frozen"):
        step(state, {"x": torch.zeros(2, 8, dtype=torch.long)})


def test_a_model_with_real_params_or_a_wrong_directory_is_refused(saved, tmp_path, monkeypatch):
    whole, _ = saved["gpt2"]
    with pytest.raises(ValueError, match=r"params \['transformer.wte.weight'.* are real tensors.*fzero.empty_params"):
        fzero.checkpoint.pretrained(whole, model=gpt2())
    with pytest.raises(FileNotFoundError, match=r"holds neither model.safetensors nor model.safetensors.index.json"):
        fzero.checkpoint.pretrained(tmp_path, model=_empty("gpt2"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ImportError, match=r"pip install safetensors"):
        fzero.checkpoint.pretrained(whole, model=_empty("gpt2"))



def test_a_half_written_index_or_truncated_shard_is_named_with_the_file(saved, tmp_path):
    """A copy that did not finish: an index cut short, one that is not an index, a shard cut short, and a directory of
    another format. Each was a raw JSONDecodeError / AttributeError / safetensors "incomplete metadata, file not fully
    covered" naming no file; now the file and the fix are named."""
    import shutil

    _, sharded = saved["gpt2"]
    index = "model.safetensors.index.json"
    cases = {"cut": lambda d: (d / index).write_text((d / index).read_text()[:40]),
             "list": lambda d: (d / index).write_text("[1, 2]"),
             "null": lambda d: (d / index).write_text('{"weight_map": {"transformer.wte.weight": null}}')}
    messages = {"cut": r"index.json' is not readable JSON \(JSONDecodeError.*truncated or corrupted",
                "list": r"index.json' has no weight_map of checkpoint key -> file name",
                "null": r"index.json' has no weight_map of checkpoint key -> file name"}
    for name, change in cases.items():
        d = tmp_path / name
        shutil.copytree(sharded, d)
        change(d)
        with pytest.raises(ValueError, match=messages[name]):
            fzero.checkpoint.pretrained(d, model=_empty("gpt2"))
    d = tmp_path / "shard"
    shutil.copytree(sharded, d)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=rf"cannot read '{shard}' as safetensors \(SafetensorError: .*\); the file is truncated"):
        fzero.checkpoint.pretrained(d, model=_empty("gpt2"))
    (tmp_path / "ds" / "global_step1").mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    with pytest.raises(FileNotFoundError, match=r"It is a DeepSpeed checkpoint.*fzero.checkpoint.from_deepspeed"):
        fzero.checkpoint.pretrained(tmp_path / "ds", model=_empty("gpt2"))
    run = tmp_path / "run"  # fzero's checkpoints beside a `latest` file of the user's script: fzero's, not DeepSpeed's
    (run / "step_00000001").mkdir(parents=True)
    (run / "latest").write_text("step_00000001")
    with pytest.raises(FileNotFoundError, match=r"It is an fzero checkpoint: resume it with fzero.checkpoint.load"):
        fzero.checkpoint.pretrained(run, model=_empty("gpt2"))
    with pytest.raises(TypeError, match=r"pretrained: path must be the directory save_pretrained wrote.*got NoneType"):
        fzero.checkpoint.pretrained(None, model=_empty("gpt2"))


def test_a_device_that_cannot_hold_the_values_and_the_unmade_reader_are_named(saved):
    """device="gpu" was torch's list of device types from the end of pretrained, "cuda" without a GPU a bare assert
    from inside step.init; materialize=fzero.checkpoint.pretrained (the maker, not called) was "pretrained() takes 1
    positional argument but 2 were given"."""
    whole, _ = saved["gpt2"]
    with pytest.raises(ValueError, match=r"pretrained: device='gpu' is not a torch device .*pass 'cpu' or 'cuda'"):
        fzero.checkpoint.pretrained(whole, model=_empty("gpt2"), device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"pretrained: device='cuda', but torch sees no CUDA device here"):
            fzero.checkpoint.pretrained(whole, model=_empty("gpt2"), device="cuda")
    model = _empty("gpt2")
    step = fzero.compile(_loss(model), optimizer=fzero.optim.adamw(1e-3))
    with pytest.raises(TypeError, match=r"Step.init: materialize=fzero.checkpoint.pretrained is the function that makes a "
                                        r"reader.*materialize=fzero.checkpoint.pretrained\(dir, model=model\)"):
        step.init(fzero.params_of(model, copy=False), materialize=fzero.checkpoint.pretrained)

def test_empty_params_keeps_ties_and_buffers_and_ends_with_the_block():
    meta = _empty("gpt2")
    assert meta.lm_head.weight is meta.transformer.wte.weight and meta.lm_head.weight.is_meta
    lm = _empty("llama")
    assert all(p.is_meta for p in lm.parameters()) and all(not b.is_meta for b in lm.buffers())
    assert torch.equal(lm.model.rotary_emb.inv_freq, llama().model.rotary_emb.inv_freq)
    assert not torch.nn.Linear(2, 2).weight.is_meta


def test_persistent_buffers_come_from_the_checkpoint_into_the_state(tmp_path):
    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))

    torch.manual_seed(0)
    trained = build()
    trained(torch.randn(16, 4))  # running statistics that differ from a fresh module's
    save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with fzero.empty_params():
        meta = build()
    step = fzero.compile(lambda p, b: fzero.apply(meta, p, b["x"]).sum(), stages=0)
    state = step.init(fzero.params_of(meta, copy=False), materialize=fzero.checkpoint.pretrained(tmp_path, model=meta))
    assert_trees_equal(state.buffers, fzero.buffers_of(trained))
    assert_trees_equal(step.gather(state), fzero.params_of(trained))


def test_a_frozen_param_is_named_not_taken_for_an_unexpected_key(saved):
    whole, _ = saved["gpt2"]
    meta = _empty("gpt2")
    meta.transformer.wpe.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"frozen params \['transformer.wpe.weight'\] are meta tensors; step.init makes only "
                                         r"the params it trains.*load_state_dict\(\{name: tensor, ...\}, strict=False, assign=True\)"):
        fzero.checkpoint.pretrained(whole, model=meta)
    # the fix it names: the frozen param given its value in the module (a real frozen param is read from there)
    wpe = torch.nn.Parameter(_read(whole, "transformer.wpe.weight"), requires_grad=False)
    meta.load_state_dict({"transformer.wpe.weight": wpe}, strict=False, assign=True)
    source = fzero.checkpoint.pretrained(whole, model=meta)
    assert "transformer.wpe.weight" not in fzero.params_of(meta, copy=False) and source.keys


def test_missing_init_runs_the_initializers_of_the_modules_above_the_param(tmp_path):
    """from_pretrained initializes a missing weight with _init_weights over the whole model, children first, so a
    parent's branch has the last word: GPT-2's attention scales its c_proj.weight to initializer_range / sqrt(2 *
    n_layer). missing='init' ran the owner's branch alone (std 0.02 here, where from_pretrained's is 0.01)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(3)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "full")
    lacks = _rewrite(str(tmp_path / "full"), tmp_path / "lacks", lambda t: t.pop("transformer.h.0.attn.c_proj.weight"))
    with fzero.empty_params():
        meta = GPT2LMHeadModel(cfg)
    source = fzero.checkpoint.pretrained(lacks, model=meta, missing="init")
    made = source("transformer.h.0.attn.c_proj.weight", meta.transformer.h[0].attn.c_proj.weight)
    assert 0.008 < float(made.std()) < 0.012  # 0.02 / sqrt(2 * 2), as from_pretrained draws it


def test_missing_init_refuses_a_param_it_cannot_initialize():
    """A weight-norm conv's parametrized weight (Wav2Vec2's positional conv): its init reads the other half of the
    parametrization. It came back as uninitialised memory (1e5, or inf/NaN); it is named now, with the fix."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                         num_conv_pos_embedding_groups=2)
    with fzero.empty_params():
        meta = Wav2Vec2ForCTC(cfg)
    init = fzero.checkpoint._pretrained._initializer(meta, "init")
    path = "wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original1"
    with pytest.raises(ValueError, match=r"missing='init' could not run Wav2Vec2ForCTC._init_weights .* for "
                                         r"'wav2vec2.encoder.pos_conv_embed.conv.parametrizations.weight.original1'.*missing=fn"):
        init(path, meta.get_parameter(path))


def test_a_new_head_on_a_pretrained_body_is_initialized_as_from_pretrained_does(tmp_path):
    # AutoModelForSequenceClassification.from_pretrained(base): the body loads, the new head ("score") is drawn by
    # the model's own _init_weights, N(0, initializer_range); without missing= that head is an error naming it
    from transformers import LlamaConfig, LlamaForSequenceClassification, LlamaModel

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=32, num_labels=48, pad_token_id=0)
    torch.manual_seed(7)
    LlamaModel(cfg).save_pretrained(tmp_path)
    with fzero.empty_params():
        meta = LlamaForSequenceClassification(cfg)
    with pytest.raises(ValueError, match=r"lacks: \['score.weight'\].*pass missing='init' to initialize them"):
        fzero.checkpoint.pretrained(tmp_path, model=meta)
    source = fzero.checkpoint.pretrained(tmp_path, model=meta, missing="init")
    assert source.initialized == ("score.weight",)
    step = fzero.compile(lambda p, b: fzero.apply(meta, p, input_ids=b["x"], labels=b["y"]).loss,
                         optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(meta, copy=False), materialize=source)
    got = step.gather(state)
    ref = LlamaForSequenceClassification.from_pretrained(tmp_path, num_labels=48, pad_token_id=0)
    for name, value in ref.state_dict().items():
        if name in got and name != "score.weight":
            assert torch.equal(got[name], value), name  # the body: the checkpoint's values
    head = got["score.weight"]
    assert head.shape == (48, 64) and abs(float(head.mean())) < 0.01
    assert 0.015 < float(head.std()) < 0.025  # initializer_range 0.02, as from_pretrained draws it
    batch = {"x": torch.randint(1, 128, (4, 16), generator=torch.Generator().manual_seed(0)), "y": torch.arange(4)}
    state, metrics = step(state, batch)
    assert math.isfinite(metrics["loss"])
    with pytest.raises(ValueError, match=r"missing='zeros'; pass 'init'"):
        fzero.checkpoint.pretrained(tmp_path, model=meta, missing="zeros")
    made = fzero.checkpoint.pretrained(tmp_path, model=meta, missing=lambda path, m: torch.zeros(m.shape))
    assert torch.equal(made("score.weight", meta.score.weight), torch.zeros(48, 64))


# -- checkpoints that transformers converts while loading (mixture-of-experts layouts) -----------------------------


def _mixtral(intermediate=48):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=32))


def _qwen2_moe():
    from zoo import qwen2_moe

    return qwen2_moe()


CONVERTED = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe}


@pytest.mark.parametrize("name", sorted(CONVERTED))
def test_a_checkpoint_transformers_converts_on_load_streams_as_from_pretrained(name, tmp_path):
    """save_pretrained writes these models' experts one module per expert, which the models hold fused: the reader
    converts them with the model's own transformers conversion (one layer's experts at a time, as its unit is packed),
    and the training equals the one started from from_pretrained, bitwise, at stage 3 on two ranks."""
    build = CONVERTED[name]
    torch.manual_seed(7)
    build().save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    with fzero.empty_params():
        meta = build()
    assert set(fzero.params_of(meta, copy=False)) - stored  # the model names params the file does not hold as such
    ref = type(meta).from_pretrained(tmp_path).train()
    expected_init, expected = _train(ref, 3, 2)
    got_init, got = _train(meta, 3, 2, materialize=fzero.checkpoint.pretrained(tmp_path, model=meta))
    assert_trees_equal(got_init, expected_init)
    assert_trees_equal(got, expected)


def test_a_converted_checkpoint_of_another_configuration_is_named_before_anything_is_read(tmp_path):
    """The converted params' shapes are checked from the headers (the conversion run on meta tensors): a checkpoint whose
    experts are 48 wide into a model whose experts are 40 wide names the fused param and both shapes."""
    torch.manual_seed(7)
    _mixtral(intermediate=48).save_pretrained(tmp_path)
    with fzero.empty_params():
        meta = _mixtral(intermediate=40)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts.gate_up_proj' \(made from 8 stored tensors such as "
                                         r"'model.layers.0.block_sparse_moe.experts.0.w1.weight', converted as transformers "
                                         r"converts them\) has shape \(4, 96, 32\) in the checkpoint .* but \(4, 80, 32\)"):
        fzero.checkpoint.pretrained(tmp_path, model=meta)


def test_a_converted_group_missing_a_stored_tensor_is_named(tmp_path):
    """One expert's tensor missing from a mixture-of-experts checkpoint: the fused param's conversion (on values, at
    step.init) raised torch's bare "Sizes of tensors must match"; it names the group and the stored tensors now."""
    torch.manual_seed(7)
    _mixtral().save_pretrained(tmp_path / "full")
    lacks = _rewrite(str(tmp_path / "full"), tmp_path / "lacks", lambda t: t.pop("model.layers.0.block_sparse_moe.experts.1.w1.weight"))
    with fzero.empty_params():
        meta = _mixtral()
    source = fzero.checkpoint.pretrained(lacks, model=meta)
    step = fzero.compile(lambda p, b: fzero.apply(meta, p, input_ids=b).logits.sum(), optimizer=fzero.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"converting the checkpoint's 7 tensors .* into 'model.layers.0.mlp.experts.gate_up_proj'.*"
                                         r"failed.*one expert of a layer"):
        step.init(fzero.params_of(meta, copy=False), materialize=source)
