"""Which parameters take weight decay: the usual LLM rule (``decay_mask``) and Hugging Face's name list (``no_decay_names``).

Both give masks for ``adamw(..., mask=...)`` / ``masked(add_decayed_weights(wd), ...)``: True where the parameter is
decayed. They read only paths and shapes, so they work on the meta stand-ins a train step passes.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch

from fzero.layout import pytrees as _tree
from fzero.optim._select import of_structure

# A module name that holds a normalisation layer: LayerNorm/RMSNorm/BatchNorm/GroupNorm by any common spelling.
_NORM = re.compile(r"norm|^ln(_.*|\d*)$|^bn\d*$", re.IGNORECASE)
# A positional embedding table (a module, or a bare nn.Parameter with this name).
_POSITIONAL = re.compile(
    r"^(wpe|pos_?emb(ed|eds|edding|eddings)?|position(al)?_?(embed|embeds|embedding|embeddings)|embed_positions)$", re.IGNORECASE
)


def no_decay_reason(path: str, shape: Sequence[int]) -> str | None:
    """Why ``decay_mask`` does not decay the parameter at ``path`` (dotted, as ``fzero.params_of`` names it) of
    ``shape``, or None when it is decayed. See ``decay_mask``."""
    parts = path.split(".") if path else []
    if len(shape) < 2:
        return "fewer than 2 dimensions (a bias, a norm's scale or shift, a scalar)"
    if parts and parts[-1] == "bias":
        return "named bias"
    for part in parts[:-1]:
        if _NORM.search(part):
            return f"in the normalisation module {part!r}"
    for part in parts:
        if _POSITIONAL.match(part):
            return f"a positional embedding table ({part!r})"
    return None


@of_structure
def decay_mask(params: Any) -> Any:
    """A common rule for weight decay (close to nanoGPT's ``configure_optimizers`` and the Hugging Face Trainer's, equal
    to neither: see below): a pytree like ``params``, True where the parameter is decayed.

    A parameter is **not** decayed when any of these holds (paths are dotted, as ``fzero.params_of`` and
    ``named_parameters`` give them; name matches ignore case):

    1. it has fewer than 2 dimensions: biases, the weights and biases of LayerNorm / RMSNorm / BatchNorm /
       GroupNorm, scalar gates and temperatures;
    2. the last part of its path is ``bias`` (whatever its shape);
    3. a module part of its path (any part but the last) names a normalisation layer: it contains ``norm``
       (``LayerNorm``, ``layernorm``, ``layer_norm``, ``norm``, ``input_layernorm``, ``post_attention_layernorm``,
       ``final_layer_norm``, ``q_norm``, ``rmsnorm``, ``batchnorm``, ...), or is ``ln`` followed by digits or by ``_``
       and anything (``ln``, ``ln1``, ``ln_1``, ``ln_f``, ``ln_attn``), or is ``bn`` followed by digits;
    4. a part of its path is a positional embedding table: ``wpe`` (GPT-2), ``pos_emb``, ``pos_embed``,
       ``pos_embedding(s)``, ``position_embedding(s)`` (BERT, CLIP), ``positional_embedding(s)``,
       ``embed_positions`` (OPT, BART, Whisper).

    Everything else is decayed: linear and convolution weights, and token embeddings (``wte``, ``tok_emb``,
    ``embed_tokens``, ``word_embeddings``), as both nanoGPT and the HF Trainer decay them.

    It is not the HF Trainer's rule (``Trainer.get_decay_parameter_names``: no decay for ``nn.LayerNorm`` modules and
    names matching ``bias``, ``layernorm``, ``rmsnorm``, ``norm``), which decays positional tables (GPT-2's ``wpe``,
    BERT's ``position_embeddings``) and BatchNorm weights, and does not decay T5's ``relative_attention_bias.weight``.
    To train as the Trainer does, pass its names:
    ``dn = set(trainer.get_decay_parameter_names(model)); mask = lambda params: {n: n in dn for n in params}``.

    >>> decay_mask({"h.0.ln_1.weight": w1, "h.0.attn.c_attn.weight": w2, "wpe.weight": w3})   # shapes (d,), (d, 3d), (T, d)
    {'h.0.ln_1.weight': False, 'h.0.attn.c_attn.weight': True, 'wpe.weight': False}
    """
    paths, leaves, spec = _tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"fzero.optim.decay_mask: params must be a pytree of tensors; {path or '<root>'!r} is a {type(leaf).__name__}.")
    return spec.unflatten([no_decay_reason(p, tuple(t.shape)) is None for p, t in zip(paths, leaves)])


def no_decay_names(names: Sequence[str]) -> Callable[[Any], Any]:
    """A mask function (for ``adamw(..., mask=...)``): every parameter decayed except those whose dotted path
    contains one of ``names`` as a substring, the Hugging Face scripts' rule::

        no_decay = ["bias", "LayerNorm.weight"]
        opt = fzero.optim.adamw(5e-5, weight_decay=0.01, mask=fzero.optim.no_decay_names(no_decay))
    """
    api = "fzero.optim.no_decay_names"
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{api}: names must be a list of non-empty str (substrings of parameter paths), e.g. "
                        f"['bias', 'LayerNorm.weight']; got {names!r}.")
    names = tuple(names)

    def mask(params: Any) -> Any:
        paths, _, spec = _tree.flatten_with_paths(params)
        return spec.unflatten([not any(n in p for n in names) for p in paths])

    mask.__qualname__ = f"no_decay_names({list(names)!r})"
    return of_structure(mask)
