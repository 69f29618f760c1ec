"""What a step says when ``loss_fn`` or the backward of its loss fails: the message for a plain error ``loss_fn``
raised on a batch (``loss_fn_failure``: the original first, then the batch, then a hint), and the causes and fixes that
fzero adds to torch's own errors where it can name them (a unit's params read outside its call, a param written in
place at stages 2-3, a module attribute read after ``fzero.apply``, torch.func's refusals, a second backward, a
unit's freed buffer read in the backward).

Kept apart from ``fzero.step._batch``, whose functions run at every step: these are built only when something has
failed. The context managers that catch torch's errors around the backward run at every step, and stay there.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from fzero.layout import pytrees as _tree


_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


# torch's messages for operands of two dtypes ("mat1 and mat2 must have the same dtype, but got Double and Float",
# "expected scalar type Float but found Double", "Input type (double) and bias type (float) should be the same")
_DTYPES = re.compile(r"same dtype|expected scalar type|found dtype|type \(\w+\) and \w+ type \(\w+\) should be the same")
DTYPE_MISMATCH = (
    "  Two dtypes met in one op. The state's params keep the dtype step.init made them in (the precision policy's "
    "compute dtype, else the params' own); the batch and the module's own tensors (frozen params, buffers) meet them "
    "there. A module cast after step.init (model.half(), model.double(), model.to(dtype)) does not change the state, "
    "so its params are still the old dtype: make a state from the cast model (step.init(fzero.params_of(model))), or "
    "leave the model as it was and train in low precision with compile(precision='bf16' or 'fp16').")
# torch's messages for operands on two devices ("Expected all tensors to be on the same device, but got mat1 is on
# cuda:0, different from other tensors on cpu", "Tensor on device cpu is not on the expected device cuda:0!")
_DEVICES = re.compile(r"same device|is not on the expected device|found at least two devices")
DEVICE_MISMATCH = (
    "  Two devices met in one op. The step computes where the state's params are{params}: where the params given to "
    "step.init were (so move the model first: model.to(device), then fzero.params_of(model) and step.init), or where "
    "fzero.checkpoint.load put them (like=step: the device the checkpoint's run computed on; like=step.init(params): "
    "those params'). The batch{batch} and the module's own tensors (frozen params, buffers) must be on that device "
    "too: pass batches there ({{k: v.to(device) for k, v in batch.items()}})."
)
_META = re.compile(r"\bmeta\b")  # "Tensor on device meta is not on the expected device", "... meta tensor(s)"
UNIT_OUTSIDE_ITS_CALL = (
    "  A meta tensor (a shape without a value) was used. At stages 2-3 a unit's params are meta tensors except while "
    "the unit itself is called (fzero.units_of(model) lists the units), so a module inside a unit that runs without "
    "its unit's own call reads them: a forward that calls a unit's submodule directly (self.blocks[0][0](x) where "
    "the unit is 'blocks.0'), an autograd Function that calls a unit's layers again in its backward (reversible "
    "layers), or a method fzero.apply runs that reads params outside their unit's call (self.parameters() for an L2 "
    "term, self.blocks[0][0].weight). Choose units the model calls as a whole (units=fzero.units_of(model, "
    "module_types=...)), leave that module in the root unit (units=... without it), compute such a term from the "
    "params loss_fn was given, or train at stage 1."
)


# what a forward that writes a param in place does instead (the step's refusal, ``fzero.step._step``, and the hint below)
PARAM_WRITE_FIX = (
    "Train without the in-place write (nn.Embedding(max_norm=None), and renormalize in the loss or on the params "
    "between steps), or on one rank at stage 0 or 1 with fp32 params and no offload, where it lands in the train state "
    "itself."
)
# a forward that wrote a trainable param through ``.data``: the step's refusals (``fzero.step._context.call_module``,
# stage 3's ``fzero.zero._unit``), which name the param or unit and how
DATA_WRITE = (
    "fzero.apply: the forward {how} (shape {shape}) through .data, which goes around autograd and fzero's watch of the "
    "params: fzero trains the train state's tensor, and what the forward was handed as that param {where}, so the "
    "write would be used by this forward alone and never reach the state or the optimizer, silently, where PyTorch's "
    "param keeps it. Compute with the changed value instead (w = self.weight.clamp(-c, c), read where the weight is "
    "used), or write the param itself in place under torch.no_grad() (p.clamp_(-c, c)), which fzero keeps on one rank "
    "at stage 0 or 1 with fp32 params and no offload and refuses by name elsewhere; for a change between steps (WGAN's "
    "weight clipping, a re-init), see docs/migrating.md, \"The module after step.init\"."
)


PARAM_WRITTEN_AT_STAGE_2_3 = (
    "  The view written is most likely a param: at stages 2-3 a unit's params are views that fzero's Functions make "
    "for the unit's call, and the forward wrote one in place (nn.Embedding(max_norm=...) renormalizes the rows it looks "
    "up in place; so does a model that edits a weight under torch.no_grad()). Cloning is not the fix here: the write "
    "would go to the unit's buffer, which is dropped after the call, so the train state would never see it. "
    + PARAM_WRITE_FIX
)

# how torch names the views a unit's params are when one is written in place: made by fzero's Functions (a unit the
# model calls), or by the split of the root unit's buffer, "a function that returns multiple views" (an
# nn.Embedding(max_norm=...) outside the blocks; before, torch's message alone)
_UNIT_VIEWS = ("created inside a custom Function", "returns multiple views")


# an attribute read from the user's module in loss_fn, which a forward sets on self (an auxiliary loss kept on the module)
MODULE_ATTRIBUTE_IN_A_STEP = (
    "  If the forward sets {cls}.{name} (an auxiliary loss kept on the module, as MoE layers keep theirs) and loss_fn "
    "reads it after fzero.apply: within a step fzero.apply runs fzero's copy of the module, and what its forward writes "
    "on self reaches your module only when the step returns. So loss_fn reads your module's value from before the step "
    "(none here; a value set in __init__ or by an earlier step is read silently, without a gradient). Return it from "
    "forward (return out, self.{name}), or call through a method that returns it: fzero.apply(model.method, params, "
    "x) runs `method` on the module holding the params, so `self` there is the copy the forward wrote."
)


def loss_fn_failure(error: BaseException, batch: Any, *, split: bool = False, units: bool = False, params: Any = None) -> str:
    """The message for ``error`` raised by ``loss_fn(params, batch)``: the original first, then the batch, then a hint.
    ``units``: the step runs units (stages 2-3), where a meta tensor in the error has a cause fzero can name.
    ``params``: what loss_fn was given, whose devices a device mismatch names (stages 0-1: the state's own tensors;
    stages 2-3: stand-ins, not named)."""
    original = repr(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    which = "this rank's share of the batch" if split else "the batch"
    lines = [f"fzero.Step: loss_fn(params, batch) raised {type(error).__name__}: {original}",
             f"  on {which}: {describe_batch(batch)}."]
    if batch is None:
        lines.append("  The batch is None: step(state, batch) hands it to loss_fn as it is; pass the batch loss_fn reads "
                     "(e.g. a dict of tensors from your loader).")
    match = _MATMUL.search(str(error))
    if match is not None:
        got, want = int(match.group(2)), int(match.group(3))
        leaves = [f"{(p or '<root>')!r} has shape {tuple(x.shape)}" for p, x in _tensor_leaves(batch) if x.dim() and x.shape[-1] == got]
        lines.append(f"  A matmul of the model (an nn.Linear?) expects {want} features in the last dim and got {got}"
                     + (f": batch leaf {', '.join(leaves[:3])}." if leaves else ".") + " Pass inputs of the size the model was built for.")
    elif isinstance(error, KeyError) and isinstance(batch, dict):
        lines.append(f"  The batch has keys {sorted(map(str, batch))[:8]}.")
    elif _DTYPES.search(str(error)):
        lines.append(DTYPE_MISMATCH)
    elif _META.search(str(error)) and any(x.is_meta for _, x in _tensor_leaves(batch)):
        lines.append("  The batch holds meta tensors (shapes without values): pass a batch with values, on the device "
                     "the model runs on.")
    elif _DEVICES.search(str(error)) and not _META.search(str(error)):  # a meta tensor's has its own causes (below)
        lines.append(DEVICE_MISMATCH.format(params=_devices_of(params, " ({})"), batch=_devices_of(batch, " (on {})")))
    elif units and _META.search(str(error)):
        lines.append(UNIT_OUTSIDE_ITS_CALL)
    elif units and "modified inplace" in str(error) and any(how in str(error) for how in _UNIT_VIEWS):
        lines.append(PARAM_WRITTEN_AT_STAGE_2_3)
    elif (isinstance(error, AttributeError) and isinstance(getattr(error, "obj", None), nn.Module)
          and isinstance(missing := getattr(error, "name", None), str) and not missing.startswith("_")):
        lines.append(MODULE_ATTRIBUTE_IN_A_STEP.format(cls=type(getattr(error, "obj")).__name__, name=missing))
    lines.append("  The error is in loss_fn or the model it runs; its own traceback is the cause above.")
    if isinstance(error, KeyError):  # KeyError shows its message as a repr: one line reads better
        return " ".join(line.strip() for line in lines)
    return "\n".join(lines)


def _devices_of(tree: Any, form: str) -> str:
    """``form`` with the devices of ``tree``'s tensors that hold values (meta stand-ins are not where anything runs);
    empty when there are none."""
    found = sorted({str(x.device) for _, x in _tensor_leaves(tree) if not x.is_meta})
    return form.format(" and ".join(found)) if found else ""


def _tensor_leaves(batch: Any) -> list[tuple[str, torch.Tensor]]:
    if batch is None:
        return []
    paths, leaves, _ = _tree.flatten_with_paths(batch)
    return [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]


def describe_batch(batch: Any, *, limit: int = 8) -> str:
    """``{x: float32 (8, 5), y: float32 (8, 2)}``: each leaf's path with its dtype and shape (or its type)."""
    if batch is None:
        return "None"
    try:
        paths, leaves, _ = _tree.flatten_with_paths(batch)
    except Exception:  # noqa: BLE001 - a batch optree cannot flatten is described by its type
        return f"a {type(batch).__name__}"
    parts = [f"{p or '<root>'}: " + (f"{str(x.dtype).replace('torch.', '')} {tuple(x.shape)}"
                                     + (f" on {x.device}" if x.device.type != "cpu" else "") if isinstance(x, torch.Tensor)
                                     else type(x).__name__) for p, x in zip(paths, leaves)]
    more = f", ... {len(parts) - limit} more" if len(parts) > limit else ""
    return "{" + ", ".join(parts[:limit]) + more + "}" if parts else f"a {type(batch).__name__} without tensors"


# What torch.func.grad says when the model does what only plain autograd supports: torch.utils.checkpoint's
# saved-tensor hooks, requires_grad_() inside the transform (Hugging Face's enable_input_require_grads hook).
_FUNC_REFUSALS = ("functorch transform", "saved tensor hooks", "saved_tensors_hooks", "torch.func transforms don't yet support",
                  "mutate a captured Tensor", "escaped?")
_FUNC_HINT = """fzero.Step (autodiff="func"): torch.func.grad refused what the model does in its forward: {error}
{cause} Build the step with plain autograd, which
supports it: fzero.compile(..., autodiff="autograd"){alternative}."""
_CHECKPOINT_CAUSE = """This is what a model with torch.utils.checkpoint inside it does (Hugging Face's gradient_checkpointing_enable() /
activation_checkpointing_enable(), or requires_grad_() on an activation), and a tensor made a leaf inside loss_fn
for torch.autograd.grad(..., create_graph=True) (a gradient penalty, WGAN-GP, R1)."""
_CHECKPOINT_ALTERNATIVE = """; or turn the model's checkpointing off and recompute with
fzero's own (compile(..., remat=True) per unit at every stage, or fzero.remat around any function)"""
_OLD_FUNCTION_CAUSE = """This is what a custom torch.autograd.Function written in the old style does (a static forward(ctx, ...)
with no setup_context staticmethod), as straight-through estimators, gradient reversal layers and fused kernels
in research code are written."""
_OLD_FUNCTION_ALTERNATIVE = """; or give the Function a setup_context staticmethod (forward without
ctx; https://pytorch.org/docs/stable/notes/extending.func.html)"""


_CAPTURED_CAUSE = """loss_fn or the model wrote in place into a tensor made outside the transform: a tensor of the batch
(CutMix pasting a patch into batch["img"]), a frozen param or a tensor the module holds (a momentum update of a
key encoder's params in forward). torch.func refuses writes into the tensors it captured."""
_CAPTURED_ALTERNATIVE = """; or write into a copy (x = batch["img"].clone()), or keep what
the forward updates in a registered buffer (the step hands buffers to the transform as its own)"""
_DISTRIBUTIONS_CAUSE = """Here the Function is torch's own: torch.distributions' Beta and Dirichlet draw through one (_Dirichlet, in
sample() too), as a Mixup or CutMix lambda drawn in loss_fn does."""
_DISTRIBUTIONS_ALTERNATIVE = """; or draw the lambda without it (np.random.beta(a, a), drawn
per rank as under torchrun; or from two Gamma draws, g1 / (g1 + g2))"""


_ESCAPED_CAUSE = """A tensor made inside the transform was kept and used where the transform cannot follow it: a param's or a
module tensor's .data assigned in forward from the params the step gives (a momentum update of a key encoder:
pk.data = pk.data * m + pq.data * (1 - m)), or a tensor kept on a module or in a global by one call and read by the
next. torch.func reports it as its own internal error ("escaped?"). Where it was a param's .data, the param now holds
that tensor, which the process cannot read any more (reading it crashes): build the model again before going on."""


def _traceback_files(error: BaseException) -> str:
    """The files of ``error``'s traceback and its causes' (``loss_fn_failure`` re-raises torch's error from it), for
    ``_func_refusal`` to tell torch's own old-style Functions from the user's."""
    import traceback

    files, seen = [], set()
    err: BaseException | None = error
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        files += [frame.filename for frame in traceback.extract_tb(err.__traceback__)]
        err = err.__cause__ or err.__context__
    return " ".join(files)


def _func_refusal(error: str, *, frames: str = "") -> str:
    """The message for torch.func.grad's refusal ``error`` (its first line): the model code that usually causes it,
    read from torch's words (only the cause differs), and the step setting that runs it. ``frames``: the files of the
    failure's traceback, which tell torch's own old-style Functions (torch.distributions) from the user's."""
    if "setup_context" in error and "torch/distributions/" in frames.replace("\\", "/"):
        cause, alternative = _OLD_FUNCTION_CAUSE + "\n" + _DISTRIBUTIONS_CAUSE, _DISTRIBUTIONS_ALTERNATIVE
    elif "setup_context" in error:
        cause, alternative = _OLD_FUNCTION_CAUSE, _OLD_FUNCTION_ALTERNATIVE
    elif "mutate a captured Tensor" in error:
        cause, alternative = _CAPTURED_CAUSE, _CAPTURED_ALTERNATIVE
    elif "escaped?" in error:  # torch's internal assert for a tensor of the transform's level used outside it
        cause, alternative = _ESCAPED_CAUSE, _CAPTURED_ALTERNATIVE
    else:
        cause, alternative = _CHECKPOINT_CAUSE, _CHECKPOINT_ALTERNATIVE
    return _FUNC_HINT.format(error=error, cause=cause, alternative=alternative)


_BACKWARD_IN_LOSS_FN = """fzero.Step: loss_fn (or the model) ran a backward over the loss already, as `loss.backward()` at the end of a
plain PyTorch training step does. fzero takes the gradient of what loss_fn returns and applies the update itself:
return the loss (or (loss, aux)) without calling backward(), zero_grad() or an optimizer. A gradient loss_fn needs
for itself (an input's gradient for an adversarial example) is taken with torch.autograd.grad(inner_loss, x) on a
forward of its own, or with retain_graph=True where it shares the loss's graph (plain autograd, the default).
(torch: {error})"""
_SECOND_BACKWARD = _BACKWARD_IN_LOSS_FN.replace("fzero.Step: loss_fn", "fzero.Step: the graph of the loss loss_fn "
                                                "returned was freed before the step's backward: loss_fn", 1)


_FREED = re.compile(r"out of bounds for storage of size 0")  # torch's setStorage error on a view of freed memory
UNIT_FREED = """  At stage 3 a unit's gathered params are freed after its forward and gathered again when the gradient reaches
the unit's return value. Here a tensor made inside a unit reached the loss another way while that return value
reached nothing in it{how}, so the backward read the freed params. Let the unit return that tensor (or use
what it returns), keep that module out of the units (units=... without it), or train at stage 2."""
_FREED_HOW = {
    "autograd": (" (a tensor stored on a module; what a forward hook or pre-hook on the unit or inside it keeps of its module's"
                 " output or inputs is refilled for)"),
    "func": (' (a tensor stored on a module, or kept by a forward hook, as Hugging Face\'s output capture keeps the hidden'
             ' state Llava\'s vision_feature_layer picks: under autodiff="func" no hook can gather in the backward;'
             ' autodiff="autograd" trains that as PyTorch does)'),
}
