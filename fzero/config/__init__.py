"""DeepSpeed config files as typed fzero settings.

```python
settings = fzero.config.from_deepspeed("ds_config.json", learning_rate=3e-4, total_steps=10_000, world_size=2)
print(settings)                                   # every setting, where it came from, what was resolved or ignored
step = fzero.compile(loss_fn, config=settings, mesh=mesh)
step = fzero.compile(loss_fn, config="ds_config.json", mesh=mesh, stages=3)   # keywords given win over the file
```

``from_deepspeed`` reads the file (or dict) a DeepSpeed user already has and returns a frozen ``Settings``:
the ZeRO stage, the optimizer built as a ``fzero.optim`` transform with its schedule, the ``Precision``
policy, gradient accumulation and clipping, offload, the batch sizes checked against the world size, and the
ZeRO tuning knobs mapped to fzero's hints where they mean something here. Nothing is dropped silently:

* a key fzero does not know is an error that names it and the closest known key;
* a known DeepSpeed feature fzero does not have (1-bit Adam, ZeRO++, pipeline parallelism, ...) is a
  ``NotImplementedError`` that names the feature;
* a known key that has no effect here is accepted and listed in ``Settings.notes`` with the reason;
* ``"auto"`` (the Hugging Face integrations' placeholder) is resolved from the arguments given, as the HF
  Trainer fills it (``AUTO_RULES``); an ``"auto"`` that nothing resolves is an error naming the key and the
  argument to pass. What was resolved is in ``Settings.resolved`` and ``Settings.config``.

Defaults are DeepSpeed 0.19's where the config leaves a value out: gradients are clipped at 1.0, ``Adam`` means
decoupled weight decay (``adam_w_mode``), ``Lamb``'s eps is 1e-8, ``WarmupLR`` warms up to the optimizer's lr.

With ``fzero.compile(loss_fn, config=..., **keywords)`` the keywords given win over the config, even when they
equal ``compile``'s default: ``stages=0`` with a stage-3 config is stage 0, ``precision="fp32"`` with a bf16
config is fp32 (``compile``'s defaults are ``Default`` objects, told apart from a value given).
"""

from __future__ import annotations

from fzero.config._accelerate import from_accelerate
from fzero.config._auto import AUTO_RULES
from fzero.config._merge import merge_with_keywords
from fzero.config._read import from_deepspeed
from fzero.config._schema import M  # noqa: F401 - importable here as before
from fzero.config._settings import Settings
from fzero.config._values import API  # noqa: F401 - importable here as before

__all__ = ["AUTO_RULES", "Settings", "from_accelerate", "from_deepspeed", "merge_with_keywords"]
