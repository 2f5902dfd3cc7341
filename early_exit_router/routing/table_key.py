"""What a measured cost table depends on (`cost_key`): the model's shape, the device (down to the CPU's model), dtype,
threads, library versions and what the passes and the draft head run as; a cached table is read only under its key."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from early_exit_router.heads.draft import keeps_half_rows
from early_exit_router.models import graph_products
from early_exit_router.models.compiled import SHAPES, compiles_here

MEASURED_CHUNKS = (*range(1, 17), 24, 32, 48, 64)  # chunk lengths timed: dense where drafts live, sparse beyond


def device_name(device: torch.device) -> str:
    """The device's model as costs depend on it: the GPU's name, or the CPU's model and core count (a virtual
    machine may come back on another host's processor, whose kernels price a pass differently)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} x{os.cpu_count()}"


@functools.cache  # read once per process: cost_key asks on every generate call
def cpu_model() -> str:
    """The processor's model name ("cpu" where the system does not say)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip() or "cpu"
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def cost_key(stack: Any, draft_vocab_size: int, compile: bool = False, half_draft: bool = False) -> dict[str, Any]:
    """What the measured costs depend on: the model's shape, the device (`device_name`), dtype, threads and library
    versions, the draft head's size and precision (`half_draft`), and whether passes run as compiled graphs
    (`compile`, where they compile here: `compiles_here`); no other per-call option (a request's `max_pending` never
    starts a measurement)."""
    import transformers

    from early_exit_router._version import __version__

    cfg = stack.config
    device = stack.device
    compiled = compile and compiles_here(stack)
    return {
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_layers": stack.num_layers,
        "hidden_size": stack.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": getattr(cfg, "num_attention_heads", None),
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
        "vocab_size": stack.vocab_size,
        "device": f"{device.type}:{device_name(device)}",
        "dtype": str(stack.dtype).replace("torch.", ""),
        "weights": sorted(stack.weight_formats()),  # a quantized base has costs of its own
        "packed_weights": len(stack.packed_weights or ()),  # products from prepacked weights cost less
        "packed_kernels": stack.packed_weights.kernels if stack.packed_weights else [],
        "packed_min_rows": stack.packed_weights.min_rows if stack.packed_weights else 1,
        "packed_max_rows": stack.packed_weights.max_rows if stack.packed_weights else None,
        "packed_groups": stack.packed_weights.groups if stack.packed_weights else 0,  # stacked: fewer products
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "library": __version__,
        "draft_vocab_size": draft_vocab_size,
        "half_draft_head": keeps_half_rows(stack, half_draft),  # what the head keeps, not what was asked
        "chunks": list(MEASURED_CHUNKS),
        "compiled": list(SHAPES) if compiled else [],  # the graphs passes run as
        "graph_products": graph_products.how() if compiled else None,  # what the graphs' products call
    }
