"""Training and evaluation text that exists offline.

Training: the model's own greedy answers to a prompt set (the distribution the heads meet at decode time), and
the long descriptions (READMEs) that installed Python packages ship in their metadata, with license boilerplate
removed. Held out for evaluation, never trained on: Debian's common licenses and the CPython standard library.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sysconfig
from importlib import resources
from pathlib import Path
from typing import Any

import torch

LICENSE_MARKERS = (
    "permission is hereby granted",
    "the software is provided",
    "licensed under the apache license",
    "gnu general public license",
    "gnu lesser general public license",
    "redistribution and use in source and binary forms",
    "mozilla public license",
    "all rights reserved",
)
COMMON_LICENSES = Path("/usr/share/common-licenses")


TRAIN_PROMPTS = "train_prompts.jsonl"  # self-distillation prompts
DEV_PROMPTS = "dev_prompts.jsonl"  # development set: measured on, never trained on
CALIBRATION_PROMPTS = "calibration_prompts.jsonl"  # threshold calibration, split in halves; never trained on
HELDOUT_PROMPTS = "heldout_prompts.jsonl"  # held out: benchmarked beside the dev set, never tuned or trained on


def load_prompts(path: str | Path | None = None, shipped: str = TRAIN_PROMPTS) -> list[dict[str, Any]]:
    """Prompt records (id, category, kind, prompt) from a JSONL file at `path`, or the set shipped as `shipped`."""
    text = Path(path).read_text() if path else (resources.files("early_exit_router.data") / shipped).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def package_descriptions(max_chars: int) -> tuple[list[str], list[str]]:
    """(texts, sources): installed distributions' long descriptions, license paragraphs dropped, sorted by name."""
    texts, sources, total = [], [], 0
    dists = sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower())
    for dist in dists:
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        paragraphs = [p for p in re.split(r"\n\s*\n", body) if not _looks_like_license(p)]
        text = "\n\n".join(paragraphs).strip()
        if len(text) < 200:
            continue
        text = text[: max_chars - total]
        texts.append(text)
        sources.append(f"{dist.metadata.get('Name')}=={dist.version}")
        total += len(text)
        if total >= max_chars:
            break
    return texts, sources


def _looks_like_license(paragraph: str) -> bool:
    lower = paragraph.lower()
    return any(marker in lower for marker in LICENSE_MARKERS)


def held_out_texts(max_chars_each: int = 20_000) -> dict[str, str]:
    """Evaluation-only text: Debian's common licenses and a slice of the CPython standard library."""
    out: dict[str, str] = {}
    if COMMON_LICENSES.is_dir():
        names = ["Apache-2.0", "GPL-3", "MPL-2.0", "BSD", "LGPL-2.1"]
        parts = [(COMMON_LICENSES / n).read_text(errors="ignore") for n in names if (COMMON_LICENSES / n).is_file()]
        out["debian-licenses"] = "\n\n".join(parts)[:max_chars_each]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = [(stdlib / n).read_text(errors="ignore") for n in ("textwrap.py", "fractions.py", "heapq.py", "bisect.py")]
    out["cpython-stdlib"] = "\n\n".join(p for p in parts)[:max_chars_each]
    return out


@torch.no_grad()
def self_generated(
    model: Any, tokenizer: Any, prompts: list[dict[str, Any]], max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """Token ids of (chat prompt + the model's own greedy answer) for each prompt, generated in batches."""
    sequences: list[list[int]] = []
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only batch generation needs left padding
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p["prompt"]}], tokenize=False, add_generation_prompt=True
                )
                if p.get("kind", "chat") == "chat"
                else p["prompt"]
                for p in batch
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
            for row, mask in zip(out, enc.attention_mask):
                pad = int((mask == 0).sum())
                ids = row[pad:].tolist()
                while ids and ids[-1] == pad_id:  # right padding after an early EOS
                    ids.pop()
                sequences.append(ids)
    finally:
        tokenizer.padding_side = old_side
    return sequences
