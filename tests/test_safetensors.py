"""Weights out in Hugging Face's format (issue 17, item 2): ``fzero.checkpoint.save_weights`` from a live state and
``consolidate(..., format="safetensors")`` from a checkpoint. The files load with ``safetensors.torch.load_file``
and into fresh tiny HF models (GPT-2 with its tied head, Llama) with ``from_pretrained`` reporting no missing,
unexpected or mismatched key, and give the logits of the same model loaded with ``step.state_dict(state, model)``;
sharded output gets HF's file names and index; dtype conversion; buffers; streaming memory; errors.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import fzero
import zoo
from checkpoint_worker import make_step
from fzero.checkpoint import CheckpointWriteError
from fzero.testing import assert_trees_equal
from problems import mlp_problem

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HERE = os.path.dirname(__file__)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
MODELS = {"gpt2": zoo.gpt2, "llama": zoo.llama}


def hf_loss(model):
    def loss_fn(params, ids):
        return fzero.apply(model, params, input_ids=ids, labels=ids).loss

    return loss_fn


def trained(name: str, *, stages: int, precision: str = "fp32", steps: int = 2, mesh: object = "local2"):
    torch.manual_seed(0)
    model = MODELS[name]()
    mesh = fzero.local_mesh(2) if mesh == "local2" else mesh
    step = fzero.compile(hf_loss(model), optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=mesh, precision=precision)
    state = step.init(fzero.params_of(model))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        state, _ = step(state, torch.randint(0, 128, (4, 8), generator=gen))
    return model, step, state


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids).logits


def reference(name: str, model, step, state):
    """A fresh model loaded strictly with ``step.state_dict(state, model)``."""
    fresh = MODELS[name]()
    fresh.load_state_dict(step.state_dict(state, model), strict=True)
    return fresh


def from_pretrained(name: str, directory: str, model):
    """``from_pretrained`` of ``directory`` (with ``model``'s config saved there), asserting that every key matched."""
    model.config.save_pretrained(directory)
    cls = type(model)
    loaded, info = cls.from_pretrained(directory, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"], info["error_msgs"]) == (set(), set(), set(), []), info
    return loaded


def read_all(directory: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    out = {}
    for f in files:
        part = safetensors_torch.load_file(os.path.join(directory, f))
        assert not set(part) & set(out)
        out.update(part)
    return out


IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_save_weights_at_stage_3_loads_into_a_fresh_hf_model(tmp_path, name):
    model, step, state = trained(name, stages=3)
    out = fzero.checkpoint.save_weights(step, state, tmp_path / "hf", model=model)
    assert out == str(tmp_path / "hf") and sorted(os.listdir(out)) == ["model.safetensors"]
    expected = step.state_dict(state, model)
    saved = safetensors_torch.load_file(os.path.join(out, "model.safetensors"))
    tied = {"lm_head.weight"} if name == "gpt2" else set()  # written once, as save_pretrained does; from_pretrained ties it
    assert set(saved) == set(expected) - tied
    for k, v in saved.items():
        assert v.dtype == torch.float32 and torch.equal(v, expected[k]), k
    loaded = from_pretrained(name, out, model)
    if name == "gpt2":
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert torch.equal(logits(loaded, IDS), logits(reference(name, model, step, state), IDS))


@pytest.mark.parametrize("mesh, stages, precision", [(None, 3, "fp32"), ("local1", 3, "fp32"), ("local1", 1, "bf16")])
def test_save_weights_on_one_rank_of_a_sharded_state(tmp_path, mesh, stages, precision):
    """One rank holds every shard (stage 3, or the fp32 masters of stages 1-2): its shard is the whole unit. This
    raised a bare AttributeError ('NoneType' object has no attribute 'all_gather') looking for a collective."""
    model, step, state = trained("llama", stages=stages, precision=precision, mesh=fzero.local_mesh(1) if mesh else None)
    out = fzero.checkpoint.save_weights(step, state, tmp_path / "hf", model=model)
    expected = step.state_dict(state, model)
    saved = read_all(out)
    assert set(saved) == set(expected)
    for k, v in saved.items():
        assert torch.equal(v, expected[k]), k


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_consolidate_a_checkpoint_to_safetensors(tmp_path, name):
    """From a bf16 run's checkpoint (fp32 masters, saved at stage 2): the masters, as step.state_dict gives them."""
    model, step, state = trained(name, stages=2, precision="bf16")
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    out = fzero.checkpoint.consolidate(ck, tmp_path / "hf", model=model, format="safetensors")
    expected = step.state_dict(state, model)
    saved = read_all(out)
    assert set(saved) == set(expected) - ({"lm_head.weight"} if name == "gpt2" else set())
    for k, v in saved.items():
        assert torch.equal(v, expected[k].float()), k
    loaded = from_pretrained(name, out, model)
    assert torch.equal(logits(loaded, IDS), logits(reference(name, model, step, state), IDS))
    bare = fzero.checkpoint.consolidate(ck, tmp_path / "bare", format="safetensors")  # no model: the saved names
    assert set(read_all(bare)) == set(fzero.params_of(model))


def test_a_tied_models_checkpoint_consolidates_without_the_model_into_a_strict_state_dict(tmp_path):
    """The command line's consolidate has no model: a checkpoint saved with model= records the tied aliases
    (GPT-2's lm_head.weight is transformer.wte.weight), so its .pt loads strictly, as zero_to_fp32's output does."""
    model, step, state = trained("gpt2", stages=3)
    ck = fzero.checkpoint.save(tmp_path / "ck", state, model=model)
    subprocess.run([sys.executable, "-m", "fzero.checkpoint", "consolidate", str(ck), str(tmp_path / "model.pt")],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    fresh = MODELS["gpt2"]()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still one tensor after the load
    expected = step.state_dict(state, model)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_sharded_output_is_named_and_indexed_as_hugging_face_does(tmp_path):
    model, step, state = trained("llama", stages=3)
    out = str(tmp_path / "hf")
    os.makedirs(out)
    (tmp_path / "hf" / "README.md").write_text("mine")
    limit = 12_000
    fzero.checkpoint.save_weights(step, state, out, model=model, max_shard_size=limit)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    expected = step.state_dict(state, model)
    assert set(index["weight_map"]) == set(expected) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    for f in files:
        part = safetensors_torch.load_file(os.path.join(out, f))
        assert {k for k, v in index["weight_map"].items() if v == f} == set(part)
        data = sum(t.numel() * t.element_size() for t in part.values())
        assert data <= limit or len(part) == 1  # a tensor larger than the limit gets a file of its own
        for k, v in part.items():
            assert torch.equal(v, expected[k]), k
    loaded = from_pretrained("llama", out, model)
    assert torch.equal(logits(loaded, IDS), logits(reference("llama", model, step, state), IDS))
    fzero.checkpoint.save_weights(step, state, out, model=model)  # again, unsharded: the shards and index go
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]


class Net(torch.nn.Module):
    """Buffers of both kinds: BatchNorm's float running stats and its int64 step count."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(self.norm(x))


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_dtype_conversion_and_buffers(tmp_path, dtype, torch_dtype):
    torch.manual_seed(0)
    model = Net()
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).square().mean(), optimizer=fzero.optim.adamw(1e-2), stages=3,
                         mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    state, _ = step(state, torch.randn(8, 8))
    expected = step.state_dict(state, model)
    assert expected["norm.num_batches_tracked"].item() == 1
    live = read_all(fzero.checkpoint.save_weights(step, state, tmp_path / "live", model=model, dtype=dtype))
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    offline = read_all(fzero.checkpoint.consolidate(ck, tmp_path / "ck_out", model=model, format="safetensors", dtype=dtype))
    for saved in (live, offline):
        assert set(saved) == set(expected)
        for k, v in saved.items():
            want = expected[k].to(torch_dtype) if expected[k].is_floating_point() else expected[k]
            assert v.dtype == want.dtype and torch.equal(v, want), k
        assert saved["norm.num_batches_tracked"].dtype == torch.int64
    fresh = Net()
    fresh.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in live.items()}, strict=True)
    pt = torch.load(fzero.checkpoint.consolidate(ck, tmp_path / "m.pt", model=model, dtype=dtype), weights_only=True)
    assert_trees_equal(pt, offline)  # the torch file gets the same dtype


def test_save_weights_streams_one_unit_at_a_time(tmp_path):
    """The peak of tensor bytes made while exporting a stage-3 state is about one gathered unit, not the model."""
    from fzero.memory import LiveBytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), optimizer=fzero.optim.adamw(1e-3), stages=3,
                         mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    unit = max(u.padded for u in state[0].meta.layout.units) * 4
    whole = sum(p.numel() for p in model.parameters()) * 4
    with LiveBytes() as export:
        fzero.checkpoint.save_weights(step, state, tmp_path / "hf")
    with LiveBytes() as gathered:
        step.state_dict(state)
    # measured: export peak 16,896 bytes = one unit; step.state_dict 402,432 = twice the 199,680 of the model
    assert export.peak <= unit + 4096 < whole / 4, (export.peak, unit, whole)
    assert gathered.peak >= whole  # what the streaming avoids


@pytest.mark.parametrize("stages", [0, 3])
def test_an_fp16_export_of_values_past_its_range_is_refused_not_written_as_inf(tmp_path, stages):
    """A weight of 1e5 (fp16's largest finite is 65504) exported with dtype="fp16": before, written as inf without a
    word by save_weights and by consolidate in both formats, and the exported model computed inf/NaN. Now each raises,
    naming the tensor and the largest magnitude, and leaves no file; bf16 holds the value."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight[1, 2] = 1e5
    step = fzero.compile(lambda p, x: fzero.apply(model, p, x).pow(2).mean(), optimizer=fzero.optim.sgd(0.0),
                         stages=stages, mesh=fzero.local_mesh(2) if stages else None)
    state = step.init(fzero.params_of(model))
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    match = (r"0\.weight holds 1 value\(s\) too large for float16 \(largest magnitude 100000; the dtype's largest finite "
             r"is 65504\): written in it, they would be inf\. Export with dtype=\"bf16\"")
    for api, export in (("save_weights", lambda out: fzero.checkpoint.save_weights(step, state, out, model=model, dtype="fp16")),
                        ("consolidate", lambda out: fzero.checkpoint.consolidate(ck, out, model=model, format="safetensors", dtype="fp16")),
                        ("consolidate", lambda out: fzero.checkpoint.consolidate(ck, out / "m.pt", model=model, dtype="fp16"))):
        out = tmp_path / f"out_{len(os.listdir(tmp_path))}"
        out.mkdir()
        with pytest.raises(fzero.checkpoint.CheckpointError, match=rf"fzero\.checkpoint\.{api}: " + match):
            export(out)
        assert os.listdir(out) == []
    fzero.checkpoint.save_weights(step, state, tmp_path / "bf16", model=model, dtype="bf16")
    assert safetensors_torch.load_file(tmp_path / "bf16" / "model.safetensors")["0.weight"][1, 2] == 1e5


def test_weights_errors(tmp_path):
    model, step, state = trained("llama", stages=3, steps=1)
    with pytest.raises(ValueError, match=r"save_weights: dtype must be one of \['bf16', 'fp16', 'fp32'\] .*got 'int8'"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "a", dtype="int8")
    with pytest.raises(ValueError, match=r"save_weights: format must be one of \['safetensors'\], got 'pt'"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "a", format="pt")
    with pytest.raises(ValueError, match=r"max_shard_size must be a positive number of bytes or a string such as '5GB'.*got '5 parsecs'"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "a", max_shard_size="5 parsecs")
    with pytest.raises(TypeError, match="the first argument must be the Step the state belongs to"):
        fzero.checkpoint.save_weights(state, step, tmp_path / "a")
    with pytest.raises(CheckpointWriteError, match=r"cannot write into .*nowhere/hf: its parent directory .*nowhere does not exist"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "nowhere" / "hf")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointWriteError, match="file: it is a file, not a directory"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "file")
    other = MODELS["gpt2"]()
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"GPT2LMHeadModel.state_dict\(\) has no 'model.*', which the state holds"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "a", model=other)
    assert not os.path.exists(tmp_path / "a") or os.listdir(tmp_path / "a") == []
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    with pytest.raises(ValueError, match=r"consolidate: format must be one of \['pt', 'safetensors'\], got 'gguf'"):
        fzero.checkpoint.consolidate(ck, tmp_path / "x", format="gguf")
    cli = subprocess.run([sys.executable, "-m", "fzero.checkpoint", "consolidate", ck, str(tmp_path / "cli"), "--format", "safetensors",
                          "--dtype", "bf16", "--max-shard-size", "20kB"], env=ENV, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    saved = read_all(str(tmp_path / "cli"))
    assert os.path.exists(tmp_path / "cli" / "model.safetensors.index.json") and {v.dtype for v in saved.values()} == {torch.bfloat16}


def test_exports_refuse_a_model_of_another_configuration(tmp_path):
    """A model whose names cover the state's but that was not its model: a deeper one (its extra layer was exported as
    its random init, silently, by step.state_dict, save_weights and consolidate, and load_state_dict(strict=True)
    took it), or one that ties two params the state trained apart (the state dict carried both values for one tensor:
    the one loaded last won). A frozen extra param comes from the module, as fzero.apply reads it, unless the
    checkpoint was saved with model= and so holds every param of its model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model, step, state = trained("llama", stages=3, steps=1)
    ck = fzero.checkpoint.save(tmp_path / "ck", state)
    ck_model = fzero.checkpoint.save(tmp_path / "ck_model", state, model=model)
    config = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=32)
    deeper = LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **config))
    tied = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, tie_word_embeddings=True, **config))
    exports = [
        ("Step.state_dict", lambda m: step.state_dict(state, m)),
        ("save_weights", lambda m: fzero.checkpoint.save_weights(step, state, tmp_path / "hf", model=m)),
        ("consolidate", lambda m: fzero.checkpoint.consolidate(ck, tmp_path / "m.pt", model=m)),
        ("consolidate", lambda m: fzero.checkpoint.consolidate(ck, tmp_path / "st", model=m, format="safetensors")),
    ]
    for api, export in exports:
        with pytest.raises((ValueError, fzero.checkpoint.CheckpointError),
                           match=rf"{api}: LlamaForCausalLM has parameters the state does not hold: \['model.layers.2.self_attn"):
            export(deeper)
        with pytest.raises((ValueError, fzero.checkpoint.CheckpointError),
                           match=rf"{api}: the state holds separate values for \['model.embed_tokens.weight', 'lm_head.weight'\]"):
            export(tied)
    deeper.model.layers[2].requires_grad_(False)  # frozen: the module's values are the ones fzero.apply would read
    assert step.state_dict(state, deeper)["model.layers.2.mlp.up_proj.weight"] is not None
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"holds every parameter of that model, frozen ones included"):
        fzero.checkpoint.consolidate(ck_model, tmp_path / "m.pt", model=deeper)
    MODELS["llama"]().load_state_dict(step.state_dict(state, MODELS["llama"]()), strict=True)  # another instance: fine


def test_save_weights_names_the_prefix_of_a_model_trained_inside_a_wrapper(tmp_path):
    """Trained as part of a wrapper, the state's names carry its attribute ("net."); model=inner was refused with
    "has no 'net.lm_head.weight'", not saying why or what to do instead."""
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = MODELS["llama"]()

        def forward(self, ids):
            return self.net(input_ids=ids, labels=ids).loss

    wrapper = Wrapper()
    step = fzero.compile(lambda p, ids: fzero.apply(wrapper, p, ids),
                         optimizer=fzero.optim.adamw(1e-2), stages=0)
    state = step.init(fzero.params_of(wrapper))
    with pytest.raises(fzero.checkpoint.CheckpointError, match=r"the state's names carry the prefix 'net.': it was trained as part "
                                                               r"of a module holding LlamaForCausalLM"):
        fzero.checkpoint.save_weights(step, state, tmp_path / "hf", model=wrapper.net)


@pytest.mark.torchrun
def test_save_weights_under_torchrun_matches_the_local_mesh(tmp_path, one_thread):
    """Every rank gathers unit by unit (collectives), rank 0 writes: the same files as the same run on local_mesh(2)."""
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(HERE, "checkpoint_worker.py"), "train", "--dist", "--problem", "mlp", "--stages", "3",
                           "--first", "0", "--last", "3", "--weights", str(out), "--max-shard-size", "2000"],
                          env=ENV, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prob = mlp_problem(steps=3)
    step = make_step(prob, stages=3, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    for b in prob.batches:
        state, _ = step(state, b)
    assert os.path.exists(out / "model.safetensors.index.json")
    assert_trees_equal(read_all(str(out)), step.gather(state))
