"""Rematerialisation: ``fzero.remat`` recomputes a block in backward instead of keeping its activations."""
