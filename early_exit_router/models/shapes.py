"""Architectures users deploy, as shapes: random weights of a published model's sizes, for timing what a decoding
step and a pass cost there (`profile --shape`). Timings do not depend on the weights' values, and no weights can be
downloaded here; what drafting gains on such a model is a projection from those costs and an acceptance rate, never
a measurement."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# The published configs' sizes (config.json of meta-llama/Llama-3.2-1B and meta-llama/Meta-Llama-3-8B).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-3-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
}


def shape_config(name: str) -> Any:
    """The transformers config of shape `name` (one of `SHAPES`)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"Unknown shape {name!r}: use one of {', '.join(SHAPES)}.")
    fields = dict(SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_model(name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """A causal LM of shape `name` with random weights (eval mode, float32 unless `dtype`), named after its shape."""
    from transformers import AutoModelForCausalLM

    config = shape_config(name)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    model.config._name_or_path = f"random {name}"
    return model.eval()


def default_exit_layers(num_layers: int) -> list[int]:
    """An eighth, a quarter and half the depth: where self-speculative drafts are usually taken."""
    return sorted({max(1, num_layers // 8), num_layers // 4, num_layers // 2})
