"""What a whole decode returns (`GenerationOutput`), and running one decode to its end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from early_exit_router.decode.loop import Decoder
from early_exit_router.decode.noise import RowByRow
from early_exit_router.decode.sampling import TokenSelector
from early_exit_router.decode.stats import GenerationStats, combined_stats
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.models import _compat


@dataclass
class GenerationOutput:
    """What `EarlyExitRouter.generate` returns."""

    sequences: torch.LongTensor  # (b, prompt + new), like HF generate (rows padded after their EOS)
    stats: GenerationStats
    logits: tuple[torch.Tensor, ...] | None = None  # per new token, (1, vocab) raw logits it was chosen from
    cache: Any = None  # the KV cache: every layer holds sequences[:, :-1], as a full forward pass would
    depths: list = field(default_factory=list)  # per new token: the 0-based layer it left at (-1: n-gram tier);
    # for a batch, one such list per row
    row_stats: list[GenerationStats] | None = None  # a batch's per-row statistics (`stats` then sums the rows)


@torch.no_grad()
def run_to_end(
    decoder: Decoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    request: DecodeRequest,
    selector: TokenSelector,
) -> GenerationOutput:
    """Decode (b, n) left-padded prompts to their ends with one request and selector for every row."""
    b = input_ids.shape[0]
    decoder.prefill(input_ids, attention_mask, [request] * b, [selector.for_row(r, b) for r in range(b)])
    while not decoder.finished:
        decoder.step()
    cache = decoder.finish()
    outputs = [row.output() for row in decoder.rows]
    sequences = padded_sequences(input_ids, outputs, decoder.pad_token_id)
    stats = [decoder.stats(row) for row in decoder.rows]
    depths = [row.depth[: len(out)] for row, out in zip(decoder.rows, outputs)]
    if b == 1 and bool(attention_mask.all()):
        row = decoder.rows[0]
        logits = tuple(_compat.released(t) for t in row.logits[: len(outputs[0])]) if request.output_logits else None
        return GenerationOutput(sequences, stats[0], logits, cache, depths[0])
    return GenerationOutput(sequences, combined_stats(stats), None, cache, depths, stats)


def run_rows_alone(
    decode_one: Callable[..., GenerationOutput],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad: int,
    request: DecodeRequest,
    selector: TokenSelector,
) -> GenerationOutput:
    """A left-padded batch decoded one row after another by `decode_one(ids, mask, request=..., selector=...,
    pad_token_id=...)`, in a batch's output layout (for rows that cannot share a decoder; no cache). The caller's
    processors and criteria still see each row's padding, and sampling each row's draws, as they would in the
    batch (`noise.RowByRow`)."""
    outputs, rows, depths = [], [], []
    b = input_ids.shape[0]
    noise = RowByRow(selector, input_ids.device)
    for r in range(b):
        real = attention_mask[r].bool()
        ids = input_ids[r : r + 1, real]  # (1, n_r): the row without its left padding
        padding = input_ids[r : r + 1, ~real]  # (1, k): the padding
        mine = selector.for_row(r, b).after_padding(padding).alone_in_batch(r, b)
        noise.before_row()
        out = decode_one(ids, torch.ones_like(ids), request=request.after_padding(padding), selector=mine,
                         pad_token_id=pad)  # fmt: skip
        outputs.append(out.sequences[0, ids.shape[1] :])
        noise.after_row(len(outputs[-1]))
        rows.append(out.stats)
        depths.append(list(out.depths))
    noise.finish()
    combined = combined_stats(rows, one_after_another=True)
    return GenerationOutput(padded_sequences(input_ids, outputs, pad), combined, None, None, depths, rows)


def padded_sequences(input_ids: torch.Tensor, outputs: list[Any], pad_token_id: int) -> torch.Tensor:
    """(b, n) prompts and each row's new tokens -> (b, n + longest) sequences, short rows padded after their end."""
    b, n = input_ids.shape
    width = max(len(o) for o in outputs)
    sequences = torch.full((b, n + width), pad_token_id, dtype=torch.long, device=input_ids.device)
    sequences[:, :n] = input_ids
    for r, out in enumerate(outputs):
        sequences[r, n : n + len(out)] = torch.as_tensor(out, dtype=torch.long)
    return sequences
