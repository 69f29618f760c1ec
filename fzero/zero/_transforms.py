"""The four transforms under their former module name (each now lives in its own module of ``fzero.zero``)."""

from fzero.zero import offload, shard_grads, shard_optimizer, shard_params

__all__ = ["offload", "shard_grads", "shard_optimizer", "shard_params"]
