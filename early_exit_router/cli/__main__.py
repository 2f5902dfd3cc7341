"""`python -m early_exit_router.cli ...`, the same as the `early-exit-router` script."""

import sys

from early_exit_router.cli import main

sys.exit(main())
