"""benchmarks/gpu.py runs end to end on CPU (``--device cpu --smoke``) and writes the JSON it documents.

The numbers are meaningless on CPU (tiny models, one round); what is checked is the shape of the result the
GPU run will fill in: a row per system of every size, positive tokens/s for plain PyTorch and fzero, FSDP2
either measured or skipped with a reason, the AdamW section either measured or "not available" with a
reason, and a largest-trained row per offload mode. One subprocess, about 20-30 s on 2 cores.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu") / "gpu.json"
    cmd = [sys.executable, SCRIPT, "--device", "cpu", "--smoke", "--json-out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc.stdout


@pytest.mark.slow
def test_environment_and_settings(result):
    res, _ = result
    assert res["schema"] == "fzero-benchmarks-gpu/1"
    env = res["env"]
    for key in ("device", "device_name", "torch", "triton", "git_commit", "python"):
        assert key in env
    assert env["device"] == "cpu"
    st = res["settings"]
    assert st["smoke"] is True and st["device"] == "cpu"
    assert st["peak_flops"] is None and "peak" in st["peak_source"]  # no MFU on a CPU unless --peak-tflops
    assert set(st["time_limits"]) == {"models", "adamw", "offload"}


@pytest.mark.slow
def test_models_rows(result):
    res, stdout = result
    rows = res["models"]["rows"]
    assert {(r["size"], r["system"]) for r in rows} == {("tiny", s) for s in ("plain", "fsdp2", "fzero-s3")}
    by = {r["system"]: r for r in rows}
    for name in ("plain", "fzero-s3"):
        r = by[name]
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / r["step_s"])
        assert r["params"] > 0 and r["peak_mem_bytes"] > 0
        assert r["mfu"] is None  # no peak FLOP/s for a CPU
        assert all(math.isfinite(x) for run in r["losses"] for x in run)
    fsdp = by["fsdp2"]
    assert fsdp["status"] == "ok" and fsdp["tokens_per_s"] > 0 or fsdp["status"] == "skipped" and fsdp["reason"]
    assert all(r["batch"] == by["plain"]["batch"] for r in rows)  # one micro-batch for every system
    assert "| tiny |" in stdout and "fzero-s3" in stdout


@pytest.mark.slow
def test_adamw_section(result):
    res, _ = result
    a = res["adamw"]  # both rows measured; on the CPU fzero's torch reference stands in for the Triton kernel
    assert a.get("status", "ok") == "ok", a
    for impl in ("torch", "torch_fused"):
        assert any(r["impl"] == impl and r["status"] == "ok" and r["gbps"] > 0 for r in a["rows"]), (impl, a["rows"])


@pytest.mark.slow
def test_offload_rows(result):
    res, _ = result
    off = res["offload"]
    assert set(off["largest"]) == {"cpu", "disk"}
    for mode, best in off["largest"].items():
        row = next(r for r in off["rows"] if r["mode"] == mode and r["system"] == "fzero" and r["status"] == "ok")
        assert row["size"] == best["size"] and row["params"] == best["params"] > 0
        assert row["step_s"] > 0 and row["peak_rss_bytes"] > 0
        assert len(row["step_times_s"]) == res["settings"]["offload_steps"]
    ds = next(r for r in off["rows"] if r["system"] == "deepspeed")
    assert ds["status"] == "skipped" and ds["reason"] == "--smoke"
