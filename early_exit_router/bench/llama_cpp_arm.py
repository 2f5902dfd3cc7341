"""llama.cpp's plain greedy decoding of the same GGUF file: the reference a CPU user would pick instead of HF.

Where llama-cpp-python is installed (`pip install 'early-exit-router[llamacpp]'`, built from source where no wheel
fits) and the router's base came from a GGUF file, `bench` adds the arm `LLAMA_CPP`. llama.cpp runs the file as it
is, with its own kernels for the file's weight format (the router and HF run the weights dequantized to the bench's
dtype), greedy on the same token ids, with as many threads as torch uses and no prompt reused from an earlier run.
Its outputs are scored like every arm's; they need not equal plain HF's, as its numerics are its own.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from early_exit_router.models.loading import source_gguf

LLAMA_CPP = "llama.cpp greedy, same GGUF"


def llama_cpp_source(router: Any) -> Path | None:
    """The GGUF file llama.cpp runs for `router`'s base (None: llama-cpp-python is not installed, the base did not
    come from a GGUF file, or adapt-base changed its weights since)."""
    if importlib.util.find_spec("llama_cpp") is None or getattr(router, "adapted_from", None):
        return None
    try:
        return source_gguf(str(router.name_or_path))
    except FileNotFoundError:  # an alias whose package is gone: the router itself was loaded another way
        return None


class LlamaCppRunner:
    """One llama.cpp model over `path`, with room for `context` tokens, on `threads` threads (its layers on the GPU
    where the bench runs on one and llama.cpp was built for it)."""

    def __init__(self, path: Path, context: int, threads: int, gpu: bool = False) -> None:
        import llama_cpp

        self.path, self.threads = path, threads
        self.version = getattr(llama_cpp, "__version__", "unknown")
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   n_gpu_layers=-1 if gpu else 0, verbose=False)  # fmt: skip

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos: Iterable[int]) -> tuple[list[int], list[float]]:
        """Greedy new token ids after the prompt `ids` (1, n), stopping after an end token (kept, as HF keeps it)
        or `max_new_tokens`, and the time each arrived (perf_counter)."""
        stops, tokens, arrivals = set(eos), [], []
        self.llm.reset()  # no prefix kept from the last run: every run prefills its whole prompt
        stream = self.llm.generate(ids[0].tolist(), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        for token in stream:
            tokens.append(int(token))
            arrivals.append(time.perf_counter())
            if token in stops or len(tokens) >= max_new_tokens:
                break
        return tokens, arrivals

    def close(self) -> None:
        """Free llama.cpp's model now (left to interpreter shutdown, its finaliser fails on torn-down globals)."""
        self.llm.close()

    def describe(self) -> str:
        return f"llama-cpp-python {self.version}, {self.path.name}, {self.threads} threads"
