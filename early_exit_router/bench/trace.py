"""`generate --trace`: the generated text with the depth each token left at.

In a colour terminal every token is coloured by its exit; elsewhere (pipes, files, `NO_COLOR`) a plain marker
such as `[L12]` opens each run of tokens that left at the same depth, so the text stays readable and greppable.
The point is to see where the shallow exits take over and where the deep layers come back (stitching problems
show up right after those switches).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TextIO

from early_exit_router.decode.drafters import NGRAM_LAYER

# ANSI foreground colours for exits, shallowest first; the full depth stays uncoloured, the n-gram tier magenta
_EXIT_COLOURS = ("\033[32m", "\033[33m", "\033[36m", "\033[34m", "\033[31m")
_NGRAM_COLOUR = "\033[35m"
_RESET = "\033[0m"


def _depth_colours(exit_layers: Sequence[int]) -> dict[int, str]:
    """ANSI colour per shallow depth: the exits in order, then the n-gram tier."""
    colours = {layer: _EXIT_COLOURS[i % len(_EXIT_COLOURS)] for i, layer in enumerate(exit_layers)}
    colours[NGRAM_LAYER] = _NGRAM_COLOUR
    return colours


def depth_label(layer: int, num_layers: int) -> str:
    """'full', 'ngram' or 'L<layer>'."""
    if layer == num_layers - 1:
        return "full"
    if layer == NGRAM_LAYER:
        return "ngram"
    return f"L{layer}"


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    return hasattr(stream, "isatty") and stream.isatty() and "NO_COLOR" not in os.environ


def _token_texts(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token's text, such that their concatenation decodes like the whole sequence.

    Decoding prefixes (not single tokens) keeps multi-byte characters and leading spaces right.
    """
    texts, previous = [], ""
    for end in range(1, len(token_ids) + 1):
        decoded = tokenizer.decode(token_ids[:end], skip_special_tokens=False)
        if decoded.endswith("\ufffd"):  # an incomplete multi-byte character: wait for its other bytes
            texts.append("")
            continue
        texts.append(decoded[len(previous) :])
        previous = decoded
    return texts


def render_trace(
    tokenizer: Any, token_ids: Sequence[int], depths: Sequence[int], num_layers: int, exit_layers: Sequence[int]
) -> tuple[str, str]:
    """(coloured text, plain text) of the generated tokens, each marked with the depth it left at."""
    if len(token_ids) != len(depths):
        raise ValueError(f"{len(token_ids)} tokens but {len(depths)} depths: pass GenerationOutput.depths.")
    colours = _depth_colours(exit_layers)
    coloured, plain = [], []
    current = None
    for text, layer in zip(_token_texts(tokenizer, list(token_ids)), depths):
        colour = colours.get(layer, "")
        coloured.append(f"{colour}{text}{_RESET}" if colour else text)
        if layer != current:
            plain.append(f"[{depth_label(layer, num_layers)}]")
            current = layer
        plain.append(text)
    return "".join(coloured), "".join(plain)


def trace_legend(num_layers: int, exit_layers: Sequence[int], depths: Sequence[int], colour: bool) -> str:
    """One line naming each depth, with its colour (or marker) and how many tokens left there."""
    colours = _depth_colours(exit_layers)
    parts = []
    for layer in [NGRAM_LAYER, *exit_layers, num_layers - 1]:
        count = sum(1 for d in depths if d == layer)
        if layer == NGRAM_LAYER and count == 0:
            continue
        label = f"{depth_label(layer, num_layers)}: {count}"
        parts.append(f"{colours.get(layer, '')}{label}{_RESET}" if colour and layer in colours else f"[{label}]")
    return "depths: " + "  ".join(parts)
