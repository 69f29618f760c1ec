"""Ready-made optimizers: chains of transforms with torch.optim's arithmetic, plus their in-place fused steps.

Each is a ``GradientTransformation`` whose pure ``update`` is the chain and whose ``fused`` step (what
``apply_inplace`` runs) reproduces ``torch.optim.AdamW(fused=True)``, ``torch.optim.Adam(fused=True)`` and
``torch.optim.SGD`` bit for bit on the same tensors.
"""

from __future__ import annotations

from typing import Any

from fzero.optim import _fused
from fzero.optim._groups import decay_groups, masked_by
from fzero.optim._base import GradientTransformation, LearningRate, chain, check_float, check_learning_rate
from fzero.optim._transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate, trace


def adamw(
    learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW as ``torch.optim.AdamW``: decoupled decay ``p *= 1 - lr * weight_decay``, then the Adam step.

    ``mask``: which params are decayed (optax's ``adamw(mask=...)``; torch's "decay" and "no decay" param
    groups): a pytree of bools like the params (True: decayed), or a function of the params returning one, such as
    ``fzero.optim.decay_mask`` (no decay for biases, norms and positional tables) or
    ``fzero.optim.no_decay_names(["bias", "LayerNorm.weight"])``. None: every param is decayed. The Adam step and
    its state are shared by all params; only the decay is masked (``fzero.optim.masked``).

    State: ``(ScaleByAdamState(count, mu, nu, skipped), decay_state, lr_state)`` where ``decay_state`` is
    ``EmptyState()`` (``MaskedState(EmptyState())`` with a mask) and ``lr_state`` is ``EmptyState()`` for a float
    learning rate and ``ScaleByScheduleState(count)`` for a schedule. ``apply_inplace`` runs
    ``torch._fused_adamw_`` on it (see ``fzero.optim._fused`` for when it can't and what is bitwise); with a mask,
    the undecayed params are redone with ``weight_decay=0`` (``fzero.optim._fused.adam_step``), as torch's fused
    AdamW runs a param group with no decay.
    """
    api = "fzero.optim.adamw"
    learning_rate = check_learning_rate(api, learning_rate)
    weight_decay = check_float(api, "weight_decay", weight_decay, low=0.0, hint=" Typical: 0.01; 0.0 for none.")
    b1, b2, eps = _adam_settings(api, b1, b2, eps)
    decay, groups = add_decayed_weights(weight_decay), None
    if mask is not None:
        groups = decay_groups(api, mask)
        decay = masked_by(groups, decay)
    opt = chain(scale_by_adam(b1, b2, eps), decay, scale_by_learning_rate(learning_rate))
    fused = _fused.adam_step(
        opt.update, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, decoupled=True,
        learning_rate=learning_rate, adam_index=0, lr_index=2, decay_groups=groups,
    )
    return opt._replace(fused=fused)


def adam(learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam as ``torch.optim.Adam`` (without weight decay; chain ``add_decayed_weights`` in front for L2).

    State: ``(ScaleByAdamState(count, mu, nu, skipped), lr_state)``; ``apply_inplace`` runs ``torch._fused_adam_``.
    """
    api = "fzero.optim.adam"
    learning_rate = check_learning_rate(api, learning_rate)
    b1, b2, eps = _adam_settings(api, b1, b2, eps)
    opt = chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate))
    fused = _fused.adam_step(
        opt.update, b1=b1, b2=b2, eps=eps, weight_decay=0.0, decoupled=False,
        learning_rate=learning_rate, adam_index=0, lr_index=1,
    )
    return opt._replace(fused=fused)


def sgd(
    learning_rate: LearningRate, *, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """SGD as ``torch.optim.SGD`` (no dampening): ``d = g + wd * p``; with momentum ``buf = momentum * buf + d``
    (``buf = d`` at the first step) and ``d = buf``, or ``d + momentum * buf`` when ``nesterov``; ``p -= lr * d``.

    State: ``(EmptyState(), TraceState(trace), lr_state)``, without the ``TraceState`` when ``momentum`` is 0
    (no buffer is allocated then). ``apply_inplace`` runs torch SGD's for-loop ops in place.
    """
    api = "fzero.optim.sgd"
    learning_rate = check_learning_rate(api, learning_rate)
    momentum = check_float(api, "momentum", momentum, low=0.0, hint=" Typical: 0.9; 0.0 for none.")
    weight_decay = check_float(api, "weight_decay", weight_decay, low=0.0, hint=" Typical: 1e-4; 0.0 for none.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{api}: nesterov must be a bool, got {type(nesterov).__name__} {nesterov!r}.")
    if nesterov and momentum == 0.0:
        raise ValueError(f"{api}: nesterov=True needs momentum > 0, got momentum={momentum!r}. Pass e.g. momentum=0.9.")
    # add_decayed_weights keeps no state (and is a no-op at 0); a momentum buffer is only allocated when used.
    parts = [add_decayed_weights(weight_decay)]
    trace_index = None
    if momentum:
        trace_index = len(parts)
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    opt = chain(*parts)
    fused = _fused.sgd_step(
        opt.update, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
        learning_rate=learning_rate, trace_index=trace_index, lr_index=len(parts) - 1,
    )
    return opt._replace(fused=fused)


def _adam_settings(api: str, b1: float, b2: float, eps: float) -> tuple[float, float, float]:
    # Checked here (not only in scale_by_adam) so that errors name the alias the user called.
    return (
        b1 if callable(b1) else check_float(api, "b1", b1, low=0.0, high=1.0, high_open=True, hint=" Typical: b1=0.9."),
        check_float(api, "b2", b2, low=0.0, high=1.0, high_open=True, hint=" Typical: b2=0.999."),
        check_float(api, "eps", eps, low=0.0, hint=" Typical: eps=1e-8."),
    )
