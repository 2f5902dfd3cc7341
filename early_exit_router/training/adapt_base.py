"""`adapt_base`: the LayerSkip recipe, self-distilled, as one call that writes a loadable router folder.

The folder holds the adapted base (PEFT's LoRA files, or with `merge` the whole adapted model as an HF folder),
identity heads at the exits (the model's own final norm and LM head: no trained head) with the draft vocabulary's
ranking, `adapt_report.json` (settings, tokens, time, quality before and after), `adapt_curve.jsonl` (every step's
losses, the held-out figures every `save_every` steps) and `adapt_curve.png`. `EarlyExitRouter.from_pretrained`
loads it: the base, the LoRA merged into it, and the exits.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from early_exit_router._version import __version__
from early_exit_router.config import RouterConfig
from early_exit_router.heads.adapted_base import ADAPTED_KEY, REPORT_FILES, adapted_files
from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, save_router
from early_exit_router.heads.exit_heads import build_heads
from early_exit_router.training.config import AdaptConfig
from early_exit_router.training.draft_path_trainer import DraftPathTrainer
from early_exit_router.training.layerskip_trainer import (
    EVAL_CHUNKS,
    STATE_DIR,
    AdaptResult,
    LayerSkipTrainer,
)

REPORT_NAME, CURVE_NAME, PLOT_NAME = REPORT_FILES


def adapt_base(
    model: nn.Module,
    tokenizer: Any,
    name: str,
    chunks: torch.Tensor | None,
    cfg: AdaptConfig,
    out: str | Path,
    *,
    merge: bool = False,
    restart: bool = False,
    run_steps: int | None = None,
    run_seconds: float | None = None,
    progress: bool = True,
    command: str = "",
    head: nn.Module | None = None,
    head_kind: str = "identity",
) -> AdaptResult:
    """Adapt `model` (the base recorded as `name`; trained in place) on `chunks` ((n, seq_len) token ids; None
    continues a saved run from its own chunks) and write the router folder `out` when `cfg.max_steps` are done.

    A run that stops early (`run_steps`, `run_seconds`, or interrupted) keeps its state in `out/.adapt-state`; the
    same call continues it (`restart` starts over; a finished run's folder is refused without it, and any other
    folder with files in it always). `merge` writes the adapted model itself (an HF folder) instead
    of the LoRA; `cfg.method == "full"` always does. A LoRA run leaves `model` as it came, unless it merged (then
    `model` is the adapted model); a full fine-tune trains `model` itself.

    `cfg.scope == "draft"`: a base-exact draft path (`DraftPathTrainer`): the LoRA on layers 0..E and a copy of
    `head` (exit E's adapter, of kind `head_kind`, to start from; None: the model's own norm and head) train, and the
    folder loads as a router whose model is the base, bit-identical, with the adapted copies of those layers drafting
    beside it."""
    out = Path(out)
    if cfg.scope == "draft" and merge:
        raise ValueError("A draft path stays a LoRA on copies of its layers (the model is never changed): drop merge.")
    if head is not None and needs_context(head):
        raise ValueError(
            "A draft path's head drafts from one position, and this exit's head is a block adapter: choose an exit "
            "whose head is not (--exit-layers), or a --model without trained heads there."
        )
    state_dir = out / STATE_DIR
    check_adapt_out(out, restart)  # before anything is written there
    if restart:
        _clear(out)
    saved_chunks = state_dir / "chunks.pt"
    if saved_chunks.is_file():
        chunks = torch.load(saved_chunks, weights_only=True)  # the run continues on its own text
    elif chunks is None:
        raise ValueError(f"No text to adapt on, and {state_dir} holds no run to continue: pass the token chunks.")
    if chunks.shape[1] != cfg.seq_len:
        raise ValueError(f"The chunks are {chunks.shape[1]} tokens long, seq_len is {cfg.seq_len}: they must match.")
    trainer = None
    try:
        if cfg.scope == "draft":
            trainer = DraftPathTrainer(model, chunks, cfg, state_dir, head)
        else:
            trainer = LayerSkipTrainer(model, chunks, cfg, state_dir)
        if not saved_chunks.is_file():
            state_dir.mkdir(parents=True, exist_ok=True)
            torch.save(chunks.cpu(), saved_chunks)
        resumed = trainer.load_state()
        if progress and resumed:
            print(f"adapt-base: continuing from step {trainer.step} of {cfg.max_steps} ({state_dir})")
        for _ in trainer.run(run_steps, run_seconds, progress):
            pass
        finished = trainer.step >= cfg.max_steps
        report = _report(trainer, name, command, resumed)
        if finished:
            _write_curve(out, trainer.curve)
            _write_folder(trainer, tokenizer, name, out, merge or cfg.method == "full", report, head_kind)
            shutil.rmtree(state_dir)  # done: the folder is the result
        else:  # the partial report and curve stay beside the state, so the folder never mixes two runs
            _write_curve(state_dir, trainer.curve)
            (state_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if trainer is not None:
            trainer.restore(trainer.merged)  # the LoRA layers out again, flags and mode as they came
    return AdaptResult(trainer.step, finished, report)


def check_adapt_out(out: Path, restart: bool) -> None:
    """Refuse an output folder that holds anything but an adapt-base run (a base model's own folder, another
    router), or a finished run unless `restart` (whose files are then replaced)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"{out} is a file: give a folder for the adapted router (created if missing).")
    entries = [p.name for p in out.iterdir() if not p.name.startswith(".")]
    if not entries:
        return
    config = out / CONFIG_NAME
    adapted = json.loads(config.read_text()).get(ADAPTED_KEY) if config.is_file() else None
    foreign = sorted(set(entries) - set(_own_files(out, adapted))) if adapted else sorted(entries)
    if foreign:
        raise ValueError(
            f"{out} holds other files ({', '.join(foreign[:4])}): give adapt-base a new or empty folder (it never "
            "writes into a model's or another router's folder)."
        )
    if not restart:
        raise ValueError(
            f"{out} already holds an adapted router: load it with EarlyExitRouter.from_pretrained({str(out)!r}), or "
            "pass restart=True (--restart) to train it again (its files are replaced)."
        )


def _own_files(out: Path, adapted: dict[str, Any]) -> list[str]:
    """The files of a finished adapt-base folder: the router's, its adapted base's, the reports."""
    return [CONFIG_NAME, WEIGHTS_NAME, "README.md", *adapted_files(out, adapted)]


def _clear(out: Path) -> None:
    """A restart: the saved state and a finished run's own files go (`check_adapt_out` let only those through)."""
    if (out / STATE_DIR).exists():
        shutil.rmtree(out / STATE_DIR)
    config = out / CONFIG_NAME
    if config.is_file():
        for name in _own_files(out, json.loads(config.read_text())[ADAPTED_KEY]):
            (out / name).unlink(missing_ok=True)


def _report(trainer: LayerSkipTrainer, name: str, command: str, resumed: bool) -> dict[str, Any]:
    cfg = trainer.cfg
    evaluated = [e for e in trainer.curve if "heldout" in e]
    return {
        "base_model": name,
        "library_version": __version__,
        "command": command,
        "config": asdict(cfg),
        "steps": trainer.step,
        "tokens_trained": trainer.step * cfg.batch_size * cfg.seq_len,
        "seconds": round(trainer.seconds, 1),
        "threads": torch.get_num_threads(),
        "bf16": trainer.bf16,
        "train_chunks": len(trainer.train),
        "heldout_chunks": min(len(trainer.heldout), EVAL_CHUNKS),
        "resumed": resumed,
        "trainable_parameters": sum(p.numel() for p in trainer.params),
        "heldout": evaluated[-1]["heldout"] if evaluated else None,
    }


def _write_curve(out: Path, curve: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / CURVE_NAME).write_text("".join(json.dumps(entry) + "\n" for entry in curve))
    _plot_curve(out / PLOT_NAME, curve)


def _plot_curve(path: Path, curve: list[dict[str, Any]]) -> None:
    """Loss per supervised layer and held-out exit agreement against tokens trained (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    layers = sorted({int(k) for entry in curve for k in entry["loss"]})
    for layer in layers:
        points = [(e["tokens"], e["loss"][str(layer)]) for e in curve if str(layer) in e["loss"]]
        if points:
            left.plot(*zip(*points), label=f"L{layer}", linewidth=0.8)
    left.set(xlabel="tokens trained", ylabel="KL to the original", yscale="log", title="loss per layer")
    if layers:
        left.legend()
    evaluated = [e for e in curve if "heldout" in e]
    if evaluated:
        xs = [e["tokens"] for e in evaluated]
        for layer in evaluated[-1]["heldout"]["exit_agreement"]:
            ys = [e["heldout"]["exit_agreement"][layer] for e in evaluated]
            right.plot(xs, ys, marker="o", label=f"L{layer}")
        right.plot(xs, [e["heldout"]["last_agreement"] for e in evaluated], marker="s", label="last vs original")
        right.legend(loc="center right")
    right.set(xlabel="tokens trained", ylabel="held-out top-1 agreement", ylim=(0, 1), title="held out")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _write_folder(
    trainer: LayerSkipTrainer,
    tokenizer: Any,
    name: str,
    out: Path,
    merged: bool,
    report: dict[str, Any],
    head_kind: str = "identity",
) -> None:
    """The router folder: the adapted base, the heads with the draft ranking (identity heads at the exits; a draft
    path's trained head at its exit), the report."""
    cfg, stack = trainer.cfg, trainer.stack
    model = trainer.model
    if merged:
        if cfg.method == "lora":
            model = model.merge_and_unload()
            trainer.merged = True  # the LoRA is in the weights now: nothing to unload
        model.save_pretrained(str(out))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
    else:
        model.save_pretrained(str(out))  # PEFT: adapter_config.json + adapter_model.safetensors (+ a README)
    head = getattr(trainer, "head", None)  # a draft path's trained head (None: the model's own)
    config = RouterConfig(
        exit_layers=list(cfg.exit_layers),
        adapter="identity" if head is None else head_kind,
        adapter_rank=getattr(getattr(head, "down", None), "out_features", RouterConfig.adapter_rank),
        draft_vocab_size=cfg.draft_vocab_size,
        heads_trained=True,
    )
    heads = build_heads(stack, config, config.exit_layers)
    heads.set_draft_token_ranking(trainer.ranking, stack.vocab_size)
    if head is not None:
        heads.adapter(cfg.exit_layers[0]).load_state_dict(head.state_dict())
    entry = {"format": "merged" if merged else "lora", "method": cfg.method, "base": name}
    if cfg.scope == "draft":
        entry.update(scope="draft", exit_layer=cfg.exit_layers[0])
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    save_router(out, config, heads, stack, name, adapted=entry)
