"""``Settings``: what ``fzero.config.from_deepspeed`` returns, and the ``fzero.compile`` keywords it maps to."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from fzero.config._values import dtype_name
from fzero.step import DynamicLossScale, Precision, StaticLossScale
from fzero import _rules


@dataclasses.dataclass(frozen=True)
class Settings:
    """fzero settings read from a DeepSpeed config. ``print(settings)`` shows them with their sources.

    ``compile_kwargs()`` gives the keyword arguments of ``fzero.compile`` (without ``mesh``), with the micro batch
    (``micro_batch_size``), so that a step refuses batches of other rows than the config's; the fields not in it
    (``train_batch_size``, ``steps_per_print``, ``wall_clock_breakdown``) are for the training loop.
    """

    source: str  # the file, or "dict"
    stages: int = 0
    optimizer: Any = dataclasses.field(default=None, repr=False)  # fzero.optim GradientTransformation, or None
    optimizer_description: str | None = None
    learning_rate: Any = dataclasses.field(default=None, repr=False)  # float or schedule the optimizer scales by
    precision: Precision = Precision()
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    offload: str | None = None  # "cpu" or "nvme"
    offload_params: bool = False
    offload_dir: str | None = None
    sub_group_size: int | None = None  # None: fzero's default
    world_size: int | None = None
    micro_batch_size: int | None = None  # per rank, per micro-batch: DeepSpeed's train_micro_batch_size_per_gpu
    train_batch_size: int | None = None  # per optimizer step, all ranks: micro_batch_size * grad_accum * world_size
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    unit_elements: int | None = None  # hint for stages 0-1: elements per flat bucket (from the bucket sizes)
    prefetch: bool | None = None  # hint for stage 3: gather the next unit ahead (from prefetch size / overlap_comm)
    curriculum: Any = None  # fzero.data.Curriculum from "curriculum_learning", for the loop: curriculum.apply(batch, step)
    progressive_layer_drop: Any = None  # fzero.models.ProgressiveLayerDrop from "progressive_layer_drop", for the model
    sparse_attention: Any = None  # a layout of fzero.ops from "sparse_attention", for the model's attention
    notes: tuple[str, ...] = ()  # keys accepted with no effect here, and why; DeepSpeed defaults applied
    resolved: tuple[tuple[str, Any, str], ...] = ()  # ("optimizer.params.lr", 3e-4, "learning_rate=") for each "auto"
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # the config, "auto" resolved

    def replace(self, **changes: Any) -> "Settings":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @property
    def batch_per_rank(self) -> int | None:
        """Samples one rank passes to one ``step(state, batch)`` call: ``micro_batch_size * grad_accum``."""
        return None if self.micro_batch_size is None else self.micro_batch_size * self.grad_accum

    def compile_kwargs(self, stages: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``fzero.compile`` at ``stages`` (default: the config's). What is stage-bound goes
        only where it applies: ``unit_elements`` at stages 0-1, ``prefetch`` and ``offload_params`` at stage 3."""
        stages = self.stages if stages is None else stages
        out: dict[str, Any] = {"stages": stages, "precision": self.precision, "grad_accum": self.grad_accum,
                               "clip_grad_norm": self.clip_grad_norm}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        if self.offload is not None:  # param shards exist at stage 3 only: below it, only the optimizer is offloaded
            out.update(offload=self.offload, offload_params=self.offload_params and _rules.accepts("offload_params", stages))
            if self.offload_dir is not None:
                out["offload_dir"] = self.offload_dir
            if self.sub_group_size is not None:
                out["sub_group_size"] = self.sub_group_size
        if self.unit_elements is not None and _rules.accepts("unit_elements", stages):
            out["unit_elements"] = self.unit_elements
        if self.prefetch is not None and _rules.accepts("prefetch", stages):
            out["prefetch"] = self.prefetch
        if self.micro_batch_size is not None:  # each step call then checks its rows against the config's batch sizes
            out["micro_batch_size"] = self.micro_batch_size
        return out

    def __str__(self) -> str:
        p = self.precision
        prec = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[p.compute]
        if p.compute != torch.float32:
            prec += f" (fp32 master weights: {p.has_master}; gradients summed in {dtype_name(p.reduce_dtype)}"
            ls = p.loss_scale
            if isinstance(ls, DynamicLossScale):
                prec += (f"; dynamic loss scale from {ls.initial:g}, window {ls.window}, hysteresis {ls.hysteresis}, "
                         f"min {ls.min_scale:g}")
            elif isinstance(ls, StaticLossScale):
                prec += f"; static loss scale {ls.scale:g}"
            prec += ")"
        rows = [
            ("stages", f"{self.stages}"),
            ("optimizer", self.optimizer_description or "none in the config (fzero.compile's optimizer= or its default)"),
            ("precision", prec),
            ("grad_accum", f"{self.grad_accum}"),
            ("clip_grad_norm", f"{self.clip_grad_norm}"),
        ]
        if self.offload is not None:
            where = self.offload + (f" in {self.offload_dir}" if self.offload_dir else "")
            rows.append(("offload", f"{where}; params too: {self.offload_params}; sub_group_size: "
                                    f"{self.sub_group_size or 'fzero default'}"))
        else:
            rows.append(("offload", "none"))
        if self.micro_batch_size is not None:
            world = "?" if self.world_size is None else self.world_size
            total = "" if self.train_batch_size is None else f"train_batch_size {self.train_batch_size} = "
            rows.append(("batch", f"{total}{self.micro_batch_size} per rank x {self.grad_accum} micro-batches x "
                                  f"{world} ranks; pass {self.batch_per_rank} samples per rank to each step call"))
        hints = [f"unit_elements={self.unit_elements} (stages 0-1)"] if self.unit_elements is not None else []
        hints += [f"prefetch={self.prefetch} (stage 3)"] if self.prefetch is not None else []
        rows.append(("hints", ", ".join(hints) or "none"))
        if self.curriculum is not None:
            c = self.curriculum
            rows.append(("curriculum", f"seqlen {c.min_difficulty}..{c.max_difficulty}, {c.schedule_type} (the loop's to "
                                       f"apply: settings.curriculum.apply(batch, state.step_count))"))
        if self.progressive_layer_drop is not None:
            d = self.progressive_layer_drop
            rows.append(("progressive_layer_drop", f"theta {d.theta:g}, gamma {d.gamma:g} (the model's to take: "
                                                   f"layers(state.step_count, n_layers) passed to its forward)"))
        if self.sparse_attention is not None:
            rows.append(("sparse_attention", f"{self.sparse_attention!r} (the model's to take: e.g. "
                                             f"GPTConfig(sparse_attention=...), or fzero.ops.sparse_attention in its attention)"))
        rows.append(("steps_per_print", f"{self.steps_per_print} (the loop's to honour: a step returns its metrics)"))
        rows.append(("wall_clock_breakdown", f"{self.wall_clock_breakdown} (the loop's to time: fzero keeps no timers)"))
        lines = [f"fzero settings from the DeepSpeed config {self.source}"]
        lines += [f"  {k:21s} {v}" for k, v in rows]
        if self.resolved:
            lines.append('  "auto" resolved:')
            lines += [f"    {path} = {value!r}  ({how})" for path, value, how in self.resolved]
        if self.notes:
            lines.append("  notes:")
            lines += [f"    {n}" for n in self.notes]
        return "\n".join(lines)
