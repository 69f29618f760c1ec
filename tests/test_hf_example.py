"""examples/hf_causal_lm.py trains a Hugging Face causal LM from the seed's DeepSpeed configs and hands back weights
that ``from_pretrained`` loads.

In process on ``local_mesh(2)``: GPT-2 with the Hugging Face ZeRO-2 config and Llama with the ZeRO-3 + CPU offload
config, both with ``"auto"`` values filled from the script's flags; under torchrun (2 processes, gloo): the ZeRO-3
offload job. Each asserts that the loss falls, the loss-curve PNG exists, the exported weights load into a fresh
model with no missing, unexpected or mismatched key and equal the last checkpoint's (saved at the last step and
consolidated), and that greedy generation from the reloaded model runs (and gives what the script printed).
Tiny sizes (about 0.12M params, 64-byte sequences) so that the whole file takes well under two minutes.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

import fzero
from launch import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "hf_causal_lm.py")
ZERO2 = os.path.join(ROOT, "tests", "configs", "hf_zero2_fp16_auto.json")
ZERO3_OFFLOAD = os.path.join(ROOT, "tests", "configs", "hf_zero3_offload_auto.json")
DS_ZERO3_OFFLOAD = os.path.join(ROOT, "tests", "configs", "ds_zero3_offload.json")
STEPS = 40
TINY = ["--size", "tiny", "--seq", "64", "--batch-size", "4", "--steps", str(STEPS), "--lr", "3e-3", "--warmup", "4",
        "--max-bytes", str(1 << 20), "--log-every", "10", "--generate", "8"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_causal_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_run(result: dict, out_dir: str, *, kind: str, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    losses = result["losses"]
    assert result["steps"] == len(losses) == STEPS
    # bytes: the loss starts near ln(256) = 5.5; 40 steps of a tiny model reach the unigram level (~3)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    with open(result["plot"], "rb") as f:
        png = f.read()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000, result["plot"]
    # periodic checkpoints every 10 steps, keeping 2
    assert sorted(os.listdir(os.path.join(out_dir, "checkpoints"))) == ["step_00000030", "step_00000040"]

    loaded, info = AutoModelForCausalLM.from_pretrained(out_dir, output_loading_info=True)
    assert type(loaded).__name__ == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    # the exported weights are the trained ones: the checkpoint of the last step, consolidated, holds the same
    like = load_example().build_model(kind, "tiny", 64)
    saved = torch.load(fzero.checkpoint.consolidate(os.path.join(out_dir, "checkpoints"), tmp_path / "last.pt", model=like),
                       weights_only=True)
    exported = loaded.state_dict()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    assert not all(torch.equal(t, like.state_dict()[n]) for n, t in saved.items())  # and they trained

    # greedy generation from the reloaded weights runs, and gives what the script printed
    assert isinstance(result["generated"], str) and result["generated"]
    ids = torch.tensor([list(b"def ")])
    with torch.no_grad():
        out = loaded.eval().generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    assert bytes(out[0, 4:].tolist()).decode("utf-8", errors="replace") == result["generated"]


@pytest.mark.parametrize("kind, config, stage", [("gpt2", ZERO2, 2), ("llama", ZERO3_OFFLOAD, 3)], ids=["gpt2-zero2", "llama-zero3-offload"])
def test_example_trains_with_a_seed_config_on_local_mesh(kind, config, stage, tmp_path, capsys):
    out_dir = str(tmp_path / "out")
    result = load_example().main([*TINY, "--model", kind, "--deepspeed", config, "--mesh", "local", "--ranks", "2",
                                  "--out-dir", out_dir, "--save-every", "10", "--keep", "2"])
    assert (result["stage"], result["world_size"], result["mesh"]) == (stage, 2, "local")
    check_run(result, out_dir, kind=kind, tmp_path=tmp_path)
    printed = capsys.readouterr().out
    # the config as fzero read it: "auto" resolved from the flags, the no-decay group, what has no effect here
    for part in ('"auto" resolved:', "optimizer.params.lr = 0.003  (learning_rate=)",
                 "train_micro_batch_size_per_gpu = 4  (batch_size=)", "mask=fzero.optim.no_decay_names(", "notes:"):
        assert part in printed, part
    if stage == 3:
        assert "offload               cpu; params too: True" in printed


@pytest.mark.torchrun
def test_example_under_torchrun_zero3_offload(tmp_path):
    out_dir, out = str(tmp_path / "out"), tmp_path / "result.json"
    proc = torchrun([EXAMPLE, *TINY, "--model", "llama", "--deepspeed", ZERO3_OFFLOAD, "--out-dir", out_dir,
                     "--save-every", "10", "--keep", "2", "--json-out", str(out)])
    result = json.loads(out.read_text())
    assert (result["stage"], result["world_size"], result["mesh"]) == (3, 2, "dist")
    check_run(result, out_dir, kind="llama", tmp_path=tmp_path)
    assert proc.stdout.count('"auto" resolved:') == 1  # rank 0 prints, rank 1 does not


def test_example_resumes_from_its_checkpoint_exactly(tmp_path):
    """ZeRO-3 offload (WarmupLR: the schedule does not depend on --steps): 3 steps, then 3 more from the checkpoint."""
    base = [*TINY, "--model", "llama", "--deepspeed", ZERO3_OFFLOAD, "--mesh", "local", "--ranks", "2", "--warmup", "2",
            "--out-dir", str(tmp_path / "out"), "--generate", "0", "--plot", ""]
    straight = load_example().main([*base, "--steps", "6"])
    first = load_example().main([*base, "--steps", "3", "--save-every", "3"])
    resumed = load_example().main([*base, "--steps", "6", "--resume"])
    assert first["losses"] == straight["losses"][:3]
    assert resumed["first_step"] == 3 and resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-6)


def test_example_refuses_flags_that_contradict_the_config(tmp_path):
    base = [*TINY, "--mesh", "local", "--ranks", "2", "--out-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"--lr gives optimizer.params.lr = 0.003, but .*ds_zero3_offload.json sets it to "
                                         r"0.001. Drop the flag, or write \"auto\" there"):
        load_example().main([*base, "--deepspeed", DS_ZERO3_OFFLOAD])
    with pytest.raises(SystemExit, match=r"--precision bf16, but .*hf_zero2_fp16_auto.json trains in fp32"):
        load_example().main([*base, "--deepspeed", ZERO2, "--precision", "bf16"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_default_no_decay_names_are_decay_mask(kind):
    """The script's HF-style no_decay list picks exactly the params fzero.optim.decay_mask leaves undecayed."""
    example = load_example()
    params = fzero.params_of(example.build_model(kind, "tiny", 64))
    names = example.parse_args([]).no_decay
    assert fzero.optim.no_decay_names(names)(params) == fzero.optim.decay_mask(params)
    assert 0 < sum(fzero.optim.decay_mask(params).values()) < len(params)


def test_example_refuses_an_output_file_in_a_missing_directory_before_training(tmp_path, capsys):
    """--json-out and --plot are written after the last step (the plot's default, OUT_DIR, is made before training):
    a directory that does not exist is refused at the start, not by a FileNotFoundError after the whole run."""
    for flag in ("--json-out", "--plot"):
        with pytest.raises(SystemExit):
            load_example().parse_args(["--out-dir", str(tmp_path / "out"), flag, str(tmp_path / "missing" / "x")])
        assert f"{flag} {tmp_path / 'missing' / 'x'}: the directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    load_example().parse_args(["--out-dir", str(tmp_path / "out")])  # the default plot, inside OUT_DIR: made later
