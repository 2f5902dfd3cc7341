"""Batched generation (batch-synchronous): left-padded rows of different lengths, finishing independently."""

from __future__ import annotations

import pytest
import torch

from early_exit_router import EarlyExitRouter
from early_exit_router.models._compat import forward_cache

from .conftest import (
    ALWAYS_EXIT,
    MIXED,
    NEVER_EXIT,
    VOCAB,
    assert_cache_matches_full_forward,
    tiny_llama,
)

PAD = 0


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, max length) random prompts, left-padded with PAD, and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(2, VOCAB, (n,), generator=generator)
        mask[r, width - n :] = 1
    return ids, mask


def hf_batched_greedy(model, ids, mask, n, eos=None):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD, eos_token_id=eos
        )


def row_alone(ids: torch.Tensor, mask: torch.Tensor, r: int) -> torch.Tensor:
    return ids[r : r + 1, mask[r].bool()]


@pytest.mark.parametrize("config", [MIXED, ALWAYS_EXIT, dict(MIXED, max_pending=2)], ids=["mixed", "always", "window"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_verify_equals_hf_batched_greedy_for_every_row(seed, config):
    model = tiny_llama(seed)
    ids, mask = left_padded([5, 9, 3, 7], seed)
    reference = hf_batched_greedy(model, ids, mask, 20)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    out = router.generate(ids, 20, mode="verify", attention_mask=mask)
    assert torch.equal(out.sequences, reference)
    assert len(out.row_stats) == 4 and out.stats.new_tokens == 80
    if config is ALWAYS_EXIT:
        assert out.stats.hit_rate > 0 or out.stats.rejected_drafts > 0  # drafts were made and verified
    full = torch.cat([mask, torch.ones(4, out.sequences.shape[1] - ids.shape[1], dtype=torch.long)], dim=1)
    positions = (full[:, :-1].cumsum(-1) - 1).clamp(min=0)  # as HF generate numbers left-padded rows
    with torch.no_grad():  # the cache holds what a batched forward pass over the output gives
        output = model(out.sequences[:, :-1], attention_mask=full[:, :-1], position_ids=positions, use_cache=True)
    expected = forward_cache(output)
    for layer in range(model.config.num_hidden_layers):
        for mine, theirs in zip(_layer_kv(out.cache, layer), _layer_kv(expected, layer)):
            keep = full[:, :-1].bool()  # padded slots hold whatever was computed there: compare real ones
            torch.testing.assert_close(mine.transpose(1, 2)[keep], theirs.transpose(1, 2)[keep], atol=1e-5, rtol=0)


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layers[layer].keys, cache.layers[layer].values


def test_rows_that_stop_early_are_padded_like_hf():
    model = tiny_llama(0)
    ids, mask = left_padded([6, 4, 8], 3)
    probe = hf_batched_greedy(model, ids, mask, 12)
    eos = int(probe[1, ids.shape[1] + 3])  # a token row 1 emits early: it becomes the EOS
    reference = hf_batched_greedy(model, ids, mask, 12, eos=eos)
    model.generation_config.pad_token_id = PAD  # what finished rows are filled with (HF's fallback: EOS)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    for mode in ("verify", "exit"):
        config = MIXED if mode == "verify" else NEVER_EXIT
        out = router.generate(ids, 12, mode=mode, attention_mask=mask, eos_token_id=eos, config=config)
        assert torch.equal(out.sequences, reference), mode
        assert out.row_stats[1].new_tokens < 12  # row 1 finished on its own
        walls = [r.wall_time_s for r in out.row_stats]  # its wall time stopped there, the others' ran on
        assert walls[1] < min(walls[0], walls[2]) and out.stats.wall_time_s == max(walls)


def test_a_batchs_statistics_pool_its_rows_by_their_counts():
    from early_exit_router.decode.stats import GenerationStats, combined_stats

    a = GenerationStats(new_tokens=10, exit_agreement_by_layer={1: 0.5}, exit_checked_by_layer={1: 4},
                        draft_acceptance_by_layer={-1: 1.0, 3: 0.5}, drafts_judged_by_layer={-1: 2, 3: 4},
                        mean_accepted_length=2.0, verify_passes=3, min_rolling_agreement=0.6, deep_passes=9,
                        wall_time_s=2.0, prefill_s=0.5)  # fmt: skip
    b = GenerationStats(new_tokens=6, exit_agreement_by_layer={1: 1.0, 3: 0.0}, exit_checked_by_layer={1: 1, 3: 2},
                        draft_acceptance_by_layer={3: 0.0}, drafts_judged_by_layer={3: 4}, verify_passes=1,
                        mean_accepted_length=1.0, min_rolling_agreement=0.9, deep_passes=5, wall_time_s=1.0,
                        prefill_s=0.5)  # fmt: skip
    both = combined_stats([a, b])
    assert both.exit_agreement_by_layer == {1: 3 / 5, 3: 0.0} and both.exit_checked_by_layer == {1: 5, 3: 2}
    assert both.draft_acceptance_by_layer == {-1: 1.0, 3: 2 / 8} and both.drafts_judged_by_layer == {-1: 2, 3: 8}
    assert both.mean_accepted_length == 7 / 4 and both.verify_passes == 4
    assert both.min_rolling_agreement == 0.6  # one monitor: the batch's, as the longest row saw it
    assert both.wall_time_s == 2.0 and both.decode_tokens_per_s == (16 - 2) / 1.5  # side by side
    assert both.deep_passes == 9  # side by side: the batch's passes, as the longest row saw them
    in_turn = combined_stats([a, b], one_after_another=True)  # rows decoded alone, one after the other
    assert in_turn.wall_time_s == 3.0 and in_turn.tokens_per_s == 16 / 3.0 and in_turn.deep_passes == 14


@pytest.mark.parametrize("config", [ALWAYS_EXIT, NEVER_EXIT], ids=["always", "never"])
def test_batched_exit_mode_equals_each_row_run_alone(config):
    """Where each row's own decisions are the batch's (all rows exit, or none), a row's tokens, depths and cache
    are those of the row run alone."""
    model = tiny_llama(2)
    ids, mask = left_padded([4, 7, 5], 5)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    out = router.generate(ids, 16, mode="exit", attention_mask=mask)
    width = ids.shape[1]
    for r in range(3):
        alone = router.generate(row_alone(ids, mask, r), 16, mode="exit")
        assert torch.equal(out.sequences[r, width:], alone.sequences[0, alone.sequences.shape[1] - 16 :])
        assert out.depths[r] == alone.depths
    if config is ALWAYS_EXIT:
        assert out.stats.hit_rate > 0.5


def test_a_mixed_batch_exits_only_when_every_row_may():
    model = tiny_llama(0)
    ids, mask = left_padded([5, 6], 1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    out = router.generate(ids, 16, mode="exit", attention_mask=mask)
    assert len(set(out.depths[0])) > 1  # the batch did exit at some steps and not at others
    assert out.depths[0] == out.depths[1]  # one decision per step for the whole batch
    assert_cache_matches_full_forward_batched(model, out)


def assert_cache_matches_full_forward_batched(model, out) -> None:
    """Rows without padding: each row's cache equals its own full forward pass."""
    for r in range(out.sequences.shape[0]):
        single = type(out.cache)()
        for layer in range(model.config.num_hidden_layers):
            keys, values = _layer_kv(out.cache, layer)
            single.update(keys[r : r + 1], values[r : r + 1], layer)
        if r == 1:  # the longest row has no padding slots
            assert_cache_matches_full_forward(model, out.sequences[r : r + 1], single)


def test_batched_sampling_in_exit_mode_and_clear_errors():
    model = tiny_llama(0)
    ids, mask = left_padded([3, 5], 2)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    a = router.generate(ids, 10, mode="exit", attention_mask=mask, do_sample=True, seed=7)
    b = router.generate(ids, 10, mode="exit", attention_mask=mask, do_sample=True, seed=7)
    assert torch.equal(a.sequences, b.sequences) and a.sequences.shape == (2, ids.shape[1] + 10)
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left padding"):
        router.generate(ids, 4, attention_mask=right)
    with pytest.raises(ValueError, match="shape"):
        router.generate(ids, 4, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="Streamers"):
        router.generate(ids, 4, attention_mask=mask, output_logits=True)


def test_bench_batch_reports_every_arm_and_verify_rows_equal_the_control():
    from early_exit_router.bench.batch_bench import ARMS, BatchBenchConfig, run_batch_bench

    from .conftest import tiny_tokenizer

    router = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer(), exit_layers=[1, 3], **MIXED)
    prompts = [{"id": str(k), "category": "c", "kind": "text", "prompt": " ".join(f"w{k + j}" for j in range(2 + k))}
               for k in range(3)]  # fmt: skip
    result = run_batch_bench(router, prompts, BatchBenchConfig(batch_sizes=(1, 3), max_new_tokens=6, repeats=1))
    assert [(r.batch_size, r.arm) for r in result.rows] == [(b, arm) for b in (1, 3) for arm in ARMS]
    for row in result.rows:
        assert row.tokens_per_s > 0 and row.new_tokens == 6 * row.batch_size
        if "verify" in row.arm or "exits off" in row.arm:
            assert row.identical_rows == row.batch_size  # lossless, row by row
    assert "| 3 | router verify" in result.markdown() and "noise band" in result.markdown()
    with pytest.raises(ValueError, match="batch sizes"):
        run_batch_bench(router, prompts, BatchBenchConfig(batch_sizes=(0,)))


def continuous(batch, prompts: list[torch.Tensor], budgets: list[int], mode: str):
    """Continuous batching by hand: `join(k)` adds prompt k between steps (stepping until rows may join), `retire()`
    takes finished rows out, keeping their outputs in the returned dict."""
    from early_exit_router.decode.sampling import SamplingParams, TokenSelector
    from early_exit_router.decode.stopping import DecodeRequest

    rows, outputs = {}, {}

    def join(k: int) -> None:
        while not batch.can_join():
            batch.step()
        request = DecodeRequest(max_new_tokens=budgets[k])
        rows[k] = batch.join(prompts[k], request, TokenSelector(SamplingParams(), prompts[k].device))

    def retire() -> None:
        finished = [row for row in batch.rows if row.done]
        for k, row in rows.items():
            if row in finished:
                outputs[k] = row.output()
        batch.remove(finished)

    return join, retire, outputs


@pytest.mark.parametrize("mode", ["verify", "exit"])
def test_rows_joining_and_leaving_between_steps_equal_each_row_run_alone(mode):
    """Continuous batching: rows join (shorter and longer than the batch so far) and leave between steps; verify
    rows equal HF greedy of each prompt alone, exit rows (never exiting) too, and the cache stays small."""
    model = tiny_llama(0)
    config = MIXED if mode == "verify" else NEVER_EXIT
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **config)
    batch = router.decoder(mode=mode, batch=True, pad_token_id=PAD)
    prompts = [left_padded([n], seed)[0] for n, seed in [(6, 1), (3, 2), (14, 3), (5, 4)]]
    budgets = [10, 14, 6, 8]
    join, retire, outputs = continuous(batch, prompts, budgets, mode)

    join(0)
    for _ in range(3):
        batch.step()
    join(1)  # shorter than the batch so far: padded on the left
    batch.step()
    join(2)  # longer: the batch is padded on the left
    for _ in range(4):
        batch.step()
        retire()
    join(3)
    while batch.rows:
        batch.step()
        retire()
    for k, ids in enumerate(prompts):
        with router.disabled() as plain:  # HF greedy of the prompt alone
            expected = hf_batched_greedy(plain, ids, torch.ones_like(ids), budgets[k])[0, ids.shape[1] :].tolist()
        assert outputs[k] == expected, k
    assert batch.fill is None and batch.slots is None  # the last row left: nothing is kept


def test_a_rows_statistics_count_the_passes_made_while_it_was_in_the_batch():
    """A server keeps its batch decoder for request after request: each row's deep passes and plain share are those
    of the steps it took part in (they summed every request's before, and plain_share passed 1)."""
    model = tiny_llama(0)
    plain = dict(NEVER_EXIT, policy="cost", active_exit_layers=[])  # every step plain under the cost policy
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **plain)
    batch = router.decoder(mode="verify", batch=True, pad_token_id=PAD)
    prompts = [left_padded([n], seed)[0] for n, seed in [(6, 1), (4, 2), (5, 3)]]
    join, retire, _ = continuous(batch, prompts, [8, 8, 8], "verify")
    join(0)
    for _ in range(3):
        batch.step()
    join(1)  # joins a batch that made 3 passes
    first, second = batch.rows
    while batch.rows:
        batch.step()
        retire()
    join(2)  # after the batch emptied: a new one
    while not batch.finished:
        batch.step()
    rows = [batch.stats(row) for row in (first, second, batch.rows[0])]
    assert [s.deep_passes for s in rows] == [7, 7, 7]  # 8 tokens each: the prefill's, then 7 deep passes
    assert rows[0].policy_cycles == rows[1].policy_cycles == {"plain": 3}  # (the policy plans while one row runs)
    assert rows[2].policy_cycles == {"plain": 7} and rows[2].plain_share == 7 / 8


def test_under_the_cost_policy_a_batch_stops_asking_exits_that_never_fire(monkeypatch):
    """The ask rule (`DraftPolicy.worth_consulting`) serves batches as it serves one sequence: an exit is asked
    until its estimated exit rate falls below its break-even, then only every `probe_interval` skipped tokens."""
    from early_exit_router.decode import drafters
    from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy

    calls = []
    real = drafters.draft_logits
    monkeypatch.setattr(drafters, "draft_logits", lambda *a: calls.append(1) or real(*a))
    model = tiny_llama(0)
    ids, mask = left_padded([5, 7], 4)
    never = dict(NEVER_EXIT, policy="cost", probe_interval=8, use_gate=False)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **never)
    out = router.generate(ids, 40, mode="verify", attention_mask=mask)
    steps = 39  # the prefill chose the first token
    policy = DraftPolicy.for_config(router.costs(), router.config, router.heads)
    warmup = 0  # asks until an exit that never fires is estimated below its break-even
    for i in range(2):
        estimate, rate = router.config.acceptance_prior, AcceptanceTracker.rate
        while estimate >= policy.break_even_exit_rate(i):
            warmup, estimate = warmup + 1, estimate * (1 - rate)
    bound = warmup + 2 * (steps // 8 + 1)  # then one probe every 8 skipped tokens per exit
    assert 0 < len(calls) <= bound < 2 * steps
    assert set(out.stats.asks_skipped) == {1, 3}
    fixed = router.generate(ids, 40, mode="verify", attention_mask=mask, config={"policy": "fixed"})
    assert torch.equal(out.sequences, fixed.sequences)
    assert len(calls) > bound  # the fixed cascade asks both exits at every step


def test_drafts_are_judged_after_the_logits_processors():
    """Verify mode accepts a draft only if it is what the processed scores choose (as HF picks its token), not the
    raw argmax: a processor that bans the raw winner must change the verdict."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from early_exit_router.decode.deep import greedy_row
    from early_exit_router.decode.sampling import SamplingParams, TokenSelector
    from early_exit_router.decode.stopping import DecodeRequest

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([5]), float("-inf"))

    router = EarlyExitRouter.from_model(tiny_llama(0), exit_layers=[1, 3], **MIXED)
    decoder = router.decoder(mode="verify", batch=True, pad_token_id=PAD)
    selector = TokenSelector(SamplingParams(), torch.device("cpu"), LogitsProcessorList([Ban()]))
    ids, mask = left_padded([3, 3], 0)
    decoder.prefill(ids, mask, [DecodeRequest(max_new_tokens=4)] * 2, [selector] * 2)
    logits = torch.zeros(2, VOCAB)
    logits[:, 5], logits[:, 7] = 9.0, 3.0  # raw winner 5 is banned: the processed choice is 7
    assert greedy_row(decoder, 0, decoder.rows[0], logits, 3) == [7, 7]
