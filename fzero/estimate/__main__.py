"""``python -m fzero.estimate ...``: see ``fzero.estimate.main``."""

from fzero.estimate import main

main()
