"""Verifying a token tree in one pass (verify mode, one sequence).

The current token and every node of the n-gram tier's tree (`routing/token_tree.py`) run through all layers as one
chunk: a node sits at the position its depth gives it and attends to the cached context and to its own path from the
root, nothing else (an attention mask built for the model's attention implementation, `_compat.tree_attention_mask`).
So each node's states, keys and values are exactly those a sequential pass over its path would compute. The full
head over the chunk gives the full model's logits after every node: from the root, the full model's token is chosen
(greedy or sampled, through the row's processors) and, while it is a child of the node, the walk goes on there; the
path walked is kept, the token chosen after it follows, and every layer's cache is compacted to the root's slot and
that path's slots, so it holds what a full forward pass over the kept tokens would.

An exit tree (`verify_exit_tree`) is an exit's chain of drafts with each draft's alternatives (its head's next
choices) as siblings: the alternatives first run the layers up to the exit, each seeing the context up to its
parent; then the chain's waiting states, the current token and the alternatives run the remaining layers as one
tree chunk, walked and compacted the same way.

A block adapter's context (its own cache at an exit) receives the states of the root and the kept path only.
Trees are used where nothing else keeps the chunk from being reordered: one sequence, every layer with full attention
(`tree_supported`). Batches and sliding-window layers draft chains.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from early_exit_router.decode.deep import head
from early_exit_router.decode.drafters import NGRAM_LAYER
from early_exit_router.decode.emit import append, make_final, row_ids
from early_exit_router.decode.state import DecodeState, VerifyCycle
from early_exit_router.models import _compat
from early_exit_router.routing.policy import TierKey
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
    stack = dec.stack
    q = dec.slots.length - 1  # the current token's slot: every layer holds the slots before it
    assert dec.pending == 0 and dec.fill.deep_len == q, "a tree is verified only where nothing waits"
    device = dec.slots.seq.device
    nodes = torch.tensor(tree.tokens, device=device).unsqueeze(0)
    ids = torch.cat([dec.slots.seq[:, q : q + 1], nodes], dim=1)  # (1, 1 + nodes)
    positions = _positions(dec, tree, q)
    hidden = stack.embed(ids, positions=positions)
    hidden, at_blocks = _deep_run(dec, tree, hidden, q, positions, first_segment=0)
    keys = (("ngram", tree.match), ("branch", tree.match))
    _keep_walked_path(dec, tree, hidden, q, at_blocks, keys, len(dec.exits), NGRAM_LAYER)


def exit_tree_supported(dec: DecodeState, i: int) -> bool:
    """Whether exit `i`'s drafts may bring alternatives into an exit tree (`verify_exit_tree`): a greedy tree-capable
    decode, and no block adapter at or before the exit, whose context the alternatives would pass through."""
    greedy = not dec.rows[0].selector.params.do_sample
    return greedy and dec.config.exit_branches > 0 and tree_supported(dec) and all(b > i for b in dec.fill.blocks)


def verify_exit_tree(dec: DecodeState, i: int, current: torch.Tensor) -> None:
    """End an exit tree's cycle in one pass: the chain exit `i` drafted, from the cycle's root (the slot its first
    draft was predicted from) to the current token, whose states wait at the exit, and each draft's alternatives
    (`Draft.alternatives`), siblings of that draft. The alternatives run the layers up to the exit first, each seeing
    the context up to its parent only; then every node runs the remaining layers as one tree chunk, and the full
    model's choices walk it as in `verify_tree`. `current`: (1, 1, hidden), the current token's states at the exit."""
    row, stack, fill = dec.rows[0], dec.stack, dec.fill
    assert dec.cycle is not None
    root, q = dec.cycle.start, dec.slots.length - 1
    drafted = q - root  # the chain's nodes: slots root+1..q (the current token is the last)
    assert fill.deep_len == root and all(b is None for j, b in enumerate(fill.buffers) if j != i + 1)
    tokens, parents = list(row.tokens[len(row.tokens) - drafted :]), list(range(-1, drafted - 1))
    for j in range(drafted):  # the draft at slot root+1+j was predicted from slot root+j: node j - 1
        draft = row.drafts.get(root + j)
        for token in draft.alternatives if draft is not None else ():
            tokens.append(token)
            parents.append(j - 1)
    tree = TokenTree(tuple(tokens), tuple(parents), (1.0,) * len(tokens), i)
    device = dec.slots.seq.device
    positions = _positions(dec, tree, root)  # (1, 1 + nodes)
    states = [fill.buffers[i + 1], current]  # the root and the drafts before the current token, then it
    fill.buffers[i + 1] = None
    if len(tokens) > drafted:  # the alternatives through the layers up to the exit, after the current token's slot
        leaves = torch.tensor(tokens[drafted:], device=device).unsqueeze(0)
        at = positions[:, 1 + drafted :]
        allowed = torch.zeros(leaves.shape[1], q + 1 + leaves.shape[1], dtype=torch.bool)
        for n, parent in enumerate(parents[drafted:]):
            allowed[n, : root + 2 + parent] = True  # the slots up to its parent's (root + 1 + parent)
            allowed[n, q + 1 + n] = True
        real = dec.slots.attention_mask(q + 1)
        if real is not None:
            allowed[:, : q + 1] &= real[0].bool().cpu()
        mask = _compat.tree_attention_mask(stack.config, allowed.unsqueeze(0).to(device), stack.dtype)
        start = fill.starts[i + 1]
        states.append(stack.run(stack.embed(leaves, positions=at), 0, start, fill.cache, at, attention_mask=mask))
    hidden = torch.cat(states, dim=1)  # (1, 1 + nodes, hidden)
    row.drop(drafted)  # the chain's tokens are appended again as far as the walk keeps them
    row.drafts.clear()
    dec.slots.length = root + 1
    hidden, at_blocks = _deep_run(dec, tree, hidden, root, positions, first_segment=i + 1)
    keys = (("exit", i), ("exit branch", i))
    _keep_walked_path(dec, tree, hidden, root, at_blocks, keys, i, dec.exits[i])


def _positions(dec: DecodeState, tree: TokenTree, root: int) -> torch.Tensor:
    """(1, 1 + nodes) positions of the root slot and of every node, at its depth after it."""
    depths = torch.tensor([0, *tree.depths], device=dec.slots.seq.device)
    return dec.slots.positions(root, root + 1) + depths


def _deep_run(
    dec: DecodeState, tree: TokenTree, hidden: torch.Tensor, root: int, positions: torch.Tensor, first_segment: int
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run the root and `tree`'s nodes (1, 1 + nodes, hidden) from segment `first_segment` through the last layer
    under the tree's mask (the layers hold the slots before `root`). Returns the final states and, per block
    adapter's exit on the way, the states there (the kept path's join the block's context)."""
    stack, fill = dec.stack, dec.fill
    allowed = tree_mask(tree, root, hidden.device, dec.slots.attention_mask(root + 1))
    mask = _compat.tree_attention_mask(stack.config, allowed, stack.dtype)
    at_blocks = {}
    start = fill.starts[first_segment]
    for i in sorted(b for b in fill.blocks if b >= first_segment):
        stop = fill.starts[i + 1]
        hidden = at_blocks[i] = stack.run(hidden, start, stop, fill.cache, positions, attention_mask=mask)
        start = stop
    return stack.run(hidden, start, stack.num_layers, fill.cache, positions, attention_mask=mask), at_blocks


def _keep_walked_path(
    dec: DecodeState,
    tree: TokenTree,
    hidden: torch.Tensor,
    q: int,
    at_blocks: dict[int, torch.Tensor],
    keys: tuple[TierKey, TierKey],
    tier: int,
    layer: int,
) -> None:
    """From the final states (1, 1 + nodes, hidden) of root slot `q` and `tree`'s nodes: walk the full model's
    choices, book the verdicts (`keys`: the first children's estimate and the alternatives'; `tier`: the counters'),
    append the kept path (at depth `layer`) and the token chosen after it, and compact every layer's cache and every
    block's context to the root and that path."""
    row, stack, device = dec.rows[0], dec.stack, hidden.device
    logits = head(dec, hidden)[0]  # (1 + nodes, vocab): the full model's prediction after the root and each node
    path, last = tree.walk(_chooser(dec, tree, logits, q))
    dec.passes.deep_passes += 1
    dec.passes.fill_positions += hidden.shape[1]

    # Verdicts: along the path, whether each node's first child was the full model's token (the chain's estimate)
    # and, where it was not but others were drafted, whether one of those was (the alternatives' estimate).
    first = tree.first_children()
    node, rejected = -1, False
    for step in range(len(path) + 1):
        children = [i for i, parent in enumerate(tree.parents) if parent == node]
        if not children:
            break
        taken = path[step] if step < len(path) else None
        ok = taken is not None and first[taken]
        dec.tracker.observe_draft(keys[0], ok)
        if not ok and len(children) > 1:
            dec.tracker.observe(keys[1], taken is not None)
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
        at = rows_before[j] + 1
        append(dec, torch.tensor([token], device=device), [token], layer if j < len(path) else dec.full_layer,
               logits[at : at + 1])  # fmt: skip
        appended += 1
    kept = path[: appended - 1]  # the last appended token is the next current one: no KV yet
    _compat.keep_slots_after(dec.fill.cache, q + 1, [q + 1 + i for i in kept])
    rows = torch.tensor([0] + [1 + i for i in kept], device=device)
    for i, states in at_blocks.items():
        dec.fill.blocks[i].push(states.index_select(1, rows), q, stack, dec.heads.adapter(dec.exits[i]))
    dec.fill.deep_len = q + 1 + len(kept)
    dec.routing.quality.add_tokens(0, appended)  # the full model's tokens, verified
    make_final(dec)
    dec.cycle = None


def _chooser(dec: DecodeState, tree: TokenTree, logits: torch.Tensor, q: int) -> Callable[[int, list[int]], int]:
    """The full model's token after a node, from its row of `logits` (1 + nodes, vocab): greedy without processors
    reads every node's argmax in one host sync; otherwise the row's selector chooses at each node the walk reaches,
    its processors seeing the ids up to that node. Sampling thus draws each kept token from the full model's law at
    its node, with its position's noise, and keeps a drafted child exactly when the draw is that child: a copied
    child x with probability p(x), and the output's law is the full model's."""
    row = dec.rows[0]
    selector = row.selector
    if not selector.params.do_sample and not selector.processors:
        choices = logits.argmax(dim=-1).tolist()
        return lambda node, path: choices[node + 1]
    before = row_ids(dec, 0, q + 1)  # (1, n): the ids up to the root, the current token
    position = len(row.new_tokens)  # the first node's: a node at depth d draws with position + d's noise

    def choose(node: int, path: list[int]) -> int:
        drafted = torch.tensor([[tree.tokens[i] for i in path]], dtype=before.dtype, device=before.device)
        noise = None
        if selector.params.do_sample:
            noise = row.noise_at(position + len(path), logits.shape[-1])
        return int(selector.choose(torch.cat([before, drafted], dim=1), logits[node + 1 : node + 2], noise))

    return choose
