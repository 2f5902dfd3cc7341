"""Token trees: several continuations of a matched suffix drafted as one tree and verified in one pass."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.decode.tree import tree_mask, tree_supported, verify_tree
from early_exit_router.models import _compat
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.ngram import (
    NO_PROPOSAL,
    ContextIndex,
    Proposal,
    SuffixStore,
    prefer_stored,
    propose_tree,
)
from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy
from early_exit_router.routing.token_tree import build_tree

from .conftest import assert_cache_matches_full_forward, prompt, tiny_llama

FLAT = CostModel.synthetic(6, [1.0] * 16, [6.0] * 16, draft_head_ms=0.1)  # a pass costs the same at any width
# each position adds 30% of a plain step: a chain's likely tokens pay for themselves, unlikely alternatives do not
SLOPED = CostModel.synthetic(6, [0.7 + 0.3 * m for m in range(1, 17)], [4.2 + 1.8 * m for m in range(1, 17)])


def test_continuations_merge_where_they_agree_and_the_first_is_the_chain():
    tree = build_tree([([5, 6, 7], 1.0), ([5, 6, 8], 1.0), ([9], 2.0), ([], 5.0)], match=3)
    assert tree.tokens == (5, 6, 7, 8, 9) and tree.parents == (-1, 0, 1, 1, -1)
    assert tree.weights == (2.0, 2.0, 1.0, 1.0, 2.0) and tree.first_children() == [True, True, True, False, False]
    assert tree.depths == [1, 2, 3, 3, 1] and tree.branches and tree.chain() == [5, 6, 7]
    assert tree.ancestors() == [[0], [0, 1], [0, 1, 2], [0, 1, 3], [4]]
    assert not build_tree([([1, 2, 3], 1.0), ([1, 2], 1.0)], 2).branches  # a prefix of another: one chain
    # the full model's token after the root, then after each node: the walk follows the children that match
    assert tree.accepted_path([5, 6, 8, 0, 0, 0]) == [0, 1, 3]
    assert tree.accepted_path([9, 0, 0, 0, 0, 4]) == [4]
    assert tree.accepted_path([1, 0, 0, 0, 0, 0]) == []


def test_a_trees_first_path_is_costed_as_its_chain_and_the_alternatives_share_the_rest():
    tree = build_tree([([1, 2, 3], 1.0), ([1, 5], 3.0), ([6, 7], 1.0), ([8], 3.0)], match=2)
    a, b = 0.6, 0.5
    p = tree.path_probabilities(a, b)
    assert tree.tokens == (1, 2, 3, 5, 6, 7, 8)
    assert p[:3] == pytest.approx([a, a * a, a**3])  # the chain: a^depth
    assert p[3] == pytest.approx(a * (1 - a) * b)  # the only alternative after 1
    assert p[4] == pytest.approx((1 - a) * b * 1 / 4) and p[6] == pytest.approx((1 - a) * b * 3 / 4)
    assert p[5] == pytest.approx(p[4] * a)  # a first child along an alternative continues as a chain
    for k in range(1, len(tree) + 1):
        kept = tree.top(k, a, b)
        assert len(kept) == k and all(q < i for i, q in enumerate(kept.parents))  # parents kept, before children
        assert kept.tokens[0] == 1
    assert build_tree([([1, 2], 1.0), ([3], 1.0)], 2).top(1, 0.5, 1.0).tokens == (1,)  # a tie keeps the earlier


def test_the_indexes_list_every_continuation_latest_first():
    tokens = [3, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 3, 1, 2]
    index = ContextIndex(4, 2)
    found = index.continuations(tokens, 3, limit=8)
    # [3, 1, 2] occurred once before; [1, 2] also at two other places, latest first
    assert found == [([3, 9, 1], 3, 3), ([3, 7, 3], 2, 2), ([4, 8, 1], 2, 2)]
    assert index.continuations(tokens, 3, limit=2) == found[:2]
    assert index.lookup(tokens, 3) == found[0]
    store = SuffixStore(1000, 4, 2)
    store.add([5, 1, 2, 6, 6])
    store.add([1, 2, 5, 5])
    store.add([9, 3, 1, 2, 8])
    assert store.continuations([7, 3, 1, 2], 2, limit=8) == [([8], 3, 3), ([5, 5], 2, 2), ([6, 6], 2, 2)]
    assert store.lookup([7, 3, 1, 2], 2) == ([8], 3, 3)
    # the tree's first path is the chain's proposal; equal matches merge both sources
    proposal, tree = propose_tree(found, store, tokens, 3, 8, depth=16)
    assert proposal == prefer_stored(index.lookup(tokens, 3), store, tokens, 3) == ([3, 9, 1], 3, 3)
    assert tree.match == 3 and tree.chain() == [3, 9, 1]
    assert tree.tokens == (3, 9, 1, 7, 3, 4, 8, 1, 8, 5, 5, 6, 6)  # the context's, then the store's
    assert tree.weights[:4] == (1.5, 1.0, 1.0, 0.5)  # a match one token shorter weighs half
    nothing = ContextIndex(4, 2).continuations([1, 2, 3], 3, 8)
    assert nothing == [] and propose_tree(nothing, None, [1, 2, 3], 3, 8, 16) == (NO_PROPOSAL, None)
    assert propose_tree(found, store, tokens, 3, 8, depth=2)[1].tokens == (3, 9, 7, 4, 8, 8, 5, 5, 6, 6)


def test_the_policy_drafts_trees_where_positions_are_cheap_and_chains_where_not():
    tree = build_tree([([1, 2, 3, 4, 5, 6], 1.0), ([1, 2, 7, 8, 9, 10], 1.0), ([11, 12, 13], 1.0)], match=3)
    proposal = Proposal(tree.chain(), tree.match)
    tracker = AcceptanceTracker(prior=0.6)
    flat = DraftPolicy(FLAT, [], [], tree_nodes=16).plan(tracker, 8, [proposal], exits=False, tree=tree)
    assert flat.kind == "tree" and flat.tree is not None and len(flat.tree) == len(tree) == flat.max_draft
    sloped = DraftPolicy(SLOPED, [], [], tree_nodes=16).plan(tracker, 8, [proposal], exits=False, tree=tree)
    assert sloped.kind == "ngram" and sloped.tree is None
    capped = DraftPolicy(FLAT, [], [], tree_nodes=8).plan(tracker, 8, [proposal], exits=False, tree=tree)
    assert capped.kind == "tree" and len(capped.tree) == 8
    # four nodes would hold a better alternative than the chain's fourth token, but lose its last three
    assert DraftPolicy(FLAT, [], [], tree_nodes=4).plan(tracker, 8, [proposal], exits=False, tree=tree).kind == "ngram"
    assert DraftPolicy(FLAT, [], [], tree_nodes=0).plan(tracker, 8, [proposal], exits=False, tree=tree).kind == "ngram"
    assert DraftPolicy(FLAT, [], [], tree_nodes=16).plan(tracker, 8, [proposal], exits=False).kind == "ngram"


def _verify(decoder, tree):
    with torch.inference_mode():  # as a decoder's step runs it
        verify_tree(decoder, tree)


def _decoder_after_prefill(router, ids):
    decoder = router.decoder(mode="verify")
    request = DecodeRequest(max_new_tokens=32, eos_token_ids=frozenset())
    row = decoder.join(ids, request, TokenSelector(SamplingParams(), router.stack.device))
    return decoder, row


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("exit_layers", [[1, 3], [2]])
def test_a_verified_tree_keeps_the_path_the_model_takes_and_the_cache_of_a_full_pass(attention, exit_layers):
    model = tiny_llama(2)
    model.config._attn_implementation = attention
    ids = prompt(4, length=7)
    greedy = model.generate(ids, max_new_tokens=7, do_sample=False)[0, ids.shape[1] :].tolist()
    adapter = "block" if exit_layers == [2] else "postnorm"  # a block adapter keeps a context of its own
    router = EarlyExitRouter.from_model(model, exit_layers=exit_layers, adapter=adapter)
    decoder, row = _decoder_after_prefill(router, ids)
    assert tree_supported(decoder) and row.tokens[-1] == greedy[0]
    wrong = [(t + 1) % 96 for t in greedy]
    # The model's continuation is the second branch, under a wrong first branch that shares nothing with it, and
    # a wrong sibling splits off it after two tokens.
    tree = build_tree([(wrong[1:5], 2.0), (greedy[1:5], 1.0), (greedy[1:3] + wrong[3:5], 1.0)], match=2)
    _verify(decoder, tree)
    assert row.tokens[ids.shape[1] :] == greedy[:6]  # the 4 nodes of the path, then the full model's next token
    assert row.depth == [5, -1, -1, -1, -1, 5]
    sequences = torch.tensor([row.tokens])
    assert_cache_matches_full_forward(model, sequences, decoder.fill.cache)
    assert len(decoder.fill.blocks) == (adapter == "block")
    for block in decoder.fill.blocks.values():
        assert block.end == sequences.shape[1] - 1  # the kept path's states, in order
    assert decoder.stats(row).drafts_judged == 4 and decoder.stats(row).rejected_drafts == 0
    # a tree the model refuses at once: only its own token follows
    _verify(decoder, build_tree([([wrong[6]], 1.0), ([(greedy[6] + 2) % 96], 1.0)], 2))
    assert row.tokens[ids.shape[1] :] == greedy[:7] and decoder.stats(row).rejected_drafts == 1
    assert_cache_matches_full_forward(model, torch.tensor([row.tokens]), decoder.fill.cache)


def test_a_token_that_ends_generation_ends_the_kept_path():
    model = tiny_llama(2)
    ids = prompt(4, length=7)
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    decoder = router.decoder(mode="verify")
    request = DecodeRequest(max_new_tokens=32, eos_token_ids=frozenset({greedy[2]}))  # the path's second node
    row = decoder.join(ids, request, TokenSelector(SamplingParams(), router.stack.device))
    _verify(decoder, build_tree([(greedy[1:5], 1.0), ([(greedy[1] + 1) % 96], 1.0)], 2))
    assert row.output() == greedy[:3] and row.tokens[ids.shape[1] :] == greedy[:3]
    assert_cache_matches_full_forward(model, torch.tensor([row.tokens]), decoder.fill.cache)


def test_the_tree_mask_lets_a_node_see_the_context_the_root_and_its_path():
    tree = build_tree([([5, 6], 1.0), ([7], 1.0)], 2)
    allowed = tree_mask(tree, 2, torch.device("cpu"))[0].int().tolist()
    # columns: 2 cached slots, the root, nodes 5, 6, 7
    assert allowed == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    config = tiny_llama(0).config
    config._attn_implementation = "eager"
    eager = _compat.tree_attention_mask(config, torch.tensor([[[True, False]]]), torch.float32)
    assert eager.shape == (1, 1, 1, 2) and eager[0, 0, 0, 0] == 0 and eager[0, 0, 0, 1] < -1e30
    config._attn_implementation = "flash_attention_2"
    assert _compat.tree_attention_mask(config, torch.tensor([[[True]]])) is None


def repetitive_prompt(seed: int, length: int = 48, symbols: int = 4) -> torch.Tensor:
    """A prompt over a few symbols: short n-grams recur with different continuations."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1 + symbols, (1, length), generator=g)


@pytest.mark.parametrize("seed", range(6))
def test_tree_drafting_is_token_identical_to_greedy_with_the_cache_of_a_full_pass(seed):
    model = tiny_llama(seed % 3)
    ids = repetitive_prompt(seed)
    ref = model.generate(ids, max_new_tokens=40, do_sample=False)
    # single-token matches: the random model's own tokens recur with different continuations, so trees branch
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], acceptance_prior=0.5, ngram_min_size=1)
    router.cost_model = FLAT  # where positions cost nothing, a tree that branches is always drafted
    out = router.generate(ids, max_new_tokens=40, mode="verify")
    assert out.stats.policy_cycles.get("tree", 0) >= 1
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    chains = router.generate(ids, max_new_tokens=40, mode="verify", config={"ngram_tree_nodes": 0})
    assert "tree" not in chains.stats.policy_cycles and torch.equal(chains.sequences, ref)
    # left padding (a batch of one with a mask): the padded slots stay hidden from every node
    padded = torch.cat([torch.full((1, 3), 7), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    out = router.generate(padded, max_new_tokens=40, mode="verify", attention_mask=mask)
    assert out.stats.policy_cycles.get("tree", 0) >= 1 and torch.equal(out.sequences[:, 3:], ref)


def test_logits_processors_see_each_nodes_own_path():
    """A repetition penalty reads the ids before each token: at a node, the context and that node's path."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model = tiny_llama(0)
    ids = repetitive_prompt(3)
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    ref = model.generate(ids, max_new_tokens=40, do_sample=False, logits_processor=penalty)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], acceptance_prior=0.5, ngram_min_size=1)
    router.cost_model = FLAT
    out = router.generate(ids, max_new_tokens=40, mode="verify", logits_processor=penalty)
    assert out.stats.policy_cycles.get("tree", 0) >= 1
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_trees_stay_off_where_the_chunk_cannot_be_reordered():
    model = tiny_llama(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    ids = repetitive_prompt(1)
    decoder, _ = _decoder_after_prefill(router, ids)
    assert tree_supported(decoder)
    sampled = router.decoder(mode="verify")
    request = DecodeRequest(max_new_tokens=8, eos_token_ids=frozenset())
    sampled.join(ids, request, TokenSelector(SamplingParams(do_sample=True, seed=0), router.stack.device))
    assert tree_supported(sampled)  # a sampled walk keeps the full model's law (test_verify_sampling.py)
    exit_mode = router.decoder(mode="exit")
    exit_mode.join(ids, request, TokenSelector(SamplingParams(), router.stack.device))
    assert not tree_supported(exit_mode)
    model.config._attn_implementation = "flash_attention_2"
    assert not tree_supported(decoder)


def test_sliding_window_layers_draft_chains_and_stay_exact():
    from .test_architectures import build

    model = build("mistral-sliding")
    ids = repetitive_prompt(2)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], acceptance_prior=0.5, ngram_min_size=1)
    router.cost_model = FLAT
    out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert "tree" not in out.stats.policy_cycles and out.stats.policy_cycles.get("ngram", 0) > 0
    assert torch.equal(out.sequences, ref)
