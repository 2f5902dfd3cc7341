"""Verify mode with sampling: the speculative-sampling rule makes the output distribution the full model's."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.routing.costs import CostModel

from .conftest import ALWAYS_EXIT, VOCAB, prompt, tiny_llama


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def second_token_law(
    router, ids: torch.Tensor, temperature: float, runs: int, cycles: dict[str, int] | None = None
) -> tuple[torch.Tensor, int]:
    """The second new token's empirical law over `runs` seeds of verify-mode sampling, and the drafts judged
    (`cycles`, where given, gathers the cost policy's cycles per plan kind)."""
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    drafted = 0
    for seed in range(runs):
        out = router.generate(ids, 2, mode="verify", do_sample=True, temperature=temperature, top_k=0, seed=seed)
        counts[out.sequences[0, ids.shape[1] + 1]] += 1
        drafted += out.stats.drafts_judged
        for kind, n in out.stats.policy_cycles.items():
            if cycles is not None:
                cycles[kind] = cycles.get(kind, 0) + n
    return counts / runs, drafted


@pytest.mark.parametrize("draft_vocab_size", [0, 48])
def test_second_token_distribution_matches_the_full_model(draft_vocab_size):
    """Also with a trimmed draft head: q is zero outside its token set, and the rule still yields p."""
    model = tiny_llama(0, peaky=20.0)  # peaked laws: 1500 samples resolve them well (expected noise TV ~0.05)
    temperature = 0.5
    ids = prompt(0, length=4)
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].double() / temperature, -1)  # (vocab,) first token, full model
        # Every possible first token, batched: the full model's and the exit-2 logit lens' second-token laws.
        both = torch.cat([ids.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        out = model(both, output_hidden_states=True)
        p2 = torch.softmax(out.logits[:, -1].double() / temperature, -1)  # (vocab, vocab)
        lens = model.lm_head(model.model.norm(out.hidden_states[3][:, -1]))
        q2 = torch.softmax(lens.double() / temperature, -1)
    exact = p1 @ p2  # marginal law of the second token under plain sampling
    drafted = p1 @ q2  # ... and under the exit head alone, had nothing been verified

    router = EarlyExitRouter.from_model(
        model, exit_layers=[2], max_pending=10, **{**ALWAYS_EXIT, "draft_vocab_size": draft_vocab_size}
    )
    runs = 1500
    empirical, drafted_tokens = second_token_law(router, ids, temperature, runs)
    assert drafted_tokens == runs  # every second token was a draft that the final fill verified
    assert total_variation(drafted, exact) > 0.4  # the test has power: unverified drafts would be far off
    assert total_variation(empirical, exact) < 0.12, total_variation(empirical, exact)


def copied_second_token(model, ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The second token's law under plain sampling after `ids`, and its law had the n-gram tier's copy after the first
    token (what followed its latest occurrence; the last prompt token is followed by nothing) been kept unverified."""
    follows = {int(a): int(b) for a, b in zip(ids[0, :-1], ids[0, 1:])}
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].double() / temperature, -1)
        both = torch.cat([ids.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], dim=1)
        p2 = torch.softmax(model(both).logits[:, -1].double() / temperature, -1)  # (vocab, vocab)
    copied = torch.zeros(VOCAB, dtype=torch.float64)
    for first, p in enumerate(p1.tolist()):
        copied[follows.get(first, first)] += p
    return p1 @ p2, copied


def copying_router(model) -> EarlyExitRouter:
    """Drafts from the n-gram tier alone, down to single-token matches, with no store."""
    return EarlyExitRouter.from_model(
        model, exit_layers=[2], active_exit_layers=[], ngram_min_size=1, ngram_store_tokens=0
    )


def test_copied_drafts_keep_the_full_models_law():
    """The n-gram tier's drafts are copies (a point mass each): the rule accepts a copy x with probability p(x) and
    otherwise draws from p without x, so the second token's law is still the full model's."""
    model = tiny_llama(1, peaky=20.0)
    temperature = 0.7
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[None]  # every token once
    exact, copied = copied_second_token(model, ids, temperature)
    runs = 1500
    empirical, drafted = second_token_law(copying_router(model), ids, temperature, runs)
    assert drafted >= 0.9 * runs  # nearly every second token was a copied draft the deep pass judged
    assert total_variation(copied, exact) > 0.4  # the test has power: unverified copies would be far off
    assert total_variation(empirical, exact) < 0.12, total_variation(empirical, exact)


def test_sampled_token_trees_keep_the_full_models_law():
    """Where the copied token was followed by different tokens at its two earlier occurrences, both are drafted as a
    tree; the walk keeps a child exactly when the full model's draw is that child, so the second token's law is still
    the full model's."""
    model = tiny_llama(2, peaky=20.0)
    temperature = 0.7
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randperm(VOCAB, generator=g), torch.randperm(VOCAB, generator=g)])[None]  # each twice
    exact, first_child = copied_second_token(model, ids, temperature)  # the first child: the latest continuation
    router = copying_router(model)
    router.cost_model = CostModel.synthetic(6, [1.0] * 16, [6.0] * 16)  # positions cost nothing: trees pay
    runs, cycles = 1500, {}
    empirical, drafted = second_token_law(router, ids, temperature, runs, cycles)
    assert cycles.get("tree", 0) >= 0.9 * runs and drafted >= runs  # nearly every second token: a tree's walk
    assert total_variation(first_child, exact) > 0.4  # the test has power: unverified first children would be far off
    assert total_variation(empirical, exact) < 0.12, total_variation(empirical, exact)
