"""The package version (one place; `early_exit_router.__version__` re-exports it)."""

__version__ = "0.1.0"
