"""early-exit-router: one-model early-exit generation for Hugging Face causal LMs, with layer-wise KV filling."""

from early_exit_router._version import __version__
from early_exit_router.api import EarlyExitRouter, GenerationOutput  # noqa: E402
from early_exit_router.config import RouterConfig  # noqa: E402
from early_exit_router.decode.stats import GenerationStats  # noqa: E402

__all__ = ["EarlyExitRouter", "GenerationOutput", "GenerationStats", "RouterConfig", "__version__"]
