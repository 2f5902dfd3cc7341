"""Quantized bases for limited memory: torchao weight-only int8 / int4 (any device, the CPU included) and
bitsandbytes 8-bit / 4-bit (CUDA only), applied when the base model is loaded.

The router needs nothing else: the layers run as the model's own modules whatever their weights are stored as, and
the exit heads, gates and the trimmed draft head stay dense in the compute dtype (`architecture.dense`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

QUANTIZATIONS = ("int8", "int4", "bnb-8bit", "bnb-4bit")
INT4_GROUP_SIZE = 32


def check_quantization(kind: str | None, device: str | torch.device | None) -> None:
    """Raise a clear error, before anything is loaded, when `kind` cannot run here."""
    if kind is None:
        return
    if kind not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {kind!r}: choose one of {', '.join(QUANTIZATIONS)}.")
    if kind.startswith("bnb-"):
        on_cuda = device is not None and torch.device(device).type == "cuda"
        if not (on_cuda and torch.cuda.is_available()):
            raise ValueError(
                f"{kind} (bitsandbytes) runs on CUDA only: pass device='cuda' on a GPU machine, or use "
                "'int8' / 'int4' (torchao weight-only), which run on the CPU too."
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ImportError(f"{kind} needs the bitsandbytes package: pip install bitsandbytes.")
    elif importlib.util.find_spec("torchao") is None:
        raise ImportError(f"{kind} quantization needs torchao: pip install 'early-exit-router[quant]'.")


def load_kwargs(kind: str | None) -> dict[str, Any]:
    """Extra `from_pretrained` arguments: bitsandbytes quantizes while loading."""
    if kind is None or not kind.startswith("bnb-"):
        return {}
    from transformers import BitsAndBytesConfig

    bits = {"bnb-8bit": {"load_in_8bit": True}, "bnb-4bit": {"load_in_4bit": True}}[kind]
    return {"quantization_config": BitsAndBytesConfig(**bits), "device_map": "cuda"}


def quantize_loaded(model: torch.nn.Module, kind: str | None) -> None:
    """torchao weight-only quantization of every linear layer of a loaded model, in place."""
    if kind not in ("int8", "int4"):
        return
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    if kind == "int8":
        config = Int8WeightOnlyConfig()
    else:  # the int4 layout that runs on the CPU as well (unpacked int4 values, grouped scales)
        config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE))
    quantize_(model, config)
