"""Training and evaluation text that exists offline.

Training: the model's own answers (greedy and sampled) to a prompt set — the distribution the heads meet at decode
time — and the long descriptions (READMEs) that installed Python packages ship in their metadata, with license
boilerplate removed. `generated_prompts` widens the prompt set offline: chat requests from templates over a list of
subjects and over installed packages' summaries, and text to continue (README paragraphs, third-party Python
source from site-packages). Held out for evaluation, never trained on: Debian's common licenses and the CPython
standard library.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import re
import sysconfig
from collections.abc import Iterable
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
# Grounded output (edits, conversions, extraction, continuations of structured text) and sequences of similar
# requests, 192 new tokens: a development set, and a held-out set never tuned or trained on.
GROUNDED_PROMPTS = "grounded_prompts.jsonl"
GROUNDED_HELDOUT_PROMPTS = "grounded_heldout_prompts.jsonl"
# Prompts whose answers a check judges (lists, arithmetic, JSON, code): a development set, and a held-out one.
CHECKABLE_PROMPTS = "checkable_prompts.jsonl"
CHECKABLE_HELDOUT_PROMPTS = "checkable_heldout_prompts.jsonl"
MEASURED_PROMPT_SETS = (DEV_PROMPTS, CALIBRATION_PROMPTS, HELDOUT_PROMPTS, GROUNDED_PROMPTS, GROUNDED_HELDOUT_PROMPTS,
                        CHECKABLE_PROMPTS, CHECKABLE_HELDOUT_PROMPTS)  # fmt: skip


def load_prompts(
    path: str | Path | None = None, shipped: str = TRAIN_PROMPTS, fields: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Prompt records (id, category, kind, prompt) from a JSONL file at `path`, or the set shipped as `shipped`. A
    line that is no JSON object, lacks one of `fields` or holds a prompt that is not text is refused, with its line."""
    text = Path(path).read_text() if path else (resources.files("early_exit_router.data") / shipped).read_text()
    records, needed = [], ", ".join(fields)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path or shipped}, line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where} is not JSON ({exc}): write one JSON object per line.") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object with the fields {needed or 'prompt'}, got {record!r}.")
        missing = [name for name in fields if name not in record]
        if missing:
            raise ValueError(f"{where} lacks the field(s) {', '.join(missing)} (needed: {needed}).")
        if "prompt" in record and not isinstance(record["prompt"], str):
            raise ValueError(f"{where}: prompt must be a string, got {record['prompt']!r}.")
        records.append(record)
    return records


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


SUBJECTS = (
    "the water cycle",
    "black holes",
    "photosynthesis",
    "the French Revolution",
    "compound interest",
    "volcanoes",
    "machine learning",
    "the immune system",
    "climate change",
    "the printing press",
    "honey bees",
    "electric cars",
    "the Roman Empire",
    "quantum computers",
    "coffee",
    "the stock market",
    "rainbows",
    "the human heart",
    "recycling",
    "the moon landing",
    "sourdough bread",
    "chess",
    "jazz music",
    "the internet",
    "glaciers",
    "vaccines",
    "solar panels",
    "the Great Wall of China",
    "octopuses",
    "public libraries",
    "earthquakes",
    "time zones",
    "the Olympic Games",
    "tea",
    "bicycles",
    "cloud computing",
    "the Amazon rainforest",
    "dinosaurs",
    "taxes",
    "sleep",
    "gardening",
    "the periodic table",
    "password security",
    "hiking",
    "origami",
    "wind turbines",
    "the violin",
    "budget travel",
    "meditation",
    "spreadsheets",
    "the Renaissance",
    "penguins",
    "3D printing",
)
CHAT_TEMPLATES = (
    "Explain {s} in simple terms.",
    "List five interesting facts about {s}.",
    "Write a short paragraph about {s} for a school newsletter.",
    "What are the pros and cons of {s}?",
    "Write a haiku about {s}.",
    "Give me three questions a student might ask about {s}, with short answers.",
    "Write a short, friendly email to a colleague recommending a book about {s}.",
    "Summarise the history of {s} in a few sentences.",
    "Write a markdown table with three rows of facts about {s}.",
    "Write a JSON object with a title, a summary and three tags for an article about {s}.",
)
CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text",
    "merges two sorted lists",
    "returns the n-th Fibonacci number",
    "removes duplicates from a list",
    "parses a date in YYYY-MM-DD format",
    "computes the average of a list of numbers",
    "flattens a nested list",
    "converts Celsius to Fahrenheit",
    "finds the largest element of a list",
    "checks whether a word is a palindrome",
)
CODE_TEMPLATES = (
    "Write a Python function that {t}.",
    "Write a JavaScript function that {t}.",
    "Write a Python function that {t}, with a docstring and a test.",
)
PACKAGE_TEMPLATES = (
    "What is the Python package {name} used for? Its summary: {summary}",
    "Write a short tutorial introduction for {name} ({summary}).",
)
STORY_TEMPLATES = (
    "A shop sells pens for {a} dollars each. Tom buys {b} pens and pays with a {c}-dollar note. How much change "
    "does he get?",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "Anna has {a} stickers and gives {b} to each of her {c} friends. How many does she have left?",
)


def generated_prompts(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` prompt records built offline (see the module docstring), seeded, in a fixed mix: about half chat
    requests over subjects, code and word problems, a sixth about installed packages, a third text to continue."""
    rng = random.Random(seed)
    packages = _package_summaries()
    paragraphs = _readme_paragraphs()
    code = _third_party_code()
    out: list[dict[str, Any]] = []
    for n in range(count):
        kind = rng.random()
        if kind < 0.3:
            prompt = rng.choice(CHAT_TEMPLATES).format(s=rng.choice(SUBJECTS))
            record = {"category": "dialogue", "kind": "chat", "prompt": prompt, "source": "subjects"}
        elif kind < 0.4:
            record = {
                "category": "templated",
                "kind": "chat",
                "prompt": rng.choice(CODE_TEMPLATES).format(t=rng.choice(CODE_TASKS)),
                "source": "code tasks",
            }
        elif kind < 0.5:
            a, b, c = rng.randint(2, 60), rng.randint(2, 9), rng.randint(2, 9)
            c = max(c, a * b // 10 + 1) * 10 if "change" in (t := rng.choice(STORY_TEMPLATES)) else c
            record = {"category": "reasoning", "kind": "chat", "prompt": t.format(a=a, b=b, c=c), "source": "stories"}
        elif kind < 0.67 and packages:
            name, summary = rng.choice(packages)
            prompt = rng.choice(PACKAGE_TEMPLATES).format(name=name, summary=summary)
            record = {"category": "dialogue", "kind": "chat", "prompt": prompt, "source": "package summaries"}
        elif kind < 0.84 and paragraphs:
            record = {
                "category": "templated",
                "kind": "text",
                "prompt": rng.choice(paragraphs)[:400],
                "source": "readme",
            }
        elif code:
            record = {"category": "templated", "kind": "text", "prompt": rng.choice(code), "source": "code"}
        else:
            continue
        out.append({"id": f"gen{n:05d}", **record})
    return out


def fresh_prompts(
    count: int, seed: int, exclude: Iterable[dict[str, Any]] = (), skip_sources: tuple[str, ...] = ("readme",)
) -> list[dict[str, Any]]:
    """Up to `count` prompts from `generated_prompts(..., seed)` whose text is in none of `exclude` (and none twice)
    and whose source is not in `skip_sources`: text for fitting gates that no head was trained on. README paragraphs
    are skipped by default: the training corpus holds package READMEs themselves. Fewer come back when the
    templates run out; none at all is an error."""
    excluded = list(exclude)
    seen = {p["prompt"] for p in excluded}
    out: list[dict[str, Any]] = []
    # The generator's output for a seed extends its shorter output, so the excluded training prompts come first:
    # draw past them, and more than needed, as templates repeat.
    for record in generated_prompts(len(excluded) + 8 * count, seed):
        if record["prompt"] not in seen and record["source"] not in skip_sources:
            seen.add(record["prompt"])
            out.append({**record, "id": f"fresh{len(out):05d}"})
            if len(out) == count:
                break
    if not out:
        raise ValueError(f"No fresh prompt is left after excluding {len(excluded)}: use another seed.")
    return out


def _package_summaries() -> list[tuple[str, str]]:
    found = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower()):
        name, summary = dist.metadata.get("Name"), (dist.metadata.get("Summary") or "").strip()
        if name and len(summary) > 20:
            found.append((name, summary))
    return found


def _readme_paragraphs() -> list[str]:
    texts, _ = package_descriptions(max_chars=2_000_000)
    paragraphs = [p.strip() for t in texts for p in re.split(r"\n\s*\n", t) if len(p.strip()) > 200]
    return [p for p in paragraphs if "licen" not in p.lower()]  # nothing near the held-out license texts


def _third_party_code(max_files: int = 400) -> list[str]:
    """Openings of functions and classes in installed third-party packages (never the standard library)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    snippets = []
    for path in sorted(purelib.glob("*/*.py"))[:max_files]:
        if "early_exit_router" in str(path):
            continue
        text = path.read_text(errors="ignore")
        for match in re.finditer(r"^(def|class) \w+.*$", text, flags=re.M):
            snippets.append(text[match.start() : match.start() + 300])
    return snippets


@torch.no_grad()
def self_generated(
    model: Any,
    tokenizer: Any,
    prompts: list[dict[str, Any]],
    max_new_tokens: int,
    batch_size: int = 16,
    sample: bool = False,
    seed: int = 0,
) -> list[list[int]]:
    """Token ids of (prompt + the model's own answer) for each prompt, generated in batches: greedy, or sampled
    (temperature 0.8, top-p 0.95, seeded)."""
    if sample:
        torch.manual_seed(seed)
    sequences: list[list[int]] = []
    old_side, old_pad = tokenizer.padding_side, tokenizer.pad_token
    # Batches are padded (the attention mask hides the padding), so any token serves where there is no pad token.
    pad = old_pad or tokenizer.eos_token or tokenizer.unk_token
    if pad is None:
        raise ValueError("Batched self-generation pads: give the tokenizer a pad, EOS or unknown token.")
    try:
        tokenizer.padding_side, tokenizer.pad_token = "left", pad  # decoder-only batch generation pads on the left
        pad_id = tokenizer.pad_token_id
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
            sampling = dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0) if sample else dict(do_sample=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
            for row, mask in zip(out, enc.attention_mask):
                padding = int((mask == 0).sum())
                ids = row[padding:].tolist()
                while ids and ids[-1] == pad_id:  # right padding after an early EOS
                    ids.pop()
                sequences.append(ids)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = old_side, old_pad
    return sequences
