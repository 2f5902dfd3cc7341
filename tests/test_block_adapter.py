"""The one-block adapter (Kangaroo-style): a decoder block at the exit with a KV cache of its own."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from early_exit_router import EarlyExitRouter
from early_exit_router.decode.output import run_to_end
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.heads.block import BlockAdapter
from early_exit_router.heads.draft import after_block

from .conftest import MIXED, assert_cache_matches_full_forward, prompt, tiny_llama

EXITS = [1, 3]


def block_router(model, seed: int = 5, kind: str = "block", **overrides):
    """Block adapters at layers 1 and 3, nudged away from the copied layers (as training would); a residual block
    also lets half of the block's update through and has a post-norm map."""
    router = EarlyExitRouter.from_model(model, exit_layers=EXITS, adapter=kind, **{**MIXED, **overrides})
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in router.heads.parameters():
            p.add_(torch.randn_like(p) * 0.002)
        for e in EXITS:
            if router.heads.adapter(e).mix is not None:
                router.heads.adapter(e).mix.add_(0.5)
    return router


def block_reference(model, router, sequence: torch.Tensor, exit_layer: int):
    """The block's cache after one pass over every position's exit state, computed from a plain forward."""
    adapter = router.heads.adapter(exit_layer)
    with torch.no_grad():
        states = model(sequence, output_hidden_states=True).hidden_states[exit_layer + 1]  # (1, n, hidden)
        from early_exit_router.models import _compat

        cache = _compat.new_block_cache()
        out = adapter(states, router.stack, cache)
    return cache, out


def test_the_block_starts_as_a_copy_of_the_next_layer():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=EXITS, adapter="block")
    adapter = router.heads.adapter(1)
    assert isinstance(adapter, BlockAdapter)
    for (name, mine), theirs in zip(adapter.block.state_dict().items(), model.model.layers[2].state_dict().values()):
        assert torch.equal(mine, theirs), name
        assert mine.data_ptr() != theirs.data_ptr()  # a copy: training it leaves the model alone
    # ... so an untrained block exit at layer 1 predicts what the model's layer-2 state does.
    ids = prompt(0, 10)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        out = adapter(states[2], router.stack)
    torch.testing.assert_close(out, states[3], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["block", "residual_block"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_mode_with_block_adapters_is_greedy_identical_and_the_block_cache_survives_rollback(seed, kind):
    model = tiny_llama(seed)
    ids = prompt(seed, 8)
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)
    router = block_router(model, kind=kind)
    decoder = router.decoder(mode="verify")
    request = DecodeRequest(max_new_tokens=24)
    out = run_to_end(decoder, ids, torch.ones_like(ids), request, TokenSelector(SamplingParams(), router.stack.device))
    sequences, stats, cache = out.sequences, out.stats, out.cache
    assert torch.equal(sequences, expected)
    assert stats.rejected_drafts > 0 and stats.mean_accepted_length > 0  # rollbacks happened, drafts were kept
    assert_cache_matches_full_forward(model, sequences, cache)
    fed = sequences[:, :-1]
    for i, layer in enumerate(decoder.exits):
        context = decoder.fill.blocks[i]
        context.run(router.stack, router.heads.adapter(layer))  # anything still queued
        ref_cache, _ = block_reference(model, router, fed, layer)
        assert context.seen == fed.shape[1]
        torch.testing.assert_close(context.cache.layers[0].keys, ref_cache.layers[0].keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(context.cache.layers[0].values, ref_cache.layers[0].values, atol=1e-5, rtol=0)


def test_exit_mode_with_block_adapters_uses_them_and_fills_the_model_cache_exactly():
    model = tiny_llama(0)
    router = block_router(model)
    out = router.generate(prompt(0, 8), max_new_tokens=30, mode="exit")
    assert {d for d in out.depths} & set(EXITS)  # tokens left at the block exits
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


@pytest.mark.parametrize("kind", ["block", "residual_block"])
def test_an_exit_through_the_block_is_the_block_computed_independently(kind):
    model = tiny_llama(0)
    router = block_router(model, kind=kind, high_conf_threshold=0.0, low_conf_threshold=0.0)
    router.config = router.config.replace(active_exit_layers=[1])
    ids = prompt(0, 6)
    out = router.generate(ids, max_new_tokens=6, mode="exit")
    assert out.depths[1:] == [1] * 5  # after the prefill's token every token leaves at the block exit
    # Each exited token is the block's prediction over the exit states of everything before it.
    seq = out.sequences
    for t in range(ids.shape[1] + 1, seq.shape[1]):
        _, block_out = block_reference(model, router, seq[:, :t], 1)
        with torch.no_grad():
            normed = after_block(router.heads.adapter(1), model.model.norm(block_out[:, -1]))  # the post map, if any
            expected = model.lm_head(normed).argmax(-1)
        assert int(expected) == int(seq[0, t]), t


def test_cost_policy_verify_with_block_adapters_is_greedy_identical():
    model = tiny_llama(3)
    ids = prompt(3, 8)
    expected = model.generate(ids, max_new_tokens=32, do_sample=False)
    from .conftest import tiny_costs

    router = block_router(model, policy="cost", ngram_tier=True, draft_vocab_size=48)
    router.cost_model = tiny_costs()["flat"]
    out = router.generate(ids, max_new_tokens=32, mode="verify")
    assert torch.equal(out.sequences, expected)
    assert any(k.startswith("exit") for k in out.stats.policy_cycles)  # the policy drafted from a block exit


def test_verify_mode_leaves_out_a_block_exit_whose_drafts_do_not_pay_at_its_starting_estimate():
    """A block's layer runs on every step whether its exit drafts or not, so verify mode under the cost policy
    consults it only where its drafts pay at the acceptance its estimates start from. On the tiny tables the block
    exit at layer 3 breaks even at 0.47 (flat) and 0.87 (quirky); the postnorm exit at layer 1 always stays."""
    from .conftest import tiny_costs

    model = tiny_llama(3)
    ids = prompt(3, 8)
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)
    adapters = {3: "residual_block"}
    router = EarlyExitRouter.from_model(model, exit_layers=EXITS, adapter="postnorm", exit_adapters=adapters,
                                        policy="cost", ngram_tier=True, draft_vocab_size=48)  # fmt: skip
    router.cost_model = tiny_costs()["quirky"]
    decoder = router.decoder(mode="verify")
    assert decoder.exits_left_out == [3] and decoder.exits == [1] and decoder.config.active_exit_layers == [1]
    out = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(out.sequences, expected)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)
    assert out.stats.exits_left_out == [3] and "block exits left out (L3)" in out.stats.summary()
    assert not any(d == 3 for d in out.depths)
    # the exit stays where it pays: its prior at its break-even, cheaper passes, exit mode, the fixed policy
    router.cost_model = tiny_costs()["flat"]  # breaks even at 0.47: the default prior (0.5) keeps it ...
    assert router.decoder(mode="verify").exits == EXITS
    assert router.decoder({"exit_acceptance_prior": 0.3}, mode="verify").exits_left_out == [3]  # ... 0.3 does not
    router.cost_model = tiny_costs()["quirky"]
    assert router.decoder({"exit_acceptance_prior": 0.9}, mode="verify").exits == EXITS
    assert router.decoder(mode="exit").exits == EXITS
    assert router.decoder({"policy": "fixed"}, mode="verify").exits == EXITS
    # a block exit's break-even is its own: priced alone (as `without_idle_blocks` does), as among every exit
    from early_exit_router.routing.policy import DraftPolicy

    for costs in tiny_costs().values():
        every = DraftPolicy.for_config(costs, router.config, router.heads)
        alone = DraftPolicy.for_config(costs, router.config.replace(active_exit_layers=[3]), router.heads)
        assert alone.draft_break_even(0) == every.draft_break_even(EXITS.index(3))


def pad_left(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, width) ids left-padded with 0, and their attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - len(r)), torch.ones(len(r))]).long() for r in rows])
    return ids, mask


def rows_alone(short: int) -> tuple:
    """tiny_llama(0) under block exits only, whose batches run each row alone, and a batch of 8 and `short` tokens:
    (model, router, rows, ids, mask)."""
    model = tiny_llama(0)
    router = block_router(model)
    rows = [prompt(0, 8)[0], prompt(1, short)[0]]
    ids, mask = pad_left(rows)
    assert not router.can_batch()
    return model, router, rows, ids, mask


def test_a_padded_batch_with_block_adapters_runs_each_row_alone():
    model, router, rows, ids, mask = rows_alone(5)
    width = ids.shape[1]
    batch = router.generate(ids, max_new_tokens=12, mode="exit", attention_mask=mask)
    for r, row in enumerate(rows):
        alone = router.generate(row[None], max_new_tokens=12, mode="exit")
        assert batch.sequences[r, width:].tolist() == alone.sequences[0, len(row) :].tolist()


class ForceAtLengths(LogitsProcessor):
    """Pushes token (7 * length) % vocab at every third length of the ids it sees: what it does depends on their
    length, left padding included."""

    def __call__(self, input_ids, scores):
        n = input_ids.shape[-1]
        if n % 3:
            return scores
        scores = scores.clone()
        scores[:, 7 * n % scores.shape[-1]] += 1000.0
        return scores


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[-1] >= self.length, dtype=torch.bool)


def test_rows_run_alone_show_processors_and_criteria_their_padding_as_hf_does():
    """Rows decoded one after another drop their left padding for the model, but the caller's processors and
    stopping criteria see the padded row, as in HF's batch: verify mode equals HF's batched greedy."""
    model, router, rows, ids, mask = rows_alone(4)
    width = ids.shape[1]
    kwargs = dict(logits_processor=LogitsProcessorList([ForceAtLengths()]), attention_mask=mask)
    criteria = StoppingCriteriaList([StopAtLength(width + 10)])
    out = router.generate(ids, 16, mode="verify", stopping_criteria=criteria, **kwargs)
    want = tiny_llama(0).generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, stopping_criteria=criteria,
                                  **kwargs)  # fmt: skip
    assert want.shape[1] == width + 10  # the criterion stopped both rows at the padded length
    assert torch.equal(out.sequences, want)
    # HF's repetition penalty holds each row's padding length: each row alone applies its own
    penalty = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, repetition_penalty=1.4, attention_mask=mask)
    want = tiny_llama(0).generate(ids, **penalty)
    router.last_stats = None
    assert torch.equal(model.generate(ids, generation_config=GenerationConfig(early_exit_mode="verify"), **penalty),
                       want)  # fmt: skip
    assert router.last_stats is not None  # routed, each row alone


def test_max_time_on_rows_run_alone_runs_plain_hf():
    """Rows decoded one after another would share HF's one max_time clock (the first row could spend it all, the
    others stopping at once): model.generate runs such a batch as HF does; one sequence stays routed."""
    model, router, rows, ids, mask = rows_alone(5)
    config = GenerationConfig(early_exit_mode="verify", max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = tiny_llama(0).generate(ids, generation_config=config, attention_mask=mask)
    router.last_stats = None
    assert torch.equal(model.generate(ids, generation_config=config, attention_mask=mask, max_time=600.0), want)
    assert router.last_stats is None  # plain HF
    model.generate(rows[0][None], generation_config=config, max_time=600.0)
    assert router.last_stats is not None  # one sequence: routed


def test_a_sampled_batch_run_row_by_row_draws_hf_batched_samplings_tokens():
    """Rows decoded one after another each sample with their row of the (rows, vocab) noise HF's batch draws per
    step: a seeded batch gives HF's batch tokens, and the generator ends where HF's batched sampling leaves it."""
    model, router, rows, ids, mask = rows_alone(5)
    plain = tiny_llama(0)  # built before seeding: building a model draws from the global generator
    sampling = dict(do_sample=True, temperature=0.7, top_k=0, max_new_tokens=16, pad_token_id=0, attention_mask=mask)
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            want = plain.generate(ids, **sampling)
        after_hf = torch.random.get_rng_state()
        torch.manual_seed(seed)
        router.last_stats = None
        routed = model.generate(ids, generation_config=GenerationConfig(early_exit_mode="verify"), **sampling)
        assert router.last_stats is not None  # routed, each row alone
        assert torch.equal(routed, want) and torch.equal(torch.random.get_rng_state(), after_hf), seed


def test_a_residual_block_starts_as_exactly_its_postnorm_head():
    """Its block's update enters scaled by zero at the start and its post-norm map is a `postnorm` adapter, so a
    residual block warm-started from a trained `postnorm` head predicts exactly what that head does."""
    from early_exit_router.heads.draft import exit_logits

    model = tiny_llama(0)
    postnorm = EarlyExitRouter.from_model(model, exit_layers=EXITS, adapter="postnorm")
    torch.manual_seed(0)
    with torch.no_grad():
        postnorm.heads.adapter(1).proj.weight.normal_(std=0.05)
    residual = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=EXITS, adapter="residual_block")
    residual.heads.adapter(1).post.load_state_dict(postnorm.heads.adapter(1).state_dict())
    with torch.no_grad():
        states = model(prompt(0, 10), output_hidden_states=True).hidden_states[2]  # exit 1's states (1, 10, hidden)
        expected = exit_logits(postnorm.stack, postnorm.heads.adapter(1), states)
        got = exit_logits(residual.stack, residual.heads.adapter(1), states)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_residual_block_scales_the_layers_own_residual_writes():
    """Its writers are found in the layer (attention's output and the MLP's down projection), and a layer where
    zeroing them would not leave the identity is refused with the fix."""
    from early_exit_router.heads.block import _check_starts_as_identity

    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=EXITS, adapter="residual_block")
    adapter = router.heads.adapter(1)
    assert adapter.writers == ["self_attn.o_proj", "mlp.down_proj"]
    assert adapter.mix.shape == (2, router.stack.hidden_size)
    adapter.writers = ["mlp.down_proj"]  # attention would still write: not a residual block
    with torch.no_grad():
        adapter.mix = torch.nn.Parameter(torch.zeros(1, router.stack.hidden_size))
    with pytest.raises(ValueError, match="Use the 'block' or 'postnorm' adapter"):
        _check_starts_as_identity(adapter, router.stack)


@pytest.mark.parametrize("mode", ["verify", "exit"])
def test_a_batch_leaves_block_exits_out_and_consults_the_others(mode):
    """Mixed heads (a block at one exit): batches carry no block caches, so they consult the other exits; verify
    mode stays identical to the model's own greedy batch."""
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(
        model, exit_layers=EXITS, adapter="postnorm", exit_adapters={3: "residual_block"}, **MIXED
    )
    assert router.batch_config().active_exit_layers == [1]
    assert router.batch_config(router.config.replace(active_exit_layers=[3])) is None  # blocks alone: rows alone
    rows = [prompt(0, 8)[0], prompt(1, 5)[0]]
    ids, mask = pad_left(rows)
    out = router.generate(ids, max_new_tokens=12, mode=mode, attention_mask=mask)
    depths = {d for row in out.depths for d in row}
    assert 3 not in depths and (mode == "verify" or 1 in depths), depths
    if mode == "verify":
        with router.disabled() as plain:
            expected = plain.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(out.sequences, expected)
