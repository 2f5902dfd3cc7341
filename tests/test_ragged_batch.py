"""Batched verify mode, per row (`decode/batch.py`, `verify.longest_prefix`): each row drafts from the n-gram tier and
keeps its own accepted prefix; rejected drafts become masked holes in a rectangular cache."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.decode import batch as batching
from early_exit_router.decode.drafters import NGRAM_LAYER
from early_exit_router.decode.drafting import append_ngram
from early_exit_router.decode.loop import Decoder
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stopping import DecodeRequest
from early_exit_router.decode.verify import accept_sampled
from early_exit_router.routing.exit_rule import ExitRule
from early_exit_router.routing.ngram import Proposal

from .conftest import ALWAYS_EXIT, CASCADE, NEVER_EXIT, VOCAB, tiny_costs, tiny_llama
from .test_batching import PAD, continuous, hf_batched_greedy

PER_ROW = dict(CASCADE, ngram_tier=True, batch_design="per_row", ngram_store_tokens=0)


def repetitive(lengths: list[int], seed: int = 0, period: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts that repeat a short random pattern, so the n-gram tier proposes (and is often wrong)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for r, n in enumerate(lengths):
        pattern = torch.randint(2, VOCAB, (period + r % 2,), generator=generator)
        ids[r, width - n :] = pattern.repeat(n // len(pattern) + 1)[:n]
        mask[r, width - n :] = 1
    return ids, mask


def counting_compactions(monkeypatch, always: bool = False) -> list[int]:
    """Counts compactions; `always` compacts after every pass that left a hole."""
    if always:
        monkeypatch.setattr(batching, "COMPACT_MIN", 1)
        monkeypatch.setattr(batching, "COMPACT_WASTE", 0.0)
    count: list[int] = []
    real = batching.maybe_compact

    def wrapped(decoder):
        compacted = real(decoder)
        count.extend([1] * compacted)
        return compacted

    monkeypatch.setattr(batching, "maybe_compact", wrapped)
    return count


@pytest.mark.parametrize("policy", ["fixed", "flat", "steep"])
@pytest.mark.parametrize("seed", [0, 1])
def test_per_row_verify_equals_hf_batched_greedy_for_every_row(seed, policy, monkeypatch):
    model = tiny_llama(seed)
    ids, mask = repetitive([12, 20, 7, 16], seed)
    reference = hf_batched_greedy(model, ids, mask, 30)
    config = dict(PER_ROW, policy="fixed" if policy == "fixed" else "cost")
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    if policy != "fixed":
        router.cost_model = tiny_costs()[policy]
    compactions = counting_compactions(monkeypatch)
    out = router.generate(ids, 30, mode="verify", attention_mask=mask)
    assert torch.equal(out.sequences, reference)
    drafted = sum(s.drafts_judged for s in out.row_stats)
    if policy != "steep":  # drafts were made, some rejected (holes), some accepted (tokens gained)
        assert out.stats.rejected_drafts > 0 and out.stats.draft_acceptance > 0 and drafted > 0
        assert out.stats.deep_passes < 30
        assert all(NGRAM_LAYER in depths for depths in out.depths)
    else:  # every extra position costs nearly a full one: the policy decodes plainly
        assert drafted == 0 and out.stats.deep_passes == 29
    if policy == "fixed":
        assert compactions  # 30 tokens with many rejected drafts: holes outgrew the threshold
    assert out.cache is None  # the per-row slots hold holes: no cache lines up with the padded output


def test_rows_that_stop_early_and_repetition_penalty_equal_hf(monkeypatch):
    model = tiny_llama(0)
    ids, mask = repetitive([9, 14, 6], 2)
    probe = hf_batched_greedy(model, ids, mask, 16)
    eos = int(probe[2, ids.shape[1] + 4])
    model.generation_config.pad_token_id = PAD
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **PER_ROW)
    counting_compactions(monkeypatch, always=True)
    out = router.generate(ids, 16, mode="verify", attention_mask=mask, eos_token_id=eos)
    assert torch.equal(out.sequences, hf_batched_greedy(model, ids, mask, 16, eos=eos))
    assert out.row_stats[2].new_tokens < 16
    with torch.no_grad():  # processors see each row's padded prompt and its tokens, as in HF's batch
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD,
                                   repetition_penalty=1.5)  # fmt: skip
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    out = router.generate(ids, 16, mode="verify", attention_mask=mask, logits_processor=penalty)
    assert torch.equal(out.sequences, reference)


def test_the_cache_holds_each_rows_full_forward_after_holes_and_compaction(monkeypatch):
    """Every real slot of every row holds the keys and values of that row's own full forward pass over its real
    tokens (holes excepted), also after compactions gathered the rows' slots."""
    compactions = counting_compactions(monkeypatch, always=True)
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **PER_ROW)
    ids, mask = repetitive([12, 20, 7], 0)
    batch = router.decoder(mode="verify", batch=True, pad_token_id=PAD)
    requests = [DecodeRequest(max_new_tokens=24)] * 3
    selector = TokenSelector(SamplingParams(), ids.device)
    batch.prefill(ids, mask, requests, [selector] * 3)
    while not batch.finished:
        batch.step()
    assert compactions and sum(row.counters.rejected for row in batch.rows) > 0
    cached = batch.slots.length - 1
    for r in range(3):
        real = batch.slots.mask[r, :cached].bool()
        tokens = batch.slots.seq[r, :cached][real][None]
        with torch.no_grad():
            full = model(tokens, use_cache=True).past_key_values
        for layer in range(model.config.num_hidden_layers):
            mine = batch.fill.cache.layers[layer]
            torch.testing.assert_close(mine.keys[r][:, real], full.layers[layer].keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(mine.values[r][:, real], full.layers[layer].values[0], atol=1e-5, rtol=0)


def test_rows_joining_and_leaving_equal_each_row_alone():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **PER_ROW)
    batch = router.decoder(mode="verify", batch=True, pad_token_id=PAD)
    prompts = [repetitive([n], seed)[0] for n, seed in [(9, 1), (4, 2), (17, 3)]]
    budgets = [14, 10, 8]
    assert batch.can_join()
    join, retire, outputs = continuous(batch, prompts, budgets, "verify")

    join(0)
    batch.step()
    join(1)
    batch.step()
    join(2)
    while batch.rows:
        batch.step()
        retire()
    for k, ids in enumerate(prompts):
        expected = hf_batched_greedy(model, ids, torch.ones_like(ids), budgets[k])[0, ids.shape[1] :].tolist()
        assert outputs[k] == expected, k


def test_batched_sampling_in_verify_mode_runs_per_row():
    model = tiny_llama(0)
    ids, mask = repetitive([8, 12], 4)
    synchronous = dict(PER_ROW, batch_design="synchronous")
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **synchronous)
    # the synchronous design is configured, but verify-mode sampling always runs per row
    a = router.generate(ids, 12, mode="verify", attention_mask=mask, do_sample=True, seed=3, temperature=0.7)
    b = router.generate(ids, 12, mode="verify", attention_mask=mask, do_sample=True, seed=3, temperature=0.7)
    assert torch.equal(a.sequences, b.sequences) and a.sequences.shape == (2, ids.shape[1] + 12)
    # top_k=1 leaves one token with probability 1: the sampling rule must then give greedy output exactly
    point = router.generate(ids, 24, mode="verify", attention_mask=mask, do_sample=True, top_k=1, seed=0)
    assert torch.equal(point.sequences, hf_batched_greedy(model, ids, mask, 24))
    assert sum(s.drafts_judged for s in point.row_stats) > 0  # n-gram drafts were judged by the sampling rule
    assert point.stats.rejected_drafts > 0


def test_batched_sampling_draws_hf_batched_samplings_tokens_and_leaves_the_generator_as_hf_does():
    """Rows that share a generator share one (rows, vocab) block of noise per position, as HF's batched sampling
    draws one per step: a seeded verify-mode batch samples HF's batch tokens whatever each row drafted (the store
    of earlier calls too), and the global generator ends where HF's sampling leaves it."""
    model, plain = tiny_llama(0), tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **{**PER_ROW, "ngram_store_tokens": 4096})
    ids, mask = repetitive([8, 12], 4)
    sampling = dict(do_sample=True, temperature=0.3, top_k=0)
    drafts = 0
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            want = plain.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=PAD, **sampling)
        after_hf = torch.random.get_rng_state()
        out = router.generate(ids, 20, mode="verify", attention_mask=mask, seed=seed, **sampling)
        assert torch.equal(out.sequences, want), seed
        drafts += sum(s.drafts_judged for s in out.row_stats)
        torch.manual_seed(seed)
        routed = model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=PAD, **sampling)  # global
        assert torch.equal(routed, want) and torch.equal(torch.random.get_rng_state(), after_hf), seed
    assert drafts > 10


def test_noise_leaves_its_generator_as_plain_sampling_would_unless_another_decode_drew_from_it_too():
    from early_exit_router.decode.noise import SamplingNoise

    cpu = torch.device("cpu")
    g, plain = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    alone = SamplingNoise(g, 2, cpu)
    alone.at(4, 1, 8)  # five blocks of (2, 8): three drawn ahead for drafts
    alone.settle(2)
    torch.empty(2, 2, 8).exponential_(generator=plain)  # plain sampling: two steps
    assert torch.equal(g.get_state(), plain.get_state())
    a, b = SamplingNoise(g, 1, cpu), SamplingNoise(g, 1, cpu)  # two decodes interleaved on one generator
    a.at(2, 0, 8)
    b.at(0, 0, 8)
    state = g.get_state()
    a.settle(1)
    assert torch.equal(g.get_state(), state)  # b drew since: rewinding would hand b's noise out again
    a.at(4, 0, 8)  # a draws last, but b's draw lies between its own: rewinding would still repeat b's noise
    state = g.get_state()
    a.settle(1)
    assert torch.equal(g.get_state(), state)


def test_a_finished_noise_rewinds_to_its_last_output_without_drawing_again(monkeypatch):
    """A row that ends releases every block, but the generator state after its output's last block stays: the
    decode's end rewinds to it rather than drawing the whole output's noise again."""
    from early_exit_router.decode.noise import DONE, SamplingNoise

    g, plain = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    noise = SamplingNoise(g, 1, torch.device("cpu"))
    for position in range(6):  # a token at each position, two drawn ahead for drafts
        noise.release(0, position)
        noise.at(position + 2, 0, 8)
    noise.release(0, DONE, 6)
    assert noise.blocks == [] and len(noise.states) <= 3
    monkeypatch.setattr(noise, "_draw", lambda: pytest.fail("drew the noise again"))
    noise.settle(6)
    torch.empty(6, 1, 8).exponential_(generator=plain)
    assert torch.equal(g.get_state(), plain.get_state())


def test_the_per_row_sampling_rule_keeps_the_full_models_distribution():
    """A copied draft x is kept where the full model's draw with the position's noise is x, with probability p(x),
    and otherwise that draw, from p without x, is the token: the first emitted token follows p exactly, and the one
    after an accepted draft follows the next position's p."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3.0  # peaked laws: low noise
    p = torch.softmax(logits.double(), dim=-1)
    draft = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely but not certain first draft
    generator = torch.Generator().manual_seed(0)
    runs = 6000
    first = torch.zeros(VOCAB, dtype=torch.float64)
    second = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(runs):
        noise = torch.empty(3, VOCAB).exponential_(generator=generator)  # each position's draw
        verdicts, tokens = accept_sampled(torch.softmax(logits, dim=-1), noise, draft)
        accepted = sum(verdicts)
        token = tokens[accepted]
        first[draft[0] if accepted >= 1 else token] += 1
        if accepted >= 1:
            second[draft[1] if accepted >= 2 else token] += 1
    assert 0.5 * float((first / runs - p[0]).abs().sum()) < 0.05
    assert 0.5 * float((second / second.sum() - p[1]).abs().sum()) < 0.06
    assert second.sum() > 0.1 * runs  # the draft was accepted often enough for the second law to be measured


def test_a_bad_batch_design_is_refused():
    with pytest.raises(ValueError, match="batch_design"):
        EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], batch_design="ragged")
    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **PER_ROW)
    with pytest.raises(ValueError, match="verify mode"):
        Decoder(
            router.stack, router.heads, ExitRule(router.config, VOCAB), router.config, "exit", batch_design="per_row"
        )


def test_sliding_window_models_fall_back_where_holes_would_shift_the_window():
    """A sliding window keeps the last slots, holes included: such batches run synchronously (greedy) or row by row
    (sampling), and stay exact."""
    from .test_architectures import build

    model = build("mistral-sliding")
    ids, mask = repetitive([12, 16], 1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **PER_ROW)
    out = router.generate(ids, 20, mode="verify", attention_mask=mask)
    assert torch.equal(out.sequences, hf_batched_greedy(model, ids, mask, 20))
    assert out.cache is not None  # the synchronous engine ran (its cache lines up with the output)
    point = router.generate(ids, 20, mode="verify", attention_mask=mask, do_sample=True, top_k=1, seed=0)
    assert torch.equal(point.sequences, hf_batched_greedy(model, ids, mask, 20))


@pytest.mark.parametrize("config", [PER_ROW, ALWAYS_EXIT], ids=["per-row n-gram drafts", "synchronous exit drafts"])
def test_a_row_cancelled_with_drafts_in_flight_leaves_the_other_rows_exact(config):
    """A server cancels a request between any two steps, also while another row's drafts wait for their deep pass:
    the padding the cancelled (longest) row leaves behind is dropped, and the other row decodes exactly as it does
    where nothing is cancelled, its cache the full forward pass over its tokens."""
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    long_ids = torch.randint(2, VOCAB, (1, 25), generator=torch.Generator().manual_seed(3))
    short_ids, _ = repetitive([17], 0)
    ids = torch.full((2, 25), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0], mask[0] = long_ids[0], 1
    ids[1, 8:], mask[1, 8:] = short_ids[0], 1

    def decode(cancel: bool):
        batch = router.decoder(mode="verify", batch=True, pad_token_id=PAD)
        selector = TokenSelector(SamplingParams(), ids.device)
        batch.prefill(ids, mask, [DecodeRequest(max_new_tokens=20)] * 2, [selector] * 2)
        kept = batch.rows[1]
        for _ in range(8):  # drafts within a few steps: copies of the repeating pattern, or every token's exit
            batch.step()
            if kept.drafts:
                break
        if cancel:
            slots = batch.slots.length
            batch.remove([batch.rows[0]])
            assert batch.slots.length == slots - 8 and kept.drafts  # the padding left, the drafts still in flight
        while not kept.done:
            batch.step()
        return kept.output(), batch

    output, batch = decode(cancel=True)
    assert output == decode(cancel=False)[0]
    cached = batch.slots.length - 1
    real = batch.slots.mask[0, :cached].bool()
    with torch.no_grad():
        full = model(batch.slots.seq[0, :cached][real][None], use_cache=True).past_key_values
    for layer in range(model.config.num_hidden_layers):
        mine, theirs = batch.fill.cache.layers[layer], full.layers[layer]
        torch.testing.assert_close(mine.keys[0][:, real], theirs.keys[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(mine.values[0][:, real], theirs.values[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", range(3, 12))
def test_a_flush_where_one_row_keeps_every_draft_and_another_refuses_one_is_exact(n):
    """Rows draft up to max_new_tokens, then the flush runs their drafts with no current token: a row that keeps them
    all has ended, and the other row's next token lands where the cache ends (not one slot after it)."""
    model = tiny_llama(1)
    pattern = torch.tensor([[5, 17, 33, 41, 9] * 3 + [5, 17]])
    ids = torch.cat([pattern, torch.roll(pattern, -3, dims=1)])
    mask = torch.ones_like(ids)
    reference = hf_batched_greedy(model, ids, mask, n)
    config = {**NEVER_EXIT, "ngram_tier": True, "batch_design": "per_row", "ngram_min_size": 1}
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    assert torch.equal(router.generate(ids, n, mode="verify", attention_mask=mask).sequences, reference)


def test_after_that_flush_nothing_waits_and_each_row_is_exact():
    model = tiny_llama(0)
    a, b = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))[:, None]
    plain_a = model.generate(a, max_new_tokens=4, do_sample=False)[0, 6:].tolist()
    plain_b = model.generate(b, max_new_tokens=3, do_sample=False)[0, 6:].tolist()
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **{**NEVER_EXIT, "batch_design": "per_row"})
    decoder = router.decoder(mode="verify", batch=True)
    selector = TokenSelector(SamplingParams(), router.stack.device)
    ids = torch.cat([a, b])
    decoder.prefill(ids, torch.ones_like(ids), [DecodeRequest(4), DecodeRequest(3)], [selector] * 2)
    with torch.inference_mode():  # row 0 drafts its three right tokens; row 1 one right, one wrong: both at the end
        append_ngram(decoder, [Proposal(plain_a[1:4], 3), Proposal([plain_b[1], (plain_b[2] + 1) % VOCAB], 2)])
    decoder.step()  # the flush
    assert decoder.pending == 0 and decoder.finished
    assert decoder.rows[0].output() == plain_a and decoder.rows[1].output() == plain_b
