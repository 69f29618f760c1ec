"""fzero on one GPU: GPT-2 sizes at stage 3 in bf16 against plain PyTorch and FSDP2, the Triton AdamW
against ``torch._fused_adamw_``, and the largest GPT that trains with CPU and with disk offload
(issue 14, "What must be shown"). Prints markdown tables; ``--json-out`` writes everything.

    python benchmarks/gpu.py --json-out runs/gpu.json                              # all three, <= 9 min
    python benchmarks/gpu.py --only models --time-limit 540 --json-out runs/gpu-models.json
    python benchmarks/gpu.py --only adamw --json-out runs/gpu-adamw.json
    python benchmarks/gpu.py --only offload --time-limit 540 --json-out runs/gpu-offload.json
    python benchmarks/gpu.py --device cpu --smoke --json-out /tmp/gpu-smoke.json   # ~30 s on 2 cores (the CPU test)

A short run for a lent GPU, with a Hugging Face Llama row and the ratios to plain PyTorch and FSDP2, is
``benchmarks/gpu_profile.py`` (``bash .ci/gpu-quick`` runs it with the tests, in about 7 minutes).

Every section stops at its time limit (``--time-limit S`` for every section or ``--time-limit offload=S``,
repeatable; defaults models 240 s, adamw 60 s, offload 220 s: 520 s plus start-up for the default run) and
records what it left out and why. The JSON is rewritten after every section.

**models.** GPT-2 shapes in ``fzero.models.GPT`` (pre-LN, GELU, biases as GPT-2, tied LM head, no dropout),
seq 1024, vocab ``--vocab`` (default 50304: GPT-2's 50257 padded to a multiple of 64, as nanoGPT does; the
tables say which): 124M = 12x768 (12 heads), 350M = 24x1024 (16), 774M = 36x1280 (20), 1.5B = 48x1600 (25).
Every system gets the same micro-batch (``--batch``), the same initial values (drawn on the device from one
seed) and the same batches (random tokens), AdamW(lr 3e-4, wd 0.01), no clipping, loss = cross-entropy on
fp32 logits. ``--remat`` checkpoints every block in every system alike.

* ``plain``: the module on the device in fp32, forward under ``torch.autocast(bf16)``, ``loss.backward()``,
  ``torch.optim.AdamW(fused=True)``: PyTorch's usual mixed precision, 16 bytes/param of model states.
* ``fsdp2``: ``fully_shard`` on each block and on the root, ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, a 1-process process group in this process (NCCL on CUDA, gloo on CPU),
  ``AdamW(fused=True)`` (foreach where fused refuses DTensors; the row's notes say which).
* ``fzero-s3``: ``fzero.compile(stages=3, mesh=fzero.local_mesh(1), precision=Precision(compute=bf16,
  reduce=--reduce-dtype))`` with ``fzero.optim.adamw``: bf16 params and compute, fp32 master weights.

Timing: ``--rounds`` rounds; in each, every system (order rotating, reversed every other round) is built
fresh, runs ``--warmup`` untimed steps and ``--steps`` timed steps, each between ``synchronize`` calls, and
is freed (``empty_cache``) before the next, so only one system is ever resident: that is what lets 1.5B be
interleaved on one 80 GB GPU, and what makes each system's peak memory its own
(``max_memory_allocated`` from before its build; on CPU the process's peak RSS instead). Step time is the
median of all timed steps; tokens/s = batch x seq / step time; MFU = 6 x params x tokens/s / peak bf16
FLOP/s (``--peak-tflops``, else a table by ``torch.cuda.get_device_name``; the JSON says which was used).
``mfu_attn`` adds the attention matmuls (12 x layers x width x seq FLOPs per token, PaLM's count). A
system that runs out of memory is recorded as OOM; if any does in a size's first round, the size is run
again at half the batch for every system (``--no-oom-retry`` to stop that). Each size gets an equal share
of what is left of the section's time, and at least one round.

**adamw.** ``fzero.ops.adamw_gbps(n, device=, impl=, repeats=)`` for impl "triton" and "torch_fused"
(``torch._fused_adamw_``) at ``--adamw-sizes`` elements. Reported "not available", with the reason, where
``fzero.ops`` has no such function yet or it raises.

**offload.** For each mode in ``--offload-modes`` (``cpu``: ZeRO-Offload, optimizer state and fp32 masters
in host memory; ``disk``: in files under ``--offload-dir``), the largest GPT of a depth x width grid
(1.3B .. 12.8B; ``--offload-sizes`` picks others) that trains at stage 3, bf16, remat on every block, batch
``--offload-batch`` x seq 1024 on ``local_mesh(1)``. The model is built on the meta device and materialised
one unit at a time by fzero's streaming init (``step.init(params, materialize=model.init_value)``, as
``benchmarks/largest_gpt.py`` does on CPU). Candidates predicted by ``fzero.estimate_memory`` (plus an
activation estimate) to fit the GPU, the host's available memory and the offload directory's free disk are
tried from the largest down, each in a fresh process (``--offload-steps`` steps; its time limit is what is
left of the section's), until one trains: its row gives params, step time (the last step; the first
includes warm-up), peak GPU memory and peak host RSS. A candidate killed at the time limit ends the mode's
search (a smaller one would not get a fair run either); if it finished a step it counts, marked incomplete,
with what it measured. Disk files go to a subdirectory per candidate, removed after it. DeepSpeed ZeRO-Offload (stage 3,
``offload_optimizer: cpu``, bf16, DeepSpeed's AdamW, same remat) runs beside it at the size fzero reached
with ``cpu``, where ``import deepspeed`` works (``--deepspeed on|off|auto``; auto: not in ``--smoke``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import inspect
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere: fzero from this checkout
    sys.path.insert(0, ROOT)

from fzero.models import GPT, GPTConfig, num_params  # noqa: E402

GiB = 2**30
LR, WEIGHT_DECAY = 3e-4, 0.01
SECTIONS = ("models", "adamw", "offload")
DEFAULT_LIMITS = {"models": 240.0, "adamw": 60.0, "offload": 220.0}
SYSTEMS = ("plain", "fsdp2", "fzero-s3")

# GPT-2's shapes: name -> (layers, width, heads)
GPT2 = {"124M": (12, 768, 12), "350M": (24, 1024, 16), "774M": (36, 1280, 20), "1.5B": (48, 1600, 25)}
# The offload grid, growing towards and past 7B params (names are the approximate count at vocab 50304).
OFFLOAD_GRID = {"1.3B": (24, 2048, 16), "2.6B": (32, 2560, 20), "3.8B": (32, 3072, 24), "6.7B": (32, 4096, 32),
                "7.5B": (36, 4096, 32), "8.3B": (40, 4096, 32), "9.9B": (48, 4096, 32), "12.8B": (40, 5120, 40)}
SMOKE = {"tiny": (2, 64, 4)}
SMOKE_OFFLOAD = {"tiny-1": (1, 32, 2), "tiny-2": (2, 32, 2)}

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name (first match wins).
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
             ("H800", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
             ("L4", 121e12), ("A10G", 70e12), ("A10", 125e12))


# -- arguments ----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", choices=SECTIONS, help="run this section (repeatable; default all)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny models, 1 round, small sizes: for the CPU test")
    p.add_argument("--sizes", default=None, help=f"comma-separated, from {', '.join(GPT2)} (default all)")
    p.add_argument("--batch", default=None, help="micro-batch: N for every size, or e.g. '8,1.5B=4' (default 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024)")
    p.add_argument("--vocab", type=int, default=None, help="vocab size (default 50304; 50257 is GPT-2's own)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per system per round (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per system per round (default 2)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per size (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from " + ", ".join(SYSTEMS))
    p.add_argument("--remat", action="store_true", help="checkpoint every block, in every system")
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="gradient reduce dtype of fzero and FSDP2 (default fp32, as FSDP2's usual policy)")
    p.add_argument("--no-oom-retry", action="store_true", help="do not rerun a size at half the batch after an OOM")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s for MFU (default: by device name)")
    p.add_argument("--adamw-sizes", default=None, help="elements, comma-separated (default 2^24,2^26,2^28)")
    p.add_argument("--adamw-repeats", type=int, default=20)
    p.add_argument("--offload-modes", default="cpu,disk")
    p.add_argument("--offload-sizes", default=None, help=f"candidates: names from {', '.join(OFFLOAD_GRID)} or LxW[xH]")
    p.add_argument("--offload-dir", default=None, help="directory for disk offload (default: a new one under $TMPDIR)")
    p.add_argument("--offload-batch", type=int, default=1)
    p.add_argument("--offload-steps", type=int, default=2, help="steps per offload candidate (the last is timed)")
    p.add_argument("--offload-params", action="store_true", help="stage-3 param shards offloaded too")
    p.add_argument("--offload-try-above", action="store_true",
                   help="after the largest predicted fit trains, try the next candidate up as well")
    p.add_argument("--deepspeed", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--time-limit", action="append", default=[], help="seconds per section: S, or SECTION=S (repeatable)")
    p.add_argument("--json-out", default=None)
    p.add_argument("--offload-worker", default=None, help=argparse.SUPPRESS)  # internal: one offload candidate
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {"seq": 32 if smoke else 1024, "vocab": 256 if smoke else 50304, "steps": 2 if smoke else 5,
                "warmup": 1 if smoke else 2, "rounds": 1 if smoke else 3, "batch": "2" if smoke else "8",
                "adamw_sizes": "4096" if smoke else f"{2**24},{2**26},{2**28}"}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.sections = list(dict.fromkeys(args.only or SECTIONS))
    args.limits = dict(DEFAULT_LIMITS)
    for item in args.time_limit:
        name, _, value = item.rpartition("=")
        if name and name not in SECTIONS:
            p.error(f"--time-limit {item}: section must be one of {', '.join(SECTIONS)}")
        for s in ([name] if name else SECTIONS):
            args.limits[s] = float(value)
    table = SMOKE if smoke else GPT2
    names = list(table) if args.sizes is None else [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in names if s not in table]
    if unknown:
        p.error(f"--sizes: unknown {unknown}; choose from {', '.join(table)}")
    args.size_shapes = {s: table[s] for s in names}
    args.batch_of = _batches(args.batch, names, p)
    args.system_list = [s.strip() for s in args.systems.split(",") if s.strip()]
    if any(s not in SYSTEMS for s in args.system_list):
        p.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    return args


def _batches(spec: str, names: list[str], p) -> dict[str, int]:
    default, per = None, {}
    for item in spec.split(","):
        name, _, value = item.strip().rpartition("=")
        if name:
            per[name] = int(value)
        else:
            default = int(value)
    if default is None and set(per) != set(names):
        p.error(f"--batch {spec}: give a default (e.g. '8,1.5B=4') or a batch for every size")
    return {n: per.get(n, default) for n in names}


# -- environment --------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException | None) -> bool:
    """Out of device memory, also when it reached us wrapped (e.g. re-raised from a rank thread of a local mesh)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def error_text(e: BaseException) -> str:
    """The exception and what it was raised from (an OOM re-raised from a rank thread keeps its message)."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {str(e)[:500]}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)


def rss_bytes(field: str = "VmHWM") -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment(device: torch.device) -> dict[str, Any]:
    triton = None
    with contextlib.suppress(Exception):
        import triton as _triton

        triton = _triton.__version__
    status = git("status", "--porcelain")
    env = {"device": str(device), "device_name": None, "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton, "python": platform.python_version(), "git_commit": git("rev-parse", "HEAD"),
           "git_dirty_files": None if status is None else len(status.splitlines()), "cpu_count": os.cpu_count(),
           "host_mem_total": meminfo("MemTotal"), "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=torch.cuda.get_device_name(device), device_mem_total=props.total_memory,
                   device_capability=f"{props.major}.{props.minor}")
    else:
        with contextlib.suppress(OSError, StopIteration):
            with open("/proc/cpuinfo") as f:
                env["device_name"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    return env


def peak_flops(args, env) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops:g}"
    name = env.get("device_name") or ""
    if env["device"].startswith("cuda"):
        for key, flops in PEAK_BF16:
            if key in name:
                return flops, f"table: {key!r} in {name!r}, dense bf16 {flops / 1e12:g} TFLOP/s"
        return None, f"no peak known for {name!r}: pass --peak-tflops"
    return None, "no peak for a CPU: pass --peak-tflops for an MFU"


# -- the model, shared by every system ----------------------------------------------------------------
def gpt_config(shape: tuple[int, int, int], args) -> GPTConfig:
    layers, width, heads = shape
    return GPTConfig(n_layer=layers, d_model=width, n_head=heads, seq_len=args.seq, vocab_size=args.vocab, bias=True)


def meta_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)  # GPT draws its init seed from the global CPU generator
    with torch.device("meta"):
        return GPT(cfg)


@torch.no_grad()
def build_gpt(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    """A GPT on ``device`` with GPT.init_value's distributions, drawn on the device (fast at 1.5B) from ``seed``:
    the same values for every system of a run."""
    model = meta_gpt(cfg, seed).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, nn.LayerNorm):
            p.fill_(1.0 if kind == "weight" else 0.0)
        elif kind == "bias":
            p.zero_()
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if module_name.endswith(("attn.proj", "mlp.down")) else 0.02
            p.normal_(0.0, std, generator=gen)
    return model


class Remat(nn.Module):
    """A block recomputed in backward (``torch.utils.checkpoint``, non-reentrant): plain's and FSDP2's remat."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def with_remat(model: GPT) -> GPT:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Remat(block)
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on fp32 logits, for every system alike."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_batches(count: int, batch: int, seq: int, vocab: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    out = []
    for k in range(count):
        g = torch.Generator().manual_seed(1234 + k)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append({"x": tokens[:, :-1].contiguous().to(device), "y": tokens[:, 1:].contiguous().to(device)})
    return out


def precision(args):
    import fzero

    reduce = torch.float32 if args.reduce_dtype == "fp32" else torch.bfloat16
    return fzero.Precision(compute=torch.bfloat16, reduce=reduce)


# -- the systems: each returns (step(batch) -> loss float, notes) ---------------------------------------
def make_plain(cfg, args, device):
    model = build_gpt(cfg, device)
    if args.remat:
        with_remat(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(batch["x"])
        loss = lm_loss(logits, batch["y"])
        loss.backward()
        opt.step()
        return float(loss.detach())  # a sync point, as fzero's metrics are

    return step, "fp32 params, torch.autocast(bf16), torch.optim.AdamW(fused=True)"


_PG: dict[str, Any] = {}


def process_group(device: torch.device) -> None:
    """A 1-process process group in this process (NCCL on CUDA, gloo on CPU), from a FileStore."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    _PG["dir"] = tempfile.mkdtemp(prefix="fzero-gpu-pg-")
    store = dist.FileStore(os.path.join(_PG["dir"], "store"), 1)
    # torch 2.11 wants the device with its index ("Please use a device_id with index")
    kw = {"device_id": torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())} \
        if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1, **kw)


def make_fsdp2(cfg, args, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    process_group(device)
    model = build_gpt(cfg, device)
    if args.remat:
        with_remat(model)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32 if args.reduce_dtype == "fp32" else torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    kind = "fused"
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    except (RuntimeError, TypeError):
        kind = "foreach"
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step, (f"fully_shard per block + root (reshard_after_forward=True), MixedPrecisionPolicy(bf16, "
                  f"reduce {args.reduce_dtype}), AdamW({kind}=True)")


def make_fzero(cfg, args, device):
    import fzero

    model = build_gpt(cfg, device)

    def loss_fn(params, batch):
        return lm_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    kw = {"remat": True} if args.remat else {}
    fstep = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY), stages=3,
                          mesh=fzero.local_mesh(1), precision=precision(args), **kw)
    box = {"state": fstep.init(fzero.params_of(model, copy=False))}
    model.to("meta")  # fzero reads only the module's structure: drop its full weights

    def step(batch):
        box["state"], metrics = fstep(box["state"], batch)
        return metrics["loss"]

    return step, (f"fzero.compile(stages=3, mesh=local_mesh(1), precision=Precision(bf16, reduce {args.reduce_dtype})"
                  f"{', remat=True' if args.remat else ''}), fzero.optim.adamw")


MAKERS = {"plain": make_plain, "fsdp2": make_fsdp2, "fzero-s3": make_fzero}


# -- section: models ----------------------------------------------------------------------------------
def run_system(name, cfg, args, device, batches) -> dict[str, Any]:
    """Build ``name`` alone, run warm-up and timed steps, free it. Never raises: failures become the row's status."""
    row: dict[str, Any] = {"system": name, "status": "ok"}
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        reset_peak_rss()
    try:
        t0 = time.perf_counter()
        step, row["notes"] = MAKERS[name](cfg, args, device)
        sync(device)
        row["build_s"] = time.perf_counter() - t0
        losses, times = [], []
        for k in range(args.warmup):
            losses.append(step(batches[k % len(batches)]))
        for k in range(args.warmup, args.warmup + args.steps):
            sync(device)
            t0 = time.perf_counter()
            losses.append(step(batches[k % len(batches)]))
            sync(device)
            times.append(time.perf_counter() - t0)
        row.update(times_s=times, losses=losses)
        if not all(math.isfinite(x) for x in losses):
            row["status"] = "error"
            row["error"] = f"non-finite loss: {losses}"
    except Exception as e:  # noqa: BLE001 - a benchmark records a failure and goes on
        row["status"] = "OOM" if is_oom(e) else "error"
        row["error"] = error_text(e)
        row["traceback"] = traceback.format_exc()[-3000:]
    step = None  # noqa: F841 - drops the system (its state lives in step's closure) before the next is built
    if device.type == "cuda":
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row["peak_mem_kind"] = "cuda max_memory_allocated above the memory allocated before the build"
    else:
        row["peak_mem_bytes"] = rss_bytes("VmHWM")
        row["peak_mem_kind"] = "process peak RSS (VmHWM), reset before the build"
    free_memory(device)
    return row


def run_size(size, shape, batch, args, device, budget_s, flops) -> tuple[list[dict], bool]:
    """Interleaved rounds of every system at one size and batch. Returns (rows, any OOM in round 1)."""
    cfg = gpt_config(shape, args)
    psi = num_params(meta_gpt(cfg))
    batches = make_batches(4, batch, args.seq, args.vocab, device)
    names = list(args.system_list)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    start = time.perf_counter()
    last_round = 0.0
    rounds_done = 0
    for r in range(args.rounds):
        spent = time.perf_counter() - start
        if r > 0 and spent + last_round > budget_s:
            break
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order = order[::-1]
        t_round = time.perf_counter()
        for n in order:
            if runs[n] and runs[n][-1]["status"] != "ok":
                continue  # an OOM or error is not retried within the size
            row = run_system(n, cfg, args, device, batches)
            runs[n].append(row)
            med = statistics.median(row["times_s"]) if row.get("times_s") else float("nan")
            print(f"  {size} batch {batch} round {r + 1}: {n:9s} {row['status']:5s} {med * 1e3:8.1f} ms/step "
                  f"peak {row['peak_mem_bytes'] / GiB:6.2f} GiB", file=sys.stderr, flush=True)
        last_round = time.perf_counter() - t_round
        rounds_done += 1
        if r == 0 and any(runs[n][0]["status"] == "OOM" for n in names):
            break
    rows = []
    oom_first = any(runs[n] and runs[n][0]["status"] == "OOM" for n in names)
    tokens = batch * args.seq
    for n in names:
        rs = runs[n]
        ok = [x for x in rs if x["status"] == "ok"]
        status = "skipped" if not rs else "ok" if len(ok) == len(rs) else "partial" if ok else rs[-1]["status"]
        row = {"size": size, "system": n, "layers": shape[0], "width": shape[1], "heads": shape[2], "params": psi,
               "batch": batch, "seq": args.seq, "vocab": args.vocab, "remat": args.remat, "rounds": len(ok),
               "status": status, "notes": next((x["notes"] for x in rs if "notes" in x), None)}
        if not rs:
            row["reason"] = "time limit"
        elif rs[-1]["status"] != "ok":  # "partial": the rounds before it are measured, then it failed
            row.update(failed=rs[-1]["status"], error=rs[-1].get("error"), traceback=rs[-1].get("traceback"))
        if ok:
            times = [t for x in ok for t in x["times_s"]]
            step_s = statistics.median(times)
            row.update(step_s=step_s, step_times_s=times, round_medians_s=[statistics.median(x["times_s"]) for x in ok],
                       tokens_per_s=tokens / step_s, build_s=[x["build_s"] for x in ok],
                       losses=[x["losses"] for x in ok])
            row["mfu"] = 6 * psi * row["tokens_per_s"] / flops if flops else None
            attn = 12 * shape[0] * shape[1] * args.seq
            row["mfu_attn"] = (6 * psi + attn) * row["tokens_per_s"] / flops if flops else None
        row["peak_mem_bytes"] = max((x["peak_mem_bytes"] for x in rs), default=None)
        row["peak_mem_kind"] = rs[0]["peak_mem_kind"] if rs else None
        rows.append(row)
    print(f"  {size}: {rounds_done} round(s) in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows, oom_first


def section_models(args, device, flops, deadline) -> dict[str, Any]:
    rows = []
    sizes = list(args.size_shapes)
    for i, size in enumerate(sizes):
        left = deadline - time.perf_counter()
        if left <= 0:
            rows += [{"size": size, "system": n, "status": "skipped", "reason": "time limit"} for n in args.system_list]
            continue
        batch = args.batch_of[size]
        while True:
            got, oom = run_size(size, args.size_shapes[size], batch, args, device, left / (len(sizes) - i), flops)
            rows += got
            if not (oom and batch > 1 and not args.no_oom_retry) or deadline - time.perf_counter() <= 0:
                break
            batch //= 2
            print(f"  {size}: out of memory; again at batch {batch} for every system", file=sys.stderr, flush=True)
            left = deadline - time.perf_counter()
    fsdp = {(r["size"], r["batch"]): r for r in rows if r["system"] == "fsdp2" and r.get("step_s")}
    for r in rows:
        peer = fsdp.get((r["size"], r.get("batch")))
        if peer and r.get("step_s"):
            r["speed_vs_fsdp2"] = peer["step_s"] / r["step_s"]  # > 1: faster than FSDP2
    return {"rows": rows}


# -- section: adamw -----------------------------------------------------------------------------------
def section_adamw(args, device, deadline) -> dict[str, Any]:
    try:
        from fzero.ops import bench as ops
    except Exception as e:  # noqa: BLE001
        return {"status": "not available", "reason": f"import fzero.ops failed: {type(e).__name__}: {e}", "rows": []}
    fn = getattr(ops, "adamw_gbps", None)
    if fn is None:
        return {"status": "not available", "reason": "fzero.ops has no adamw_gbps (the Triton AdamW is not in ops/ yet)",
                "rows": []}
    rows = []
    for n in [int(x) for x in args.adamw_sizes.split(",")]:
        # torch_fused: torch._fused_adamw_ itself; on a CPU (the smoke run) fzero's torch reference stands in for
        # the Triton kernel, which runs only its interpreter there and has no speed to measure
        for impl in ("triton" if torch.device(device).type == "cuda" else "torch", "torch_fused"):
            row: dict[str, Any] = {"n": n, "impl": impl}
            if time.perf_counter() > deadline:
                row.update(status="skipped", reason="time limit")
            else:
                try:
                    got = fn(n, device=device, impl=impl, repeats=args.adamw_repeats)
                    gbps = got if isinstance(got, (int, float)) else (got.get("gbps") if isinstance(got, dict) else None)
                    row.update(status="ok", gbps=float(gbps) if gbps is not None else None, raw=_jsonable(got))
                except Exception as e:  # noqa: BLE001
                    row.update(status="OOM" if is_oom(e) else "error", error=error_text(e))
                free_memory(device)
            rows.append(row)
            print(f"  adamw {impl:6s} n={n}: {row.get('gbps') or row['status']}", file=sys.stderr, flush=True)
    ok = any(r["status"] == "ok" for r in rows)
    return {"status": "ok" if ok else "not available", "reason": None if ok else "every call failed (see rows)",
            "rows": rows}


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        return repr(x)


# -- section: offload ---------------------------------------------------------------------------------
def offload_candidates(args) -> dict[str, tuple[int, int, int]]:
    grid = SMOKE_OFFLOAD if args.smoke else OFFLOAD_GRID
    if not args.offload_sizes:
        return dict(grid)
    out = {}
    for item in args.offload_sizes.split(","):
        item = item.strip()
        if item in grid:
            out[item] = grid[item]
        else:
            parts = [int(x) for x in item.lower().split("x")]
            layers, width = parts[:2]
            out[item] = (layers, width, parts[2] if len(parts) > 2 else max(1, width // 128))
    return out


def activation_bytes(cfg: GPTConfig, batch: int) -> float:
    """A rough device estimate with remat on every block: the blocks' inputs, one block's full activations,
    the logits and their fp32 copies and gradients, and 1.5 GiB for the CUDA context and workspaces."""
    tokens = batch * cfg.seq_len
    return (2 * cfg.n_layer * tokens * cfg.d_model + 40 * tokens * cfg.d_model + 14 * tokens * cfg.vocab_size
            + 1.5 * GiB)


def predict(cfg: GPTConfig, mode: str, args, device: torch.device) -> dict[str, Any]:
    import fzero

    model = meta_gpt(cfg)
    psi = num_params(model)
    est = fzero.estimate_memory(model, stages=3, world_size=1, offload=mode, precision="bf16",
                                offload_params=args.offload_params)
    dev = est.device.total + activation_bytes(cfg, args.offload_batch)
    host = est.host.total + 4 * GiB  # libraries, CUDA context and pinned staging on the host
    disk = est.disk.total
    budgets = {"host": 0.92 * (meminfo("MemAvailable") or 0)}
    if device.type == "cuda":
        budgets["device"] = 0.92 * torch.cuda.get_device_properties(device).total_memory
        need = {"device": dev, "host": host}
    else:  # everything in one memory
        need = {"host": dev + host}
    if disk:
        budgets["disk"] = 0.9 * shutil.disk_usage(args.offload_dir).free
        need["disk"] = disk
    return {"params": psi, "need_bytes": need, "budget_bytes": budgets,
            "fits": all(need[k] <= budgets[k] for k in need)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_worker(spec: dict, timeout: float) -> dict[str, Any]:
    """One offload candidate in a fresh process (its own peak RSS; a crash or a kill ends only it)."""
    with tempfile.TemporaryDirectory(prefix="fzero-gpu-w-") as tmp:
        out = os.path.join(tmp, "row.json")
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        if spec["device"] == "cpu":
            env.setdefault("DS_ACCELERATOR", "cpu")
        cmd = [sys.executable, os.path.abspath(__file__), "--offload-worker", json.dumps(spec), "--json-out", out]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=max(1.0, timeout))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            import signal

            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            output, rc = proc.communicate()[0], "timeout"
        wall = time.perf_counter() - t0
        row = {"status": "running"}
        if os.path.exists(out):  # the worker writes its row after init and after every step
            with open(out) as f:
                row = json.load(f)
        if row["status"] == "running":  # it did not finish: what it measured so far stays in the row
            row["status"] = ("time limit" if rc == "timeout" else "killed (SIGKILL: likely the host's OOM killer)"
                             if rc == -9 else "error")
            row["error"] = "\n".join(output.strip().splitlines()[-25:])
        row.update(wall_s=wall, returncode=rc)
        return row


def offload_worker(spec: dict, json_out: str) -> None:
    """Runs in its own process: one system, one size, ``steps`` steps; writes one row."""
    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = GPTConfig(**spec["cfg"])
    row: dict[str, Any] = {"status": "running"}

    def write() -> None:  # after init and every step, so that a kill at the time limit keeps what was measured
        if device.type == "cuda":
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_rss_bytes"] = rss_bytes("VmHWM")
        _write(json_out, row)

    try:
        reset_peak_rss()
        t0 = time.perf_counter()
        if spec["system"] == "deepspeed":
            step, row["params"], row["notes"] = _deepspeed_system(cfg, spec, device)
        else:
            step, row["params"], row["notes"] = _fzero_offload_system(cfg, spec, device)
        row["init_s"] = time.perf_counter() - t0
        row["rss_after_init_bytes"] = rss_bytes("VmRSS")
        row["peak_rss_init_bytes"] = rss_bytes("VmHWM")
        write()
        batches = make_batches(2, spec["batch"], cfg.seq_len, cfg.vocab_size, device)
        times, losses = [], []
        for k in range(spec["steps"]):
            sync(device)
            t1 = time.perf_counter()
            losses.append(step(batches[k % 2]))
            sync(device)
            times.append(time.perf_counter() - t1)
            row.update(step_times_s=times, step_s=times[-1], losses=losses)
            write()
        finite = all(math.isfinite(x) for x in losses)
        row.update(status="ok" if finite else "error", **({} if finite else {"error": f"non-finite loss {losses}"}))
    except Exception as e:  # noqa: BLE001
        row.update(status="OOM" if is_oom(e) else "error", error=error_text(e),
                   traceback=traceback.format_exc()[-3000:])
    write()


def _fzero_offload_system(cfg, spec, device):
    import fzero

    model = meta_gpt(cfg)

    def loss_fn(params, batch):
        return lm_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    mode = spec["mode"]
    kw = {"offload_dir": spec["offload_dir"]} if mode == "disk" else {}
    reduce = torch.float32 if spec["reduce_dtype"] == "fp32" else torch.bfloat16
    fstep = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY), stages=3,
                          mesh=fzero.local_mesh(1), precision=fzero.Precision(compute=torch.bfloat16, reduce=reduce),
                          offload=mode, offload_params=spec["offload_params"], remat=True, **kw)
    params = fzero.params_of(model, copy=False)  # meta tensors: shapes only
    # Where the state of a meta-device model goes is being settled by fzero's CUDA work (issue 14): an init told
    # where (device=), or the device of the values materialize returns; fzero today takes CPU values only.
    if "device" in inspect.signature(fstep.init).parameters:
        state = fstep.init(params, materialize=model.init_value, device=device)
    else:
        try:
            state = fstep.init(params, materialize=lambda path, meta: model.init_value(path, meta).to(device))
        except ValueError as e:
            if device.type == "cpu" or "materialize" not in str(e):
                raise
            state = fstep.init(params, materialize=model.init_value)  # then checked below
    _check_state_device(state, device, spec)
    box = {"state": state}
    del state

    def step(batch):
        box["state"], metrics = fstep(box["state"], batch)
        return metrics["loss"]

    notes = (f"fzero.compile(stages=3, local_mesh(1), Precision(bf16, reduce {spec['reduce_dtype']}), offload={mode!r}"
             f"{', offload_params=True' if spec['offload_params'] else ''}, remat=True), streaming init from meta")
    return step, num_params(model), notes


def _check_state_device(state, device, spec) -> None:
    """The compute params must be on ``device`` (with offload_params, the shards live on the host by design)."""
    if spec["offload_params"] or device.type == "cpu":
        return
    rank_state = state[0] if hasattr(state, "__getitem__") and not hasattr(state, "params") else state
    tensors = [t for t in rank_state.params.values() if isinstance(t, torch.Tensor)]
    wrong = sorted({str(t.device) for t in tensors if t.device.type != device.type})
    if wrong:
        raise RuntimeError(f"fzero's streaming init put the param shards on {wrong}, not {device}: this benchmark "
                           f"needs fzero's CUDA core (issue 14, item 1)")


class _DeferredInitGPT(GPT):
    """GPT without its own re-initialisation at the end of ``__init__``: under ``deepspeed.zero.Init`` the params
    are partitioned as each module is built, so the values are set afterwards, one gathered parameter at a time."""

    def reset_parameters(self) -> None:
        pass


def _deepspeed_system(cfg, spec, device):
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": device.type == "cuda"}}
    if spec["offload_params"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    config = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": WEIGHT_DECAY}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = _DeferredInitGPT(cfg)
    for name, p in model.named_parameters():  # GPT.init_value, the values fzero's streaming init makes
        with deepspeed.zero.GatheredParameters(p, modifier_rank=0), torch.no_grad():
            p.copy_(model.init_value(name, p))
    deepspeed.zero.register_external_parameter(model, model.tok_emb.weight)  # the tied head reads it in GPT.forward
    with_remat(model)
    psi = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           dist_init_required=False)

    def step(batch):
        loss = lm_loss(engine(batch["x"]), batch["y"])
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step, psi, (f"DeepSpeed {deepspeed.__version__} ZeRO-3 {json.dumps(zero)}, bf16, DeepSpeed AdamW (its CPU Adam), "
                       f"remat per block; init_s includes DeepSpeed's JIT build of its ops on first use")


def section_offload(args, device, deadline) -> dict[str, Any]:
    own_dir = args.offload_dir is None
    if own_dir:
        args.offload_dir = tempfile.mkdtemp(prefix="fzero-gpu-offload-")
    os.makedirs(args.offload_dir, exist_ok=True)
    cands = offload_candidates(args)
    rows, largest = [], {}
    spec0 = {"device": str(device), "batch": args.offload_batch, "steps": args.offload_steps,
             "offload_params": args.offload_params, "reduce_dtype": args.reduce_dtype, "offload_dir": args.offload_dir}
    try:
        for mode in [m.strip() for m in args.offload_modes.split(",") if m.strip()]:
            preds = {}
            for name, shape in cands.items():
                cfg = gpt_config(shape, args)
                try:
                    preds[name] = predict(cfg, mode, args, device)
                except Exception as e:  # noqa: BLE001
                    preds[name] = {"params": num_params(meta_gpt(cfg)), "fits": True, "error": f"{type(e).__name__}: {e}"}
            order = sorted(cands, key=lambda n: preds[n]["params"], reverse=True)
            fitting = [n for n in order if preds[n]["fits"]]
            if args.offload_try_above and fitting and order.index(fitting[0]) > 0:
                fitting.insert(0, order[order.index(fitting[0]) - 1])
            for n in order:
                if n not in fitting:
                    rows.append(_offload_row(mode, n, cands[n], preds[n], {"status": "not run: predicted not to fit"}))
            for n in fitting:
                left = deadline - time.perf_counter()
                if left < 5:
                    rows.append(_offload_row(mode, n, cands[n], preds[n], {"status": "skipped", "reason": "time limit"}))
                    continue
                where = os.path.join(args.offload_dir, f"{mode}-{n}")  # this run's files only, removed after it
                spec = dict(spec0, system="fzero", mode=mode, offload_dir=where, cfg=_cfg_dict(gpt_config(cands[n], args)))
                os.makedirs(where, exist_ok=True)
                try:
                    got = launch_worker(spec, left)
                finally:
                    shutil.rmtree(where, ignore_errors=True)
                rows.append(_offload_row(mode, n, cands[n], preds[n], got))
                _print_offload(rows[-1])
                if got["status"] == "ok":
                    largest[mode] = rows[-1]
                    break
                if got["status"] == "time limit":  # smaller candidates would not get a fair run either
                    if got.get("step_times_s"):  # it did train, for fewer steps than asked
                        largest[mode] = rows[-1]
                    break
        rows += _deepspeed_rows(args, device, deadline, largest, cands, spec0)
    finally:
        if own_dir:
            shutil.rmtree(args.offload_dir, ignore_errors=True)
    summary = {m: {"size": r["size"], "params": r["params"], "step_s": r.get("step_s"),
                   "steps_done": len(r.get("step_times_s", [])), "complete": r["status"] == "ok"} for m, r in largest.items()}
    return {"rows": rows, "largest": summary, "offload_dir": args.offload_dir}


def _deepspeed_rows(args, device, deadline, largest, cands, spec0) -> list[dict]:
    base = {"mode": "cpu", "system": "deepspeed"}
    if args.deepspeed == "off" or (args.deepspeed == "auto" and args.smoke):
        return [dict(base, status="skipped", reason="--deepspeed off" if args.deepspeed == "off" else "--smoke")]
    if importlib.util.find_spec("deepspeed") is None:
        return [dict(base, status="deepspeed not installed")]
    if "cpu" not in largest:
        return [dict(base, status="skipped", reason="fzero found no size with offload='cpu' to run it beside")]
    name = largest["cpu"]["size"]
    left = deadline - time.perf_counter()
    if left < 5:
        return [dict(base, size=name, status="skipped", reason="time limit")]
    spec = dict(spec0, system="deepspeed", mode="cpu", cfg=_cfg_dict(gpt_config(cands[name], args)))
    got = launch_worker(spec, left)
    row = _offload_row("cpu", name, cands[name], None, got)
    row["system"] = "deepspeed"
    _print_offload(row)
    return [row]


def _cfg_dict(cfg: GPTConfig) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in ("n_layer", "d_model", "n_head", "seq_len", "vocab_size", "bias")}


def _offload_row(mode, name, shape, pred, got) -> dict[str, Any]:
    row = {"mode": mode, "system": "fzero", "size": name, "layers": shape[0], "width": shape[1], "heads": shape[2],
           "params": (pred or {}).get("params"), "predicted": pred}
    row.update(got)
    return row


def _print_offload(row) -> None:
    gpu = row.get("peak_gpu_bytes")
    print(f"  offload {row['mode']:4s} {row['system']:9s} {row['size']:6s} {row['status']}: step "
          f"{row.get('step_s', float('nan')):.2f} s, peak GPU {gpu / GiB if gpu else float('nan'):.1f} GiB, "
          f"peak RSS {(row.get('peak_rss_bytes') or 0) / GiB:.1f} GiB, wall {row.get('wall_s', 0):.0f} s",
          file=sys.stderr, flush=True)


# -- tables -------------------------------------------------------------------------------------------
def _fmt(x, spec=".3g", scale=1.0, none="", unit="") -> str:
    return none if x is None else format(x / scale, spec) + unit


def print_tables(out: dict[str, Any]) -> None:
    env, st = out["env"], out["settings"]
    print(f"\n{env['device_name']} ({env['device']}), torch {env['torch']}, triton {env['triton']}, "
          f"fzero {str(env['git_commit'])[:10]} ({env['git_dirty_files']} files modified); MFU peak: {st['peak_source']}\n")
    if "models" in out:
        print(f"GPT-2 shapes, seq {st['seq']}, vocab {st['vocab']}, remat {st['remat']}, reduce {st['reduce_dtype']}; "
              f"median of {st['steps']} timed steps x rounds after {st['warmup']} warm-up steps per round\n")
        print("| size | params | batch | system | tokens/s | MFU | MFU +attn | ms/step | vs FSDP2 | peak mem GiB | status |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in out["models"]["rows"]:
            print(f"| {r['size']} | {_fmt(r.get('params'), '.1f', 1e6, unit='M')} | {r.get('batch', '')} | {r['system']} | "
                  f"{_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('mfu'), '.1%')} | {_fmt(r.get('mfu_attn'), '.1%')} | "
                  f"{_fmt(r.get('step_s'), '.1f', 1e-3)} | {_fmt(r.get('speed_vs_fsdp2'), '.2f')} | "
                  f"{_fmt(r.get('peak_mem_bytes'), '.2f', GiB)} | {r['status']} |")
        print()
    if "adamw" in out:
        a = out["adamw"]
        if not a["rows"]:
            print(f"AdamW (Triton vs torch._fused_adamw_): {a['status']}: {a['reason']}\n")
        else:
            by = {(r["n"], r["impl"]): r for r in a["rows"]}
            print("| AdamW elements | Triton GB/s | torch._fused_adamw_ GB/s | Triton / torch |")
            print("|---|---|---|---|")
            for n in dict.fromkeys(r["n"] for r in a["rows"]):
                t, f = by.get((n, "triton"), by.get((n, "torch"), {})), by.get((n, "torch_fused"), {})
                ratio = t["gbps"] / f["gbps"] if t.get("gbps") and f.get("gbps") else None
                print(f"| {n:,} | {_fmt(t.get('gbps'), '.0f', none=t.get('status', ''))} | "
                      f"{_fmt(f.get('gbps'), '.0f', none=f.get('status', ''))} | {_fmt(ratio, '.2f')} |")
            print()
    if "offload" in out:
        print("| offload | system | size (layers x width) | params | step s | peak GPU GiB | peak host RSS GiB | init s | status |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in out["offload"]["rows"]:
            shape = f"{r['size']} ({r['layers']} x {r['width']})" if "layers" in r else r.get("size", "")
            print(f"| {r['mode']} | {r['system']} | {shape} | {_fmt(r.get('params'), '.2f', 1e9, unit='B')} | "
                  f"{_fmt(r.get('step_s'), '.2f')} | {_fmt(r.get('peak_gpu_bytes'), '.1f', GiB)} | "
                  f"{_fmt(r.get('peak_rss_bytes'), '.1f', GiB)} | {_fmt(r.get('init_s'), '.0f')} | "
                  f"{r['status']}{': ' + r['reason'] if r.get('reason') else ''} |")
        print(f"\nlargest that trains: {json.dumps(out['offload']['largest'])}\n")


# -- main ---------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.offload_worker:
        offload_worker(json.loads(args.offload_worker), args.json_out)
        return
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/gpu.py: --device cuda but torch.cuda.is_available() is False; "
                             "pass --device cpu (with --smoke for the quick check).")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    env = environment(device)
    flops, source = peak_flops(args, env)
    settings = {k: v for k, v in vars(args).items() if k not in ("offload_worker", "size_shapes", "batch_of", "limits")}
    settings.update(sizes={k: list(v) for k, v in args.size_shapes.items()}, batch_of=args.batch_of,
                    time_limits=args.limits, peak_flops=flops, peak_source=source)
    out: dict[str, Any] = {"schema": "fzero-benchmarks-gpu/1", "env": env, "settings": settings}
    t_all = time.perf_counter()
    for section in args.sections:
        t0 = time.perf_counter()
        deadline = t0 + args.limits[section]
        print(f"{section}: time limit {args.limits[section]:.0f} s", file=sys.stderr, flush=True)
        if section == "models":
            out["models"] = section_models(args, device, flops, deadline)
        elif section == "adamw":
            out["adamw"] = section_adamw(args, device, deadline)
        else:
            out["offload"] = section_offload(args, device, deadline)
        out[section]["elapsed_s"] = time.perf_counter() - t0
        if args.json_out:  # after every section, so a later crash or kill keeps what was measured
            _write(args.json_out, out)
    out["elapsed_s"] = time.perf_counter() - t_all
    print_tables(out)
    if args.json_out:
        _write(args.json_out, out)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if "dir" in _PG:
        shutil.rmtree(_PG["dir"], ignore_errors=True)


def _write(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
