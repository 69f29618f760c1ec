"""``python -m fzero.checkpoint info|consolidate ...``: see ``fzero.checkpoint.main``."""

import sys

from fzero.checkpoint import main

sys.exit(main())
