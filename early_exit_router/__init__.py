"""early-exit-router: one-model early-exit generation for Hugging Face causal LMs, with layer-wise KV filling."""

__version__ = "0.1.0"

from early_exit_router.config import RouterConfig  # noqa: E402
from early_exit_router.runtime.router import EarlyExitRouter, GenerationOutput  # noqa: E402
from early_exit_router.stats import GenerationStats  # noqa: E402

__all__ = ["EarlyExitRouter", "GenerationOutput", "GenerationStats", "RouterConfig", "__version__"]
