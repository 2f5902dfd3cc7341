"""Trained exit heads shipped with early-exit-router, one saved-router folder per model alias.

Installed as `early_exit_router.checkpoints`.
"""
