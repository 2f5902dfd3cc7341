"""An adapted base in a router folder: `adapt-base`'s LoRA (PEFT's own two files), or the whole adapted model as an
HF folder, beside identity heads at the exits the model was trained for.

The router config's `adapted_base` entry says which: `{"format": "lora"}` loads the recorded base and merges the
LoRA into it (PEFT's `merge_and_unload`), `{"format": "merged"}` loads the model from the router folder itself.
Either way the exits read the model's own final norm and LM head, which adaptation leaves as they were (so the
saved base identity still checks them).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from early_exit_router.models._compat import quiet_peft

ADAPTED_KEY = "adapted_base"
FORMATS = ("lora", "merged")
# "model": the adaptation is the model's (merged into it on load); "draft": it is a draft path's alone, on copies of
# layers 0..exit_layer (`draft_path.py`), and the model stays bit-identical
SCOPES = ("model", "draft")
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")
REPORT_FILES = ("adapt_report.json", "adapt_curve.jsonl", "adapt_curve.png")
# An HF model folder's own files (a merged adapted model), by name or suffix.
HF_FILE_NAMES = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
}


def is_hf_file(name: str) -> bool:
    return name in HF_FILE_NAMES or (name.startswith("model") and name.endswith(".safetensors"))


def check_adapted(entry: Any, where: Path) -> dict[str, Any] | None:
    """The config's `adapted_base` entry, checked (None: a router on an unchanged base); its scope filled in ("model"
    where an older folder does not say)."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("format") not in FORMATS:
        raise ValueError(f"{where}: adapted_base must say its format ({' or '.join(FORMATS)}); re-run adapt-base.")
    entry = {"scope": "model", **entry}
    if entry["scope"] not in SCOPES or (entry["scope"] == "draft" and not isinstance(entry.get("exit_layer"), int)):
        raise ValueError(
            f"{where}: adapted_base's scope must be one of {SCOPES} (a draft path with its exit_layer): re-run "
            "adapt-base."
        )
    if entry["scope"] == "draft" and entry["format"] != "lora":
        raise ValueError(f"{where}: a draft path is a LoRA (format 'lora'): re-run adapt-base --scope draft.")
    missing = [f for f in (LORA_FILES if entry["format"] == "lora" else ("config.json",)) if not (where / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{where} is an adapted base ({entry['format']}) without {missing}: copy the whole folder adapt-base wrote."
        )
    return entry


def adapted_files(folder: Path, entry: dict[str, Any] | None) -> list[str]:
    """The names in `folder` that belong to its adapted base (none for a router on an unchanged base)."""
    if entry is None or not folder.is_dir():
        return []
    names = [p.name for p in folder.iterdir() if p.is_file()]
    if entry["format"] == "lora":
        return [n for n in names if n in LORA_FILES or n in REPORT_FILES]
    return [n for n in names if is_hf_file(n) or n in REPORT_FILES]


def apply_adaptation(model: nn.Module, folder: Path, entry: dict[str, Any]) -> nn.Module:
    """`model` (the recorded base, just loaded) as the adapted model: a LoRA merged into its weights; a merged
    folder's model is already adapted."""
    if entry["format"] == "merged" or entry["scope"] == "draft":  # a draft path loads beside the model
        return model
    try:
        from peft import PeftModel
    except ImportError:
        raise ImportError(
            f"{folder} holds a LoRA-adapted base, which loads with PEFT: pip install 'early-exit-router[adapt]' "
            "(or peft), or ask adapt-base for a merged folder (--merge)."
        ) from None
    dtype = next(model.parameters()).dtype
    with quiet_peft():
        merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    return merged.to(dtype)


def copy_adapted(source: Path, target: Path, entry: dict[str, Any], known: set[str]) -> None:
    """Copy the adapted base's files from router folder `source` to `target` (saving an adapted router): `target`
    must be new, or hold only router files (`known`) and a LoRA; never a model's own files."""
    if target.exists() and source.resolve() == target.resolve():
        return
    files = adapted_files(source, entry)
    needed = LORA_FILES if entry["format"] == "lora" else ("config.json",)
    if any(name not in files for name in needed):
        raise FileNotFoundError(
            f"The adapted base this router was loaded from ({source}) is gone, so it cannot be saved with it: "
            "load the router again from a complete folder."
        )
    if target.is_dir():
        ours = known | set(LORA_FILES) | set(REPORT_FILES)
        foreign = sorted(p.name for p in target.iterdir() if not p.name.startswith(".") and p.name not in ours)
        if foreign:
            raise ValueError(
                f"{target} holds other files ({', '.join(foreign[:4])}): save an adapted router to an empty or new "
                "folder (its base's files are written there)."
            )
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copy2(source / name, target / name)
