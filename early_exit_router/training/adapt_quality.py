"""How an adapted base compares with its original, on held-out text.

- `last_agreement`: the adapted model's top-1 equals the original's (teacher-forced);
- `nll_original` / `nll_adapted`: next-token negative log-likelihood of the text under each;
- per exit: the exit's top-1 (through the model's own head, over the trimmed draft vocabulary where one is given, as
  the router drafts) equals the same model's last layer's: what a greedy draft from that exit gets accepted at,
  before (the original) and after (the adapted model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from early_exit_router.heads.draft import DraftHead, draft_token_ranking
from early_exit_router.models.discovery import stack_for
from early_exit_router.training.layerskip import LayerTaps

BATCH = 4  # chunks per forward pass: a chunk's logits over a 49k vocabulary are 50 MB in float32


@torch.no_grad()
def measure(model: nn.Module, exits: list[int], chunks: torch.Tensor, draft: DraftHead | None) -> dict[str, Any]:
    """Plain forwards (no layer dropout) of `model` over `chunks`: its top-1, the text's NLL, each exit's top-1."""
    stack = stack_for(model)
    model.eval()
    taps = LayerTaps(stack.layers)
    tops, nlls, exit_tops = [], [], {e: [] for e in exits}
    for start in range(0, len(chunks), BATCH):
        ids = chunks[start : start + BATCH].to(stack.device)
        with taps.tapping(exits) as outputs:
            logits = model(input_ids=ids, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        nlls.append(-logp.gather(-1, ids[:, 1:, None]).flatten().cpu())
        tops.append(logits.argmax(-1).cpu())
        for e in exits:
            normed = stack.final_norm(outputs[e])
            if draft is None:
                exit_tops[e].append(stack.unembed(normed).argmax(-1).cpu())
            else:
                exit_tops[e].append(draft.token_ids[stack.finish_logits(draft(normed)).argmax(-1)].cpu())
    return {
        "top1": torch.cat(tops),
        "nll": float(torch.cat(nlls).mean()),
        "exits": {e: torch.cat(v) for e, v in exit_tops.items()},
    }


def ranking_on(model: nn.Module, chunks: torch.Tensor) -> torch.Tensor:
    """(vocab,) token ids by how often `model` predicts them on `chunks`: the trimmed draft head's order."""
    return draft_token_ranking(measure(model, [], chunks, None)["top1"], stack_for(model).vocab_size)


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The adapted model (`after`) against the original (`before`), each `measure`d on the same chunks with the
    same exits: see the module's docstring."""
    exits = list(before["exits"])

    def agree(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(float((a == b).float().mean()), 4)

    return {
        "last_agreement": agree(after["top1"], before["top1"]),
        "nll_original": round(before["nll"], 4),
        "nll_adapted": round(after["nll"], 4),
        "exit_agreement": {str(e): agree(after["exits"][e], after["top1"]) for e in exits},
        "exit_agreement_original": {str(e): agree(before["exits"][e], before["top1"]) for e in exits},
        "positions": int(before["top1"].numel()),
    }


def quality_rows(held: dict[str, Any]) -> list[str]:
    """`compare_models`' figures as Markdown table rows (a header and one row per figure)."""
    rows = [
        "| held out | original | adapted |",
        "|---|---|---|",
        f"| last layer: top-1 agreement with the original | 1.000 | {held['last_agreement']:.3f} |",
    ]
    if "nll_adapted" in held:  # a draft path leaves the model, and so the text's NLL, as it was
        rows.append(f"| NLL of the text | {held['nll_original']:.3f} | {held['nll_adapted']:.3f} |")
    for layer, after in held["exit_agreement"].items():
        before = held["exit_agreement_original"][layer]
        rows.append(f"| exit L{layer}: top-1 agreement with the model's last layer | {before:.3f} | {after:.3f} |")
    return rows


def against_original(
    router: Any, sources: dict[str, list[list[int]]], chunk_len: int = 128
) -> tuple[str, dict[str, Any]]:
    """An adapted router's model against its original base (loaded once more, from the name adapt-base recorded) on
    each source's token sequences, the exits read through the router's trimmed draft head: (tables, figures)."""
    from early_exit_router.models.loading import load_base_model
    from early_exit_router.training.hidden_states import cut_chunks

    base = router.adapted_from[1]["base"]
    try:
        original = load_base_model(base, router.stack.dtype, router.stack.device)[0]
    except (OSError, ValueError) as exc:
        return f"the adapted base's original ({base}) could not be loaded to compare with: {exc}", {}
    draft = router.heads.draft_head(router.stack, router.config.draft_vocab_size, router.config.half_draft_head)
    out, figures = [], {}
    for name, sequences in sources.items():
        chunks = cut_chunks(sequences, chunk_len)
        if not len(chunks):
            out += [f"{name}: under {chunk_len} tokens, not compared with the original", ""]
            continue
        before = measure(original, router.exit_layers, chunks, draft)
        with router.disabled() as adapted:
            after = measure(adapted, router.exit_layers, chunks, draft)
        figures[name] = compare(before, after)
        out += [f"{name}: the adapted base against its original ({base}), {figures[name]['positions']} positions"]
        out += [*quality_rows(figures[name]), ""]
    return "\n".join(out), figures


@torch.no_grad()
def draft_path_agreement(
    router: Any, sources: dict[str, list[list[int]]], chunk_len: int = 128
) -> tuple[str, dict[str, Any]]:
    """A draft-path router's drafts against its model (teacher-forced) on each source's token sequences: the top-1 of
    the draft path (the adapted copies of layers 0..E and their head, over the trimmed draft vocabulary) and of the
    model's own layers 0..E through the same head, each against the model's: (tables, figures)."""
    from early_exit_router.heads.draft import draft_logits, trimmed_top1
    from early_exit_router.models.architecture import run_in_place_of
    from early_exit_router.training.hidden_states import cut_chunks

    stack, path = router.stack, router.draft_path
    at = path.exit_layer
    head = router.heads.adapter(at) if at in router.exit_layers else None
    draft = router.heads.draft_head(stack, router.config.draft_vocab_size, router.config.half_draft_head)

    def top1(hidden: torch.Tensor) -> torch.Tensor:
        logits = draft_logits(stack, head, draft, hidden, trimmed=True)
        return logits.argmax(-1) if draft is None else trimmed_top1(logits, draft.token_ids)

    out, figures = [], {}
    for name, sequences in sources.items():
        chunks = cut_chunks(sequences, chunk_len).to(stack.device)
        if not len(chunks):
            continue
        hits, total = {"draft path": 0, "own layers": 0}, 0
        for ids in chunks.split(BATCH):
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
            with router.disabled() as model:
                target = model(input_ids=ids, use_cache=False).logits.argmax(-1)
            embedded = stack.embed(ids)
            adapted = run_in_place_of(stack, path.layers, embedded, stack.new_cache(), positions)
            own = stack.run(embedded, 0, at + 1, stack.new_cache(), positions)
            hits["draft path"] += int((top1(adapted) == target).sum())
            hits["own layers"] += int((top1(own) == target).sum())
            total += target.numel()
        figures[name] = {label: round(n / total, 4) for label, n in hits.items()} | {"positions": total}
        out += [
            f"{name}: exit L{at}'s drafts against the model's top-1, {total} positions",
            "| layers 0..E | agreement |",
            "|---|---|",
            f"| the draft path's adapted copies | {figures[name]['draft path']:.3f} |",
            f"| the model's own, same head | {figures[name]['own layers']:.3f} |",
            "",
        ]
    return "\n".join(out), figures
