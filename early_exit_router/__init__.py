"""early-exit-router: one-model early-exit generation for Hugging Face causal LMs, with layer-wise KV filling."""

import logging

# Loggers that speak at import time about things a user did not ask for: transformers imports torchao whenever it is
# installed (the `quant` extra), whose CUDA kernels fail to load on a CPU build, and torch's pytree then warns about
# torchao's enums. They are kept to errors, before the imports below bring transformers in, unless the application
# set their level itself.
for _name in ("torchao", "torch.utils._pytree"):
    if logging.getLogger(_name).level == logging.NOTSET:
        logging.getLogger(_name).setLevel(logging.ERROR)

from early_exit_router._version import __version__  # noqa: E402
from early_exit_router.api import EarlyExitRouter, GenerationOutput  # noqa: E402
from early_exit_router.config import RouterConfig  # noqa: E402
from early_exit_router.decode.stats import GenerationStats  # noqa: E402

__all__ = ["EarlyExitRouter", "GenerationOutput", "GenerationStats", "RouterConfig", "__version__"]
