"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning") with DeepSpeed ``FusedLamb``'s arithmetic.

Per parameter (a whole tensor, however ZeRO cuts it: see ``fzero.optim._base``), at step t::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (sqrt(v) + eps) + weight_decay * p                 # moments *not* bias-corrected here
    coeff = clip(||p|| / ||u||, min_coeff, max_coeff)           # 1 when either norm is 0
    p -= lr * sqrt(1 - b2**t) / (1 - b1**t) * coeff * u

This is DeepSpeed's CUDA kernel (``csrc/lamb/fused_lamb_cuda_kernel.cu``, default ``eps_inside_sqrt=False``,
``bias_correction=True``, ``max_grad_norm=0``): the bias correction is one factor on the step, so ``eps`` and the
decay term are scaled by it too, and the trust ratio is taken on the uncorrected update. The paper and optax's
``lamb`` bias-correct ``m`` and ``v`` inside ``u`` and don't clip the ratio; the two agree only when
``eps = weight_decay = 0``. ``||p||`` is the norm before the step.

Norms are per parameter: ``lamb`` asks ``current_segments()`` for the sums of squares, so on a ZeRO flat buffer
the train step's layout-aware ``Segments`` gives each parameter its own ratio, summed over the ranks' shards.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from fzero.optim._base import GradientTransformation, LearningRate, chain, check_float, check_learning_rate
from fzero.optim._base import active_params, current_segments, param_ranges, per_element
from fzero.optim._base import per_param_steps, skipped_after
from fzero.optim._transforms import common_device, init_skipped, scale_by_learning_rate

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ScaleByLambState(NamedTuple):
    """LAMB's moments (DeepSpeed's ``exp_avg``, ``exp_avg_sq``).

    count: float32 0-d tensor, steps taken; on the params' device when they share one, else on the CPU.
    mu: like params (same shapes, dtypes, devices): first moment.
    nu: like params: second moment.
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    skipped: Any = None  # as ScaleByAdamState's: per parameter, the steps it sat out; its own count is count - skipped


def _opmath(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW_PRECISION else t


def scale_by_lamb(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.0, *,
    max_coeff: float = 10.0, min_coeff: float = 0.01,
) -> GradientTransformation:
    """LAMB's step ``sqrt(1 - b2**t) / (1 - b1**t) * coeff * u`` (not yet scaled by -lr); see the module docstring."""
    api = "fzero.optim.scale_by_lamb"
    b1, b2, eps, weight_decay, max_coeff, min_coeff = _lamb_settings(api, b1, b2, eps, weight_decay, max_coeff, min_coeff)

    def init(params: Any) -> ScaleByLambState:
        count = torch.zeros((), dtype=torch.float32, device=common_device(params))
        zeros = lambda p: torch.zeros_like(p, memory_format=torch.contiguous_format)  # noqa: E731
        return ScaleByLambState(count, optree.tree_map(zeros, params), optree.tree_map(zeros, params), init_skipped(params))

    def update(updates: Any, state: ScaleByLambState, params: Any = None) -> tuple[Any, ScaleByLambState]:
        if params is None:
            raise ValueError(
                "fzero.optim.lamb: update needs the params (for the trust ratio ||p|| / ||update||), got params=None. "
                "Call opt.update(grads, state, params)."
            )
        count = state.count + 1
        skipped = skipped_after(api, state.skipped, active_params())
        mu = optree.tree_map(lambda m, g: (_opmath(m) * b1 + _opmath(g) * (1 - b1)).to(m.dtype), state.mu, updates)
        nu = optree.tree_map(
            lambda v, g: (_opmath(v) * b2 + _opmath(g).square() * (1 - b2)).to(v.dtype), state.nu, updates
        )
        u = optree.tree_map(
            lambda m, v, p: _opmath(m) / (_opmath(v).sqrt() + eps) + _opmath(p) * weight_decay, mu, nu, params
        )
        segments = current_segments()
        p_norm = optree.tree_map(torch.sqrt, segments.sumsq(params))
        u_norm = optree.tree_map(torch.sqrt, segments.sumsq(u))
        # Bias correction as one factor on the step, in float64 on a 0-d tensor: no host sync, works on meta.
        step = count.double()
        bias = (1 - torch.pow(b2, step)).sqrt() / (1 - torch.pow(b1, step))

        def trust(w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            return torch.where((w > 0) & (n > 0), (w / n).clamp(min_coeff, max_coeff), torch.ones_like(w))

        def factor(w: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
            ratio = trust(w, n)
            return ratio * bias.to(ratio.dtype)

        steps = per_param_steps(count, skipped)
        if steps is None:
            per_segment = optree.tree_map(factor, p_norm, u_norm)
            scale = segments.expand(per_segment, u)
        else:  # some parameters have their own, smaller step counts: the bias factor per element (same product)
            own = steps.double()
            own_bias = ((1 - torch.pow(b2, own)).sqrt() / (1 - torch.pow(b1, own))).float()
            ratios = optree.tree_leaves(segments.expand(optree.tree_map(trust, p_norm, u_norm), u))
            u_leaves, spec = optree.tree_flatten(u)
            scale = spec.unflatten([
                r * per_element(own_bias, ranges, float(bias), x).to(r.dtype)
                for r, x, ranges in zip(ratios, u_leaves, param_ranges(u))
            ])
        directions = optree.tree_map(lambda x, s, g: (x * s).to(g.dtype), u, scale, updates)
        return directions, ScaleByLambState(count, mu, nu, skipped)

    return GradientTransformation(init, update)


def lamb(
    learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.0,
    max_coeff: float = 10.0, min_coeff: float = 0.01,
) -> GradientTransformation:
    """LAMB as DeepSpeed's ``FusedLamb``: the Adam update plus decoupled decay, scaled per parameter by the trust
    ratio ``||p|| / ||update||`` clipped to ``[min_coeff, max_coeff]`` (see ``fzero.optim._lamb``).

    ``eps`` defaults to 1e-6 (the LAMB paper's and optax's; DeepSpeed's ``FusedLamb`` defaults to 1e-8).
    State: ``(ScaleByLambState(count, mu, nu, skipped), lr_state)``, ``lr_state`` as in ``adamw``. No fused step:
    ``apply_inplace`` runs the pure update, then ``p.add_(u)``.
    """
    api = "fzero.optim.lamb"
    learning_rate = check_learning_rate(api, learning_rate)
    b1, b2, eps, weight_decay, max_coeff, min_coeff = _lamb_settings(api, b1, b2, eps, weight_decay, max_coeff, min_coeff)
    return chain(
        scale_by_lamb(b1, b2, eps, weight_decay, max_coeff=max_coeff, min_coeff=min_coeff),
        scale_by_learning_rate(learning_rate),
    )


def _lamb_settings(api: str, b1: Any, b2: Any, eps: Any, weight_decay: Any, max_coeff: Any, min_coeff: Any) -> tuple[float, ...]:
    # Checked in lamb too (not only in scale_by_lamb) so that errors name the function the user called.
    b1 = check_float(api, "b1", b1, low=0.0, high=1.0, high_open=True, hint=" Typical: b1=0.9.")
    b2 = check_float(api, "b2", b2, low=0.0, high=1.0, high_open=True, hint=" Typical: b2=0.999.")
    eps = check_float(api, "eps", eps, low=0.0, hint=" Typical: eps=1e-6.")
    weight_decay = check_float(api, "weight_decay", weight_decay, low=0.0, hint=" Typical: 0.01; 0.0 for none.")
    min_coeff = check_float(api, "min_coeff", min_coeff, low=0.0, hint=" Typical: min_coeff=0.01.")
    max_coeff = check_float(api, "max_coeff", max_coeff, low=0.0, hint=" Typical: max_coeff=10.0.")
    if min_coeff > max_coeff or math.isinf(min_coeff):
        raise ValueError(
            f"{api}: the trust ratio is clipped to [min_coeff, max_coeff], so min_coeff must be finite and <= max_coeff; "
            f"got min_coeff={min_coeff!r}, max_coeff={max_coeff!r}. Typical: min_coeff=0.01, max_coeff=10.0."
        )
    return b1, b2, eps, weight_decay, max_coeff, min_coeff
