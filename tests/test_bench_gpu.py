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
import torch

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


@pytest.mark.slow
def test_gpu_profile_runs_on_cpu_and_writes_its_tables(tmp_path):
    """benchmarks/gpu_profile.py end to end on CPU (tiny GPT): a row per system with a step time and no error, its
    tables and its cProfile, as .ci/gpu-quick reads them on a GPU machine."""
    script = os.path.join(ROOT, "benchmarks", "gpu_profile.py")
    cmd = [sys.executable, script, "--device", "cpu", "--sizes", "tiny", "--seq", "32", "--batch", "2", "--systems",
           "plain,fzero-s3", "--extra", "tiny:fzero-s3-m2", "--cprofile", "tiny:fzero-s3", "--warmup", "1", "--steps", "2",
           "--prof-steps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert [r["system"] for r in rows] == ["plain", "fzero-s3", "fzero-s3-m2"]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["top_self_cpu"]
    assert "fzero.unit" in rows[1]["fzero_ranges"]  # fzero's own ranges are read from the trace
    tables = (tmp_path / "tables.txt").read_text()
    assert tables.count("== tiny ") == 3
    assert "| tiny | plain |" in tables and "| 1.00x |" in tables and "| tiny | fzero-s3 |" in tables  # the ratio table
    assert "fzero-s3" in (tmp_path / "cprofile.txt").read_text()


def test_gpu_profiles_busy_time_counts_device_work_not_ranges():
    """A ``record_function`` range shows on the device too, from its first kernel to its last, gaps included: counted as
    busy it made fzero (a range per unit call) look busier than plain PyTorch on the same kernels."""
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_profile
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda, annotation=False):
        return types.SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                                     time_range=types.SimpleNamespace(start=start, end=end))

    events = [ev("gemm", 0, 10), ev("copy", 40, 50), ev("fzero.unit:blocks.0", 0, 50, annotation=True),
              ev("fzero.unit:blocks.1", 60, 90), ev("Optimizer.step#AdamW.step", 60, 90), ev("aten::mm", 0, 99, device=cpu)]
    work = gpu_profile.device_work(events)
    assert [e.name for e in work] == ["gemm", "copy"]
    assert gpu_profile.busy_us(work) == 20.0  # not 80: the ranges' gaps


def test_host_overhead_measures_each_system(one_thread):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import host_overhead
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    med = host_overhead.main(["--layers", "2", "--rounds", "2"])
    assert set(med) == {"plain", "fzero-s0", "fzero-s3"} and all(v > 0 for v in med.values())


def test_stage3_host_phases_times_each_phase(one_thread):
    """benchmarks/stage3_host_phases.py: every phase's timer reaches the function it names (a renamed or moved one would
    leave its row at zero), the phases partition the step, and fzero's functions are unwrapped afterwards."""
    import fzero.zero._sharded as sharded

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import stage3_host_phases
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    before = sharded._build_skeleton
    out = stage3_host_phases.main(["--layers", "2", "--rounds", "2", "--warmup", "1"])
    assert sharded._build_skeleton is before
    assert set(out["totals"]) == {"plain", "fzero-s3"} and all(v > 0 for v in out["totals"].values())
    ph = out["phases"]
    for row in ("step", "gradient", "  skeleton", "  units", "    module", "  backward", "release", "finish"):
        assert ph[row] > 0, row
    for row in ("entry", "    fzero's", "  other", "rest"):  # what is left of a phase once its parts are taken out
        assert ph[row] >= 0, row
