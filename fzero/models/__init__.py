"""Reference models for fzero's tests, examples and benchmarks."""

from fzero.models.gpt import GPT as GPT
from fzero.models.gpt import GPTConfig as GPTConfig
from fzero.models.gpt import gpt_loss as gpt_loss
from fzero.models.gpt import num_params as num_params
from fzero.models.mlp import MLP as MLP
from fzero.models._layerdrop import ProgressiveLayerDrop as ProgressiveLayerDrop

__all__ = ["GPT", "GPTConfig", "MLP", "ProgressiveLayerDrop", "gpt_loss", "num_params"]
