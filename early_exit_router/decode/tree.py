"""Verifying a token tree in one pass (verify mode, one sequence).

The current token and every node of the n-gram tier's tree (`routing/token_tree.py`) run through all layers as one
chunk: a node sits at the position its depth gives it and attends to the cached context and to its own path from the
root, nothing else (an attention mask built for the model's attention implementation, `_compat.tree_attention_mask`).
So each node's states, keys and values are exactly those a sequential pass over its path would compute. The full
head over the chunk gives the full model's logits after every node: from the root, the full model's token is chosen
(greedy or sampled, through the row's processors) and, while it is a child of the node, the walk goes on there; the
path walked is kept, the token chosen after it follows, and every layer's cache is compacted to the root's slot and
that path's slots, so it holds what a full forward pass over the kept tokens would.

A block adapter's context (its own cache at an exit) receives the states of the root and the kept path only.
Trees are used where nothing else keeps the chunk from being reordered: one sequence, every layer with full attention
(`tree_supported`). Batches and sliding-window layers draft chains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from early_exit_router.decode.deep import head
from early_exit_router.decode.drafters import NGRAM_LAYER
from early_exit_router.decode.emit import append, row_ids
from early_exit_router.decode.state import DecodeState, VerifyCycle
from early_exit_router.models import _compat
from early_exit_router.routing.token_tree import TokenTree


def tree_supported(dec: DecodeState) -> bool:
    """Whether this decode can verify token trees (see the module docstring)."""
    if dec.mode != "verify" or len(dec.rows) != 1 or dec.config.ngram_tree_nodes < 2:
        return False
    stack = dec.stack
    full = all(kind == "full_attention" for kind in stack.mask_kinds)
    return full and _compat.tree_attention_mask(stack.config, torch.ones(1, 1, 1, dtype=torch.bool)) is not None


def tree_mask(tree: TokenTree, context: int, device: torch.device, real: torch.Tensor | None = None) -> torch.Tensor:
    """(1, 1 + nodes, context + 1 + nodes) booleans: the root (the current token) and every node see the `context`
    cached slots (those `real` (1, context + 1) marks, where given: padding and holes stay hidden), the root and their
    own path."""
    m = 1 + len(tree)
    allowed = torch.zeros(m, context + m, dtype=torch.bool)
    allowed[:, : context + 1] = True if real is None else real[0].bool().cpu()
    for i, path in enumerate(tree.ancestors()):
        allowed[i + 1, [context + 1 + j for j in path]] = True
    return allowed.unsqueeze(0).to(device)


def verify_tree(dec: DecodeState, tree: TokenTree) -> None:
    """Feed the current token with `tree`'s nodes through every layer in one pass, keep the path the full model's
    choices walk (greedy: the longest it agrees with), and append it and the token chosen after it. Nothing may be
    waiting."""
    row, stack = dec.rows[0], dec.stack
    q = dec.slots.length - 1  # the current token's slot: every layer holds the slots before it
    assert dec.pending == 0 and dec.fill.deep_len == q, "a tree is verified only where nothing waits"
    device = dec.slots.seq.device
    nodes = torch.tensor(tree.tokens, device=device).unsqueeze(0)
    ids = torch.cat([dec.slots.seq[:, q : q + 1], nodes], dim=1)  # (1, 1 + nodes)
    positions = dec.slots.positions(q, q + 1) + torch.tensor([0, *tree.depths], device=device)  # (1, 1 + nodes)
    hidden = stack.embed(ids, positions=positions)
    allowed = tree_mask(tree, q, device, dec.slots.attention_mask(q + 1))
    mask = _compat.tree_attention_mask(stack.config, allowed, stack.dtype)
    at_blocks = {}  # block adapters' exits: their states, of which the kept path's join the block's context
    start = 0
    for i in sorted(dec.fill.blocks):
        stop = dec.fill.starts[i + 1]
        hidden = at_blocks[i] = stack.run(hidden, start, stop, dec.fill.cache, positions, attention_mask=mask)
        start = stop
    hidden = stack.run(hidden, start, stack.num_layers, dec.fill.cache, positions, attention_mask=mask)
    logits = head(dec, hidden)[0]  # (1 + nodes, vocab): the full model's prediction after the root and each node
    path, last = tree.walk(_chooser(dec, tree, logits, q))
    key = ("ngram", tree.match)
    dec.passes.deep_passes += 1
    dec.passes.fill_positions += ids.shape[1]

    # Verdicts: along the path, whether each node's first child was the full model's token (the chain's estimate)
    # and, where it was not but others were drafted, whether one of those was (the alternatives' estimate).
    first = tree.first_children()
    tier, node, rejected = len(dec.exits), -1, False
    for step in range(len(path) + 1):
        children = [i for i, parent in enumerate(tree.parents) if parent == node]
        if not children:
            break
        taken = path[step] if step < len(path) else None
        ok = taken is not None and first[taken]
        dec.tracker.observe(key, ok)
        if not ok and len(children) > 1:
            dec.tracker.observe(("branch", key[1]), taken is not None)
        row.counters.judged[tier] += 1
        row.counters.accepted[tier] += int(taken is not None)
        rejected = taken is None
        node = taken if taken is not None else node
    row.counters.rejected += int(rejected)
    row.counters.verify_passes += 1
    row.drafted += len(path)
    if rejected:
        dec.rule.end_block(dec.routing)

    # Append the kept path and the full model's token after it; a token that ends generation ends them.
    dec.cycle = VerifyCycle(q)  # nothing lands as final before the cache is compacted below
    rows_before = [-1] + path  # the node each appended token follows (-1: the root); its logits row is that + 1
    appended = 0
    for j, token in enumerate([tree.tokens[i] for i in path] + [last]):
        if row.stop_at is not None:
            break
        layer = NGRAM_LAYER if j < len(path) else dec.full_layer
        at = rows_before[j] + 1
        append(dec, torch.tensor([token], device=device), [token], layer, logits[at : at + 1])
        appended += 1
    kept = path[: appended - 1]  # the last appended token is the next current one: no KV yet
    _compat.keep_slots_after(dec.fill.cache, q + 1, [q + 1 + i for i in kept])
    rows = torch.tensor([0] + [1 + i for i in kept], device=device)
    for i, states in at_blocks.items():
        dec.fill.blocks[i].push(states.index_select(1, rows), q, stack, dec.heads.adapter(dec.exits[i]))
    dec.fill.deep_len = q + 1 + len(kept)
    dec.routing.quality.add_tokens(0, appended)  # the full model's tokens, verified
    row.final = len(row.tokens)
    dec.cycle = None


def _chooser(dec: DecodeState, tree: TokenTree, logits: torch.Tensor, q: int) -> Callable[[int, list[int]], int]:
    """The full model's token after a node, from its row of `logits` (1 + nodes, vocab): greedy without processors
    reads every node's argmax in one host sync; otherwise the row's selector chooses at each node the walk reaches,
    its processors seeing the ids up to that node. Sampling thus draws each kept token from the full model's law at
    its node, and keeps a drafted child exactly when the draw is that child: for copied drafts, this is the
    speculative-sampling rule (accept x with probability p(x), else draw from p without x), so the output's law is
    the full model's."""
    selector = dec.rows[0].selector
    if not selector.params.do_sample and not selector.processors:
        choices = logits.argmax(dim=-1).tolist()
        return lambda node, path: choices[node + 1]
    before = row_ids(dec, 0, q + 1)  # (1, n): the ids up to the root, the current token

    def choose(node: int, path: list[int]) -> int:
        drafted = torch.tensor([[tree.tokens[i] for i in path]], dtype=before.dtype, device=before.device)
        return int(selector.choose(torch.cat([before, drafted], dim=1), logits[node + 1 : node + 2]))

    return choose
