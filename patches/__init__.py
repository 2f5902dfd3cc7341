"""Per-architecture adapters for early-exit-router, as data: one JSON file per model family.

Installed as `early_exit_router.patches`; `early_exit_router.architecture` reads them.
"""
