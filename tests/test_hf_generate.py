"""`model.generate()` on a patched model routes through the router, with HF's usual arguments."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from early_exit_router import EarlyExitRouter
from early_exit_router.integrations.hf_generate import _reads_the_batch

from .conftest import MIXED, NEVER_EXIT, assert_cache_matches_full_forward, prompt, tiny_llama


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def plain_generate(seed: int, *args, **kwargs):
    """The same call on an unpatched copy of the same model."""
    return tiny_llama(seed).generate(*args, **kwargs)


@pytest.mark.parametrize("mode", ["exit", "verify"])
def test_never_exit_generate_equals_plain_generate(mode):
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode=mode, **NEVER_EXIT)
    ids = prompt(0)
    out = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, plain_generate(0, ids, max_new_tokens=20, do_sample=False))
    assert router.last_stats is not None and router.last_stats.new_tokens == 20
    assert router.last_stats.mode == mode


def test_generate_routes_exits_and_verify_mode_stays_identical():
    model = tiny_llama(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    ids = prompt(1)
    routed = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert router.last_stats.hit_rate > 0  # tokens really left early
    assert torch.equal(routed, router.generate(ids, max_new_tokens=24).sequences)  # the same engine
    verify = GenerationConfig(max_new_tokens=24, do_sample=False, early_exit_mode="verify")
    verified = model.generate(ids, generation_config=verify)
    assert router.last_stats.mode == "verify" and router.last_stats.drafts_judged > 0  # drafts were verified
    assert torch.equal(verified, plain_generate(1, ids, max_new_tokens=24, do_sample=False))


def test_sampling_with_never_exit_draws_the_same_tokens_as_plain_generate():
    model = tiny_llama(2)
    EarlyExitRouter.from_model(model, exit_layers=[2], **NEVER_EXIT)
    ids = prompt(2)
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    plain = tiny_llama(2)  # built first: building a tiny model seeds the global generator
    torch.manual_seed(7)
    routed = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    assert torch.equal(routed, plain.generate(ids, **kwargs))


@pytest.mark.parametrize("source", ["exits", "copies"])
def test_sampled_verify_mode_draws_the_tokens_plain_sampling_draws_whatever_is_drafted(source):
    """Each position's token is the full model's draw with that position's noise, the noise torch.multinomial
    draws: drafts (the exits' own samples, or the n-gram tier's copies) change how many passes it takes, never the
    tokens. So verify-mode sampling gives plain HF sampling's tokens from the same seed, and a router's store of
    earlier calls (other drafts) leaves a seeded call's output as it was."""
    model = tiny_llama(0)
    drafting = dict(exit_layers=[1, 3], policy="fixed", draft_vocab_size=0, max_pending=6)
    if source == "exits":
        drafting.update(MIXED, ngram_tier=False)
    else:
        drafting.update(NEVER_EXIT, ngram_tier=True, ngram_min_size=1)
    router = EarlyExitRouter.from_model(model, mode="verify", **drafting)
    ids = torch.tensor([[5, 17, 33, 41, 9, 5, 17, 33, 41, 9, 5, 17]])  # a loop: copies to draft
    kwargs = dict(max_new_tokens=40, do_sample=True, temperature=1.3, top_k=40)
    plain = tiny_llama(0)
    drafts = rejected = early = 0
    for seed, eos in [(s, e) for s in range(4) for e in (None, 36)]:  # 36: ends the text, at times in a pass
        torch.manual_seed(seed)
        routed = model.generate(ids, **kwargs, eos_token_id=eos)
        after = torch.random.get_rng_state()
        drafts += router.last_stats.drafts_judged
        rejected += router.last_stats.rejected_drafts
        early += routed.shape[1] < ids.shape[1] + 40
        torch.manual_seed(seed)
        assert torch.equal(routed, plain.generate(ids, **kwargs, eos_token_id=eos)), seed
        # The generator ends where HF's sampling leaves it, though noise was drawn past the end for drafts
        assert torch.equal(after, torch.random.get_rng_state()), (seed, eos)
    assert drafts > 20 and rejected > 0 and early > 0  # drafts were judged, some refused; some texts ended early
    first = router.generate(ids, seed=11, **kwargs).sequences
    router.generate(first, seed=3, **kwargs)  # the store now holds other text to copy from
    assert torch.equal(router.generate(ids, seed=11, **kwargs).sequences, first)


def test_router_generate_takes_unset_sampling_arguments_from_the_generation_config_as_hf_does():
    """A model whose generation config samples (as many chat models' do) samples under router.generate too, with
    its temperature and top_k; with a seed, verify mode draws HF's tokens."""
    sampling = dict(do_sample=True, temperature=0.8, top_k=3)
    model, plain = tiny_llama(0), tiny_llama(0)
    for m in (model, plain):
        m.generation_config.update(**sampling)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids = prompt(0)
    routed = router.generate(ids, 20, seed=5)
    torch.manual_seed(5)
    assert torch.equal(routed.sequences, plain.generate(ids, max_new_tokens=20))
    assert routed.stats.drafts_judged > 0
    greedy = router.generate(ids, 20, do_sample=False).sequences  # an argument given wins over the config
    assert torch.equal(greedy, plain.generate(ids, max_new_tokens=20, do_sample=False))


def test_custom_generate_none_is_routed_and_a_seeded_plain_call_leaves_the_global_generator_as_it_was():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids = prompt(0)
    router.last_stats = None
    out = model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=None)  # a wrapper passing every arg
    assert router.last_stats is not None and torch.equal(out, plain_generate(0, ids, max_new_tokens=8, do_sample=False))
    state = torch.random.get_rng_state()
    with router.disabled():
        router.generate(ids, 8, do_sample=True, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_processors_stopping_criteria_streamer_and_dict_output_work_as_in_hf():
    model = tiny_llama(3)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids = prompt(3)

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 9, dtype=torch.bool)

    reference = plain_generate(3, ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :]
    banned = int(reference[2])
    kwargs = dict(
        max_new_tokens=30,
        do_sample=False,
        suppress_tokens=[banned],
        repetition_penalty=1.3,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    streamer = Collect()
    criteria = StoppingCriteriaList([StopAfter()])
    plain = plain_generate(3, ids, stopping_criteria=criteria, **kwargs)
    out = model.generate(ids, stopping_criteria=criteria, streamer=streamer, **{**kwargs, "output_scores": False})
    assert router.last_stats.drafts_judged > 0  # drafts were proposed and verified on the way
    assert torch.equal(out.sequences, plain.sequences)
    assert out.sequences.shape[1] == ids.shape[1] + 9 and banned not in out.sequences[0, ids.shape[1] :].tolist()
    assert streamer.puts[0] == ids[0].tolist() and streamer.ended
    assert sum(streamer.puts[1:], []) == out.sequences[0, ids.shape[1] :].tolist()
    router.last_stats = None
    out = model.generate(ids, **{**kwargs, "max_new_tokens": 9})  # per-step scores: with HF's own criteria only
    assert router.last_stats.drafts_judged > 0
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == len(plain.scores) == len(out.logits) == 9
    for mine, theirs in zip(out.scores, plain.scores):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    for mine, theirs in zip(out.logits, plain.logits):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_beams=2),
        dict(prompt_lookup_num_tokens=3),
        dict(do_sample=True, num_return_sequences=3),  # several sequences from one prompt: a batch
        dict(num_beams=3, num_return_sequences=2),
    ],
)
def test_modes_the_router_does_not_serve_run_plain_hf_generation(kwargs):
    model = tiny_llama(4)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    ids = prompt(4)
    model.generate(ids, max_new_tokens=4)
    assert router.last_stats is not None  # a routed call's statistics, which the plain call below must not keep
    torch.manual_seed(11)
    out = model.generate(ids, max_new_tokens=10, **kwargs)
    assert router.last_stats is None  # the router was not involved
    assert out.shape[0] == kwargs.get("num_return_sequences", 1)
    plain = tiny_llama(4)  # built (and so seeded) before the generator is seeded for sampling
    torch.manual_seed(11)
    assert torch.equal(out, plain.generate(ids, max_new_tokens=10, **kwargs))


@pytest.mark.parametrize("penalty", [1.0, 1.5], ids=["no processor", "repetition penalty"])
@pytest.mark.parametrize("mode", ["verify", "exit"])
def test_a_left_padded_batch_is_routed_and_verify_equals_hf(mode, penalty):
    model = tiny_llama(5)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(MIXED, high_conf_threshold=0.0))
    ids = torch.cat([prompt(5), prompt(6)])
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # row 0 is two tokens shorter, padded on the left
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, repetition_penalty=penalty)
    out = model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(**kwargs, early_exit_mode=mode))
    assert router.last_stats is not None and router.last_stats.new_tokens == 24  # routed, both rows
    assert router.last_stats.hit_rate > 0 or router.last_stats.rejected_drafts > 0  # and drafts were made
    if mode == "verify":  # the drafts are judged after the processors, as HF chooses its tokens
        assert torch.equal(out, plain_generate(5, ids, attention_mask=mask, **kwargs))


def test_a_batch_asking_for_scores_runs_plain_hf_generation():
    model = tiny_llama(5)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    ids = torch.cat([prompt(5), prompt(6)])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    assert router.last_stats is None
    assert torch.equal(out.sequences, plain_generate(5, ids, max_new_tokens=8, do_sample=False))


def test_unpatch_and_disabled_restore_plain_generate():
    model = tiny_llama(6)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    assert "generate" in model.__dict__
    with router.disabled() as plain:
        assert "generate" not in plain.__dict__
        plain.generate(prompt(6), max_new_tokens=4, do_sample=False)
    assert router.last_stats is None and "generate" in model.__dict__
    router.unpatch()
    assert "generate" not in model.__dict__
    assert model.generate.__func__ is type(model).generate


def test_the_patched_generate_has_the_signature_of_plain_generate():
    """inspect.signature(model.generate) was the class function's, `self` first: binding a call's arguments to it
    put the ids in `self`."""
    import copy
    import inspect

    plain, model = tiny_llama(6), tiny_llama(6)
    EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    assert inspect.signature(model.generate) == inspect.signature(plain.generate)
    bound = inspect.signature(model.generate).bind(prompt(6), max_new_tokens=4)
    assert torch.equal(model.generate(*bound.args, **bound.kwargs), plain.generate(prompt(6), max_new_tokens=4))
    assert inspect.signature(copy.deepcopy(model).generate) == inspect.signature(plain.generate)


def test_a_model_whose_generate_is_overridden_is_refused_untouched():
    model = tiny_llama(7)
    model.generate = lambda *a, **k: None
    with pytest.raises(ValueError, match="del model.generate"):
        EarlyExitRouter.from_model(model, exit_layers=[1, 3])
    assert "_early_exit_router" not in model.__dict__


def test_a_padded_batch_sampling_in_verify_mode_is_routed_per_row():
    model = tiny_llama(5)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **dict(MIXED, ngram_tier=True))
    ids = torch.cat([prompt(5), prompt(6)])
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    config = GenerationConfig(max_new_tokens=12, do_sample=True, top_k=1, pad_token_id=0, early_exit_mode="verify")
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    assert router.last_stats is not None and router.last_stats.new_tokens == 24  # routed, both rows
    # one token left with probability 1 (top_k=1): the per-row sampling rule gives HF's greedy output
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out, plain_generate(5, ids, attention_mask=mask, **greedy))


def test_calls_the_router_cannot_serve_as_asked_run_plain_hf_generation():
    """Embeddings in place of ids, hidden states or attentions asked for, and a mode the model's own generation
    config sets (generate() fills a passed config's unset fields from it): plain HF runs them, as unpatched."""
    model, plain = tiny_llama(4), tiny_llama(4)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], **MIXED)
    ids = prompt(4)
    embeds = model.get_input_embeddings()(ids)
    for kwargs in (
        dict(inputs_embeds=embeds),
        dict(inputs_embeds=embeds * 0.5, input_ids=ids),
        dict(inputs=ids, return_dict_in_generate=True, output_hidden_states=True),
        dict(inputs=ids, return_dict_in_generate=True, output_attentions=True),
    ):
        out = model.generate(max_new_tokens=5, do_sample=False, **kwargs)
        want = plain.generate(max_new_tokens=5, do_sample=False, **kwargs)
        assert router.last_stats is None, kwargs
        if torch.is_tensor(out):
            assert torch.equal(out, want)
        else:
            assert torch.equal(out.sequences, want.sequences) and len(out.hidden_states or out.attentions) == 5
    for m in (model, plain):
        m.generation_config.num_beams = 2
    asked = GenerationConfig(max_new_tokens=8, do_sample=False)  # num_beams unset: the model's 2 applies
    assert torch.equal(model.generate(ids, generation_config=asked), plain.generate(ids, generation_config=asked))
    assert router.last_stats is None


def test_stop_strings_passed_to_generate_are_matched_by_the_router():
    """generate() hands a callable custom_generate no tokenizer, and would refuse stop strings without one: the
    router matches them itself, routed or not, as `router.generate(stop_strings=...)` does."""
    from .conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    ids = prompt(0)
    free = router.generate(ids, max_new_tokens=12).sequences[0, ids.shape[1] :].tolist()
    stop = tokenizer.decode(free[3:5])
    want = router.generate(ids, max_new_tokens=12, stop_strings=[stop]).sequences
    assert want.shape[1] == ids.shape[1] + 5
    for passed in ({"tokenizer": tokenizer}, {}):  # the call's tokenizer, or the router's
        routed = model.generate(ids, max_new_tokens=12, do_sample=False, stop_strings=[stop], **passed)
        assert torch.equal(routed, want) and router.last_stats.new_tokens == 5
    bare = tiny_llama(0)
    EarlyExitRouter.from_model(bare, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        bare.generate(ids, max_new_tokens=12, do_sample=False, stop_strings=[stop])


def _a_batch_whose_row_0_ends_early():
    """A plain model, a patched copy and its router, a batch of two prompts, HF's greedy output for it, and a token
    that ends row 0 only, a few tokens in."""
    plain, model = tiny_llama(0), tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    batch = torch.cat([prompt(5), prompt(6)])
    ref = plain.generate(batch, max_new_tokens=10, do_sample=False)
    first, second = ref[0, 6:].tolist(), ref[1, 6:].tolist()
    early = next(t for t in first[1:5] if t not in second)
    return plain, model, router, batch, ref, early


def test_finished_rows_are_padded_as_hf_pads_them():
    """generate() fills finished rows of a batch with its pad id, else its first EOS id, in the order given."""
    plain, model, router, batch, ref, early = _a_batch_whose_row_0_ends_early()
    other = next(t for t in range(2, early) if t not in ref[:, 6:])  # a smaller EOS id
    for eos in ([early, other], [other, early]):
        want = plain.generate(batch, max_new_tokens=10, do_sample=False, eos_token_id=eos)
        assert torch.equal(model.generate(batch, max_new_tokens=10, do_sample=False, eos_token_id=eos), want)
        assert router.last_stats is not None


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_pad_and_eos_ids_given_as_tensors_or_numpy_ints_are_used_as_hf_uses_them(kind):
    """HF's generate takes token ids as tensors too; the pad id was ignored (rows padded with EOS) and a tensor EOS
    id raised."""
    import numpy as np

    plain, model, router, batch, ref, early = _a_batch_whose_row_0_ends_early()
    pad = next(t for t in range(2, 96) if t not in batch and t not in ref)  # a pad id in a prompt masks it there
    wrap = torch.tensor if kind == "tensor" else np.int64
    for eos in (wrap(early), torch.tensor([early]) if kind == "tensor" else np.array([early])):
        want = plain.generate(batch, max_new_tokens=10, do_sample=False, eos_token_id=early, pad_token_id=pad)
        got = model.generate(batch, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=wrap(pad))
        assert torch.equal(got, want) and got[0, -1] == pad
        assert router.last_stats is not None


class BanEverything:
    def __call__(self, input_ids, scores):
        return torch.full_like(scores, float("-inf"))


def test_sampling_with_every_token_banned_raises_as_hf_does_not_token_zero():
    """HF's multinomial refuses a row with nothing to draw; the router's seeded draw picked token 0 silently."""
    from transformers import LogitsProcessorList

    plain, model = tiny_llama(0), tiny_llama(0)
    EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    kwargs = dict(max_new_tokens=4, do_sample=True, logits_processor=LogitsProcessorList([BanEverything()]))
    with pytest.raises(RuntimeError):
        plain.generate(prompt(0), **kwargs)
    with pytest.raises(RuntimeError, match="no token to draw"):
        model.generate(prompt(0), **kwargs)


class PenalizeInPlace:
    """A processor that edits the scores it is handed, as a caller's own may."""

    def __call__(self, input_ids, scores):
        scores[:, 5] -= 100.0
        return scores


def test_output_scores_apply_an_in_place_processor_once_as_hf_does():
    """The scores were recomputed from logits the decode's own processing had already edited in place."""
    from transformers import LogitsProcessorList

    plain, model = tiny_llama(0), tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    want = plain.generate(prompt(0), logits_processor=LogitsProcessorList([PenalizeInPlace()]), **kwargs)
    got = model.generate(prompt(0), logits_processor=LogitsProcessorList([PenalizeInPlace()]), **kwargs)
    assert router.last_stats is not None and torch.equal(got.sequences, want.sequences)
    for mine, theirs in zip(got.scores, want.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_greedy_ignores_temperature_as_hf_does():
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    want = router.generate(prompt(0), 6).sequences
    for temperature in (0.0, None):
        assert torch.equal(router.generate(prompt(0), 6, temperature=temperature).sequences, want)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        router.generate(prompt(0), 6, do_sample=True, temperature=0.0)


class StopRowsTogether(StoppingCriteria):
    """A criterion that reads the whole batch, as HF hands it one: it stops every row once row 0 has made `n`
    tokens after the prompt (lm-eval's keeps a flag per row index the same way)."""

    def __init__(self, prompt_len: int, n: int) -> None:
        self.prompt_len, self.n = prompt_len, n

    def __call__(self, input_ids, scores, **kwargs):
        assert input_ids.shape[0] == 2, "HF shows a criterion the whole batch"
        return torch.full((2,), input_ids.shape[1] - self.prompt_len >= self.n)


def test_calls_whose_processors_or_criteria_need_what_routing_changes_run_plain_hf(monkeypatch):
    """Stateful processors (guidance's own cache), token healing (it needs the tokenizer custom_generate loses),
    synced GPUs, and in a batch: a criterion or processor that reads the batch whole (or a row's index in it), or a
    stop string without EOS (HF lets a stopped row run on)."""
    from .conftest import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = "<bos>"  # token healing pads
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *args, **kwargs: None)  # one process
    model, plain = tiny_llama(4), tiny_llama(4)
    assert model.generation_config.eos_token_id is None
    router = EarlyExitRouter.from_model(model, tokenizer, exit_layers=[1, 3], **MIXED)
    ids, batch = prompt(4), torch.cat([prompt(5), prompt(6)])
    allowed = [list(range(2, 40)), list(range(40, 90))]
    calls = [
        (ids, dict(guidance_scale=1.5)),
        (ids, dict(token_healing=True, tokenizer=tokenizer)),
        (ids, dict(synced_gpus=True)),
        (batch, dict(stopping_criteria=StoppingCriteriaList([StopRowsTogether(6, 3)]))),
        (batch, dict(prefix_allowed_tokens_fn=lambda row, ids: allowed[row])),
    ]
    for inputs, kwargs in calls:
        router.last_stats = None
        out = model.generate(inputs, max_new_tokens=8, do_sample=False, **kwargs)
        assert router.last_stats is None, kwargs
        assert torch.equal(out, plain.generate(inputs, max_new_tokens=8, do_sample=False, **kwargs)), kwargs
    # (HF's StopStringCriteria cannot read the tiny tokenizer's vocabulary: the stop-without-EOS rule alone)
    assert _reads_the_batch([], [], [], ("w5",))
    assert not _reads_the_batch([], [], [3], ("w5",))


def test_eos_token_id_none_stops_at_no_eos_as_in_hf():
    plain, model = tiny_llama(0), tiny_llama(0)
    ids = prompt(1, 6)
    free = plain.generate(ids, max_new_tokens=10, do_sample=False)[0, 6:].tolist()
    for m in (plain, model):
        m.generation_config.eos_token_id = free[3]
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **NEVER_EXIT)
    for kwargs in (dict(), dict(eos_token_id=None)):
        want = plain.generate(ids, max_new_tokens=10, do_sample=False, **kwargs)
        assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, **kwargs), want)
        assert router.last_stats is not None
    assert want.shape[1] == 16  # eos_token_id=None: no EOS, all ten tokens


def test_a_cache_the_caller_passes_holds_the_run_as_in_hf_and_continues_it():
    """generate() leaves the cache a caller passed holding the run's states: a routed run gives it the router's
    layers (what a full forward pass leaves), and a call that continues from it runs as HF continues."""
    from transformers import DynamicCache

    from early_exit_router.models import _compat

    model, plain = tiny_llama(1), tiny_llama(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids = prompt(1)
    mine, theirs = DynamicCache(), DynamicCache()
    out = model.generate(ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, cache=mine)
    want = plain.generate(ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, cache=theirs)
    assert router.last_stats is not None and router.last_stats.drafts_judged > 0  # routed, with drafts
    assert torch.equal(out.sequences, want.sequences)
    assert _compat.forward_cache(out) is mine and mine.get_seq_length() == theirs.get_seq_length()
    assert_cache_matches_full_forward(model, out.sequences, mine)
    router.last_stats = None
    more = model.generate(out.sequences, max_new_tokens=8, do_sample=False, cache=mine)
    assert router.last_stats is None  # a cache to continue from: plain HF generation
    assert torch.equal(more, plain.generate(want.sequences, max_new_tokens=8, do_sample=False, cache=theirs))


def test_a_caller_cache_with_a_layout_of_its_own_is_filled_by_plain_hf():
    """A static cache, or a dynamic one for a batch, keeps the layout HF gives it: plain HF generation fills it."""
    from transformers import DynamicCache, StaticCache

    model, plain = tiny_llama(1), tiny_llama(1)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids, batch = prompt(1), torch.cat([prompt(5), prompt(6)])
    for inputs, new_cache in (
        (ids, lambda m: StaticCache(config=m.config, max_cache_len=64)),
        (batch, lambda m: DynamicCache()),
    ):
        mine, theirs = new_cache(model), new_cache(plain)
        out = model.generate(inputs, max_new_tokens=8, do_sample=False, cache=mine)
        assert router.last_stats is None
        assert torch.equal(out, plain.generate(inputs, max_new_tokens=8, do_sample=False, cache=theirs))
        for layer, reference in zip(mine.layers, theirs.layers):
            assert torch.equal(layer.keys, reference.keys)


class ScoresSeen(StoppingCriteria):
    """Keeps what it is handed as `scores` (None, or how many steps' scores) and never stops."""

    def __init__(self) -> None:
        self.seen: list = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(scores if scores is None else len(scores))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_stopping_criteria_are_handed_the_scores_hf_hands_them():
    """HF's generate hands its criteria None as scores, or every step's scores so far when per-step scores are asked
    for: routed, a criterion gets None; asked for scores, a caller's own criteria run in plain HF."""
    model, plain = tiny_llama(0), tiny_llama(0)
    ids, n = prompt(3, 8), 12
    theirs = ScoresSeen()
    plain.generate(ids, max_new_tokens=n, do_sample=False, stopping_criteria=[theirs])
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    mine = ScoresSeen()
    model.generate(ids, max_new_tokens=n, do_sample=False, stopping_criteria=[mine])
    assert router.last_stats is not None and router.last_stats.drafts_judged > 0
    assert mine.seen == theirs.seen == [None] * n
    asked = dict(max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_scores=True)
    mine, theirs = ScoresSeen(), ScoresSeen()
    router.last_stats = None
    out = model.generate(ids, stopping_criteria=[mine], **asked)
    want = plain.generate(ids, stopping_criteria=[theirs], **asked)
    assert router.last_stats is None and torch.equal(out.sequences, want.sequences)
    assert mine.seen == theirs.seen == list(range(1, n + 1))
    out = model.generate(ids, **asked)  # HF's own criteria read no scores: routed
    assert router.last_stats is not None and torch.equal(out.sequences, want.sequences)


PER_ROW_PROCESSORS = [
    {"repetition_penalty": 1.4},  # holds each row's padding length
    {"encoder_repetition_penalty": 1.5},  # hold the batch's prompts, one row each
    {"encoder_no_repeat_ngram_size": 2},
]


@pytest.mark.parametrize("processor", PER_ROW_PROCESSORS, ids=lambda kw: next(iter(kw)))
@pytest.mark.parametrize("design", ["synchronous", "per_row"])
def test_a_padded_batch_with_processors_that_hold_rows_is_routed_row_by_row_as_hf_processes(design, processor):
    """HF's repetition penalty holds each row's padding length, its encoder penalties each row's prompt, and they
    refuse (or divide by) a batch of another size: rows scored one at a time (per-row verify, sampling) see their
    own row's, and verify mode equals HF's batched greedy. Prompts that repeat themselves give the n-gram tier
    drafts to verify in either design."""
    model = tiny_llama(5)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], **{**MIXED, "batch_design": design, "ngram_tier": True, "ngram_min_size": 1}
    )
    ids = torch.cat([prompt(5, 6).repeat(1, 3), prompt(6, 6).repeat(1, 3)])
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    kwargs = dict(max_new_tokens=12, pad_token_id=0, attention_mask=mask, **processor)
    verify = GenerationConfig(early_exit_mode="verify")
    out = model.generate(ids, do_sample=False, generation_config=verify, **kwargs)
    assert router.last_stats is not None and router.last_stats.drafts_judged > 0
    assert torch.equal(out, plain_generate(5, ids, do_sample=False, **kwargs))
    sampled = model.generate(ids, do_sample=True, generation_config=verify, **kwargs)
    assert router.last_stats is not None and router.last_stats.drafts_judged > 0 and sampled.shape[0] == 2


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled verify", "per_row design"])
def test_a_batch_decoded_per_row_returns_the_runs_cache_by_running_plain_hf(sampled):
    """A batch decoded per row (sampling in verify mode, or `batch_design="per_row"`) keeps no batch cache: asked for
    the outputs as a dict with the run's cache, it runs plain HF and returns HF's; without a cache it is routed."""
    from early_exit_router.models import _compat

    model, plain = tiny_llama(5), tiny_llama(5)
    router = EarlyExitRouter.from_model(
        model, exit_layers=[1, 3], mode="verify", **{**MIXED, "batch_design": "per_row"}
    )
    ids = torch.cat([prompt(5, 6), prompt(6, 6)])
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    asked = dict(attention_mask=mask, max_new_tokens=8, do_sample=sampled, pad_token_id=0, return_dict_in_generate=True)
    router.last_stats = None
    torch.manual_seed(3)
    out = model.generate(ids, **asked)
    torch.manual_seed(3)
    want = plain.generate(ids, **asked)
    assert router.last_stats is None and torch.equal(out.sequences, want.sequences)
    assert _compat.forward_cache(out).get_seq_length() == want.sequences.shape[1] - 1
    torch.manual_seed(3)
    out = model.generate(ids, **asked, use_cache=False)
    assert router.last_stats is not None and torch.equal(out.sequences, want.sequences)
    assert _compat.forward_cache(out) is None


def test_calls_with_their_own_positions_masks_or_cache_layout_run_plain_hf():
    """`position_ids`, a mask that is not left padding, and a cache_implementation with a layout of its own run
    plain HF generation, as unpatched; without a cache (use_cache=False) no cache is returned."""
    model, plain = tiny_llama(4), tiny_llama(4)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode="verify", **MIXED)
    ids = prompt(4)
    right = torch.ones_like(ids)
    right[0, -2:] = 0
    for kwargs in (
        dict(position_ids=torch.arange(ids.shape[1])[None] + 3),
        dict(attention_mask=right),
        dict(cache_implementation="static"),
    ):
        router.last_stats = None
        out = model.generate(ids, max_new_tokens=6, do_sample=False, **kwargs)
        assert router.last_stats is None, kwargs
        assert torch.equal(out, plain.generate(ids, max_new_tokens=6, do_sample=False, **kwargs)), kwargs
    from early_exit_router.models import _compat

    asked = dict(max_new_tokens=6, do_sample=False, use_cache=False, return_dict_in_generate=True)
    out, want = model.generate(ids, **asked), plain.generate(ids, **asked)
    assert router.last_stats is not None and torch.equal(out.sequences, want.sequences)
    assert _compat.forward_cache(out) is None and _compat.forward_cache(want) is None


@pytest.mark.parametrize("mode, routing", [("exit", NEVER_EXIT), ("verify", MIXED)])
def test_an_until_eos_max_new_tokens_decodes_to_eos_as_hf_does(mode, routing, monkeypatch):
    """Callers pass huge max_new_tokens to mean "until EOS": plain HF decodes to EOS, and so must the router (it
    sized its token slots by max_new_tokens up front, 8 TB at 2**40). Few slots at the start make them grow too."""
    from early_exit_router.decode import loop

    monkeypatch.setattr(loop, "SLOTS_AHEAD", 3)
    ids = prompt(3)  # its greedy text reaches new tokens late (many tiny-model texts loop at once)
    greedy = plain_generate(0, ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :].tolist()
    eos = next(t for k, t in enumerate(greedy) if k >= 12 and t not in greedy[:k])  # first reached after 12 tokens
    want = plain_generate(0, ids, max_new_tokens=2**40, eos_token_id=eos, do_sample=False)
    model = tiny_llama(0)
    router = EarlyExitRouter.from_model(model, exit_layers=[1, 3], mode=mode, **routing)
    assert torch.equal(model.generate(ids, max_new_tokens=2**40, eos_token_id=eos, do_sample=False), want)
    assert router.last_stats.new_tokens > 12
