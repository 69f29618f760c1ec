"""Rematerialisation: ``fzero.remat`` recomputes a block in backward instead of keeping its activations."""

# What other packages use of this one (they import it from here, never from a private module):
from fzero.autodiff._refusals import check_unit_hooks
from fzero.autodiff._remat import remat, under_remat
