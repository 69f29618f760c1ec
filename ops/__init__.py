"""Kernels behind fzero, imported as ``fzero.ops``: Triton on CUDA, a torch reference everywhere.

Each op has a Triton kernel and a torch reference that does the same arithmetic in plain torch ops (the
CPU execution path: Triton runs on CPU only under its interpreter, about 100x slower). Every op
takes ``impl="auto" | "triton" | "torch"``; "auto" runs the kernel on CUDA tensors when ``import triton``
works and the reference otherwise (``fzero.ops._dispatch``). fzero works without triton installed; the
``triton`` extra installs it (``pip install 'fzero[triton]'``).

- ``adamw_`` / ``adam_``: a fused AdamW / Adam step over a flat fp32 shard (fp32 master, moments), with the
  gradient unscaled, an optional bf16/fp16 param copy-out and a non-finite flag, in one pass
  (``fzero.ops._adam``: the order of operations, and how it matches ``torch._fused_adamw_``).
- ``grad_sumsq``: each unit's sum of squared gradients and a non-finite flag, in one pass (``_norm``).
- ``scale_cast``: ``(grad * scale).to(dtype)`` in one pass (``_cast``).
- ``sparse_attention``: block-sparse attention over DeepSpeed's layouts (``FixedLayout``, ``BigBirdLayout``, ...):
  FlexAttention on CUDA, a block-sparse torch reference elsewhere (``_sparse``).
- ``fzero.ops.bench.adamw_gbps``: GB/s of one fused AdamW step, this kernel or torch's.

For an fp16 step that skips on overflow without a host sync::

    sumsq, flag = fzero.ops.grad_sumsq(unit_grads)          # one read of the gradients (sum over ranks here)
    norm = sumsq.sum().sqrt() / loss_scale
    inv = ((max_norm / (norm + 1e-6)).clamp(max=1.0) / loss_scale).reshape(1)  # clip and unscale, on the device
    fzero.ops.adamw_(master, grad, m, v, step=t, lr=lr, inv_scale=inv, found_inf=flag, param_out=fp16_params)
"""

from ._adam import adam_, adamw_
from ._cast import scale_cast
from ._dispatch import IMPLS, triton_available
from ._norm import SumSq, grad_sumsq
from ._sparse import BigBirdLayout, BSLongformerLayout, DenseLayout, FixedLayout, VariableLayout, sparse_attention, token_mask

__all__ = ["IMPLS", "BSLongformerLayout", "BigBirdLayout", "DenseLayout", "FixedLayout", "SumSq", "VariableLayout", "adam_",
           "adamw_", "grad_sumsq", "scale_cast", "sparse_attention", "token_mask", "triton_available"]
