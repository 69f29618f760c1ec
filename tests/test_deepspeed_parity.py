"""A DeepSpeed config file trains in fzero as it trains in DeepSpeed's own engine.

A DeepSpeed user's first step is ``fzero.compile(loss_fn, config="ds_config.json")``: the same file, read by
``fzero.config``. Here both run it, on 2 processes under torchrun, on tiny Hugging Face models with their default
configs (``tests/deepspeed_parity_worker.py``: Llama at stage 3 in bf16; GPT-2 with its tied head and dropout at
stage 1 with Adam's L2 decay and the HF scripts' no-decay groups, and at stage 2 in bf16 with clipping that bites; a
BatchNorm CNN at stage 3, whose statistics are compared too;
gradient accumulation, DeepSpeed's lr schedules), and every step's fp32 params, loss, lr and gradient norm are
compared. DeepSpeed runs on its CPU accelerator over gloo, with the client optimizer its config names
(``"torch_adam": true``: torch's Adam/AdamW, as DeepSpeed builds it on a machine without its fused ops).

Under bf16 the two sides' Adam arithmetic may differ in an fp32 ulp of a master (fzero runs torch's fused kernel on
flat buffers); where such an ulp flips a bf16 rounding, the next steps differ by about 1e-4, which is rounding and not
a mapping difference. The bf16 cases here (their seeds and 4 steps) have no such flip: the params agree to 1.2e-7.

Not compared: the key third of GPT-2's fused ``c_attn.bias``. Adding a constant to every key of a query does not
change its softmax, so that bias gets rounding noise as its gradient on both sides, which Adam turns into O(lr)
steps of either sign.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from launch import torchrun

HERE = os.path.dirname(__file__)
CASES = ("llama_stage3_bf16", "gpt2_stage1_adam_l2_groups", "cnn_stage3_buffers", "gpt2_stage2_bf16_clipped")
N_EMBD = 32  # the worker's GPT-2 width


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("parity") / "runs.pt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, not a search for CUDA
        patch.setenv("DS_BUILD_OPS", "0")
        torchrun([os.path.join(HERE, "deepspeed_parity_worker.py"), "--out", str(out), "--cases", ",".join(CASES)],
                 timeout=420)
    return torch.load(out, weights_only=True)


def _compared(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith("attn.c_attn.bias"):  # the key third: see the module docstring
        return torch.cat([t[:N_EMBD], t[2 * N_EMBD:]])
    return t


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_deepspeed_config_trains_as_deepspeeds_engine_trains_it(runs, case):
    ds, fz = runs[case]["deepspeed"], runs[case]["fzero"]
    assert len(ds["params"]) == len(fz["params"]) == 4
    for k, (want, got) in enumerate(zip(ds["params"], fz["params"])):
        assert set(got) == set(want), f"{case} step {k}: params {sorted(set(got) ^ set(want))}"
        for name in want:
            a, b = _compared(name, want[name].float()), _compared(name, got[name].float())
            assert torch.allclose(b, a, rtol=1e-5, atol=1e-6), (
                f"{case} step {k}: {name} is {float((b - a).abs().max()):.3g} off DeepSpeed's")
    assert set(fz["buffers"]) == set(ds["buffers"])  # BatchNorm's statistics and counts, in the state_dict
    if case.startswith("cnn"):  # the statistics moved: 4 steps of 2 micro-batches each
        assert len(ds["buffers"]) == 6 and int(ds["buffers"]["1.num_batches_tracked"]) == 8
        assert not torch.equal(ds["buffers"]["4.running_mean"], torch.zeros_like(ds["buffers"]["4.running_mean"]))
    for name, want in ds["buffers"].items():
        assert torch.allclose(fz["buffers"][name].double(), want.double(), rtol=1e-5, atol=1e-6), (
            f"{case}: buffer {name} is {float((fz['buffers'][name].double() - want.double()).abs().max()):.3g} off DeepSpeed's")
    assert fz["lr"] == pytest.approx(ds["lr"], rel=1e-9, abs=1e-12)  # the lr each update used
    assert fz["loss"] == pytest.approx(ds["loss"], rel=1e-5)
    assert fz["grad_norm"] == pytest.approx(ds["grad_norm"], rel=1e-4)
    # what each case is there for actually happened: the schedule moved, the params moved
    assert len(set(fz["lr"])) > 1
    first = ds["params"][0]
    assert any(not torch.equal(ds["params"][-1][n], first[n]) for n in first)


@pytest.mark.torchrun
@pytest.mark.slow
def test_the_clipped_case_clips(runs):
    norms = runs["gpt2_stage2_bf16_clipped"]["fzero"]["grad_norm"]
    assert max(norms) > 0.05 and all(math.isfinite(n) for n in norms)
