"""docs/migrating.md: every fzero code block in it runs, and what it names exists.

The blocks fenced as ```python fzero are run top to bottom in one namespace, as a reader would paste them, in a
temporary directory holding a copy of tests/configs (the seed's DeepSpeed configs the page reads), at the tiny
sizes the page shows. The DeepSpeed, Lightning and Accelerate blocks (plain ```python) are there to compare
with: Lightning and Accelerate are not installed, so they are only compiled, and must not hold fzero code that
would then go untested.
"""

from __future__ import annotations

import functools
import os
import re
import shutil

import pytest
import torch

import fzero

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "migrating.md")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


@functools.cache
def page() -> str:
    with open(DOC) as f:
        return f.read()


@functools.cache
def blocks() -> list[tuple[str, str]]:
    """(info string, code) of every fenced block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(page())]


def test_the_page_compares_every_way_the_seed_uses_deepspeed():
    text = page()
    for name in ("deepspeed.initialize", "engine.backward", "engine.step", "deepspeed_stage_1", "deepspeed_stage_2",
                 "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload",
                 "DeepSpeedStrategy(config=", "DeepSpeedPlugin", "zero_to_fp32", "stage3_gather_16bit_weights_on_model_save",
                 "decay_mask", "## 8. What does not exist (yet)", "libaio"):
        assert name in text, name
    kinds = [info for info, _ in blocks()]
    assert kinds.count("python fzero") >= 8 and kinds.count("python") >= 4, kinds


def test_comparison_blocks_compile_and_hold_no_fzero_code():
    for i, (info, code) in enumerate(blocks()):
        if info == "python":
            compile(code, f"{DOC}[block {i}]", "exec")  # a syntax error in what readers copy is a bug too
            assert "fzero" not in code, f"block {i} holds fzero code but is not marked 'python fzero', so it is not run"
        else:
            assert info in ("python fzero", "bash"), f"block {i}: unknown fence {info!r}"


def test_fzero_names_on_the_page_exist():
    """Every dotted ``fzero.x.y`` the prose and tables name resolves (the blocks are checked by running them)."""
    names = set(re.findall(r"\bfzero(?:\.[A-Za-z_]\w*)+", page()))
    assert len(names) > 20
    for name in sorted(names):
        obj = fzero
        for part in name.split(".")[1:]:
            assert hasattr(obj, part), f"docs/migrating.md names {name}, which does not exist"
            obj = getattr(obj, part)


# peft 0.21 reads transformers 5's deprecated is_gradient_checkpointing when it wraps a model (section 5's LoRA block)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_every_fzero_block_runs(tmp_path, monkeypatch, capsys):
    shutil.copytree(os.path.join(ROOT, "tests", "configs"), tmp_path / "tests" / "configs")
    monkeypatch.chdir(tmp_path)  # checkpoints and exported weights land here, not in the checkout
    namespace: dict = {"__name__": "__main__"}
    for i, (info, code) in enumerate(blocks()):
        if info == "python fzero":
            exec(compile(code, f"{DOC}[block {i}]", "exec"), namespace)
    printed = capsys.readouterr().out
    # what the blocks print for the reader: the settings read, each Lightning strategy trained, the refusal by name
    assert "fzero settings from the DeepSpeed config tests/configs/ds_zero3_offload.json" in printed
    assert 'optimizer.params.lr = 0.003  (learning_rate=)' in printed
    for name in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload", "deepspeed_stage_3",
                 "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme"):
        assert re.search(rf"^{name} +ZeRO-{name[16]}  loss \d", printed, re.MULTILINE), name
    assert "'OneBitAdam' is 1-bit Adam" in printed and "which fzero does not implement" in printed
    assert os.path.exists(tmp_path / "hf_out" / "config.json")
    trained = namespace["lora_step"].gather(namespace["lora_state"])  # section 5's LoRA: the adapter written is the trained one
    assert all(torch.equal(namespace["lora_reloaded"].state_dict()[name], value) for name, value in trained.items())


@pytest.mark.parametrize("path", ["tests/configs/hf_zero2_fp16_auto.json", "tests/configs/hf_zero3_offload_auto.json"])
def test_the_auto_table_names_every_auto_of_the_seed_configs(path):
    """Section 2's table covers each "auto" the seed's Hugging Face configs hold."""
    import json

    def autos(block, prefix=""):
        for key, value in block.items():
            if isinstance(value, dict):
                yield from autos(value, f"{prefix}{key}.")
            elif value == "auto":
                yield key

    with open(os.path.join(ROOT, path)) as f:
        cfg = json.load(f)
    text = page()
    table = text[text.index("| `\"auto\"` in the config"):text.index("```python fzero", text.index("| `\"auto\"` in the config"))]
    for key in set(autos(cfg)):
        assert key in table, key
