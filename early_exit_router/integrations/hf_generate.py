"""The in-place patch on a Hugging Face model, and `model.generate()` on a patched model.

`attach` installs a `RoutedGenerate` object as the instance attribute `generate` and a back-reference to the router
(the class's method stays untouched); `detach` deletes both, so plain `generate` is back exactly. Neither adds a
module, parameter, buffer or hook. Each `model.generate` call goes to the class's own `generate`, which validates
arguments, merges the `GenerationConfig`, builds the logits processors and stopping criteria as usual, and then hands
them to the router's decode loop through transformers' `custom_generate` callable extension point. Nothing new is
added to `generate`'s keyword arguments.

Batches (several sequences, left padding) run through the router's batch decoder, except per-step scores or logits,
streamers, criteria or processors that read the batch whole (`_reads_the_batch`), and outputs as a dict with the
run's cache where the batch decodes per row (sampling in verify mode; it keeps no batch cache), which run plain HF
generation.
Calls the router cannot serve (beam search, assisted generation, a user's own `custom_generate`, a cache to continue
from, guidance and watermarks (processors with state of their own), token healing, synced GPUs, `position_ids`, masks
that are not left padding, per-step scores beside a user's own stopping criteria, which may read them) run plain HF
generation, unchanged. An empty cache the caller passes holds the run's states afterwards, as in HF: a dynamic one
for one sequence takes the router's layers; a static, quantized or offloading one (the caller's, or
`cache_implementation`'s), or one for a batch, is filled by plain HF generation. A user's logits processors must
depend only on the ids they are shown, as for HF's assisted generation: drafts are scored before the full model has
judged them. The last call's `GenerationStats` is `router.last_stats`. `plain_generate` is what a router inside
`disabled()` runs.
"""

from __future__ import annotations

import _thread
import functools
import inspect
import time
import weakref
from typing import Any

import torch
from torch import nn
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from early_exit_router.decode.inputs import padding_problem
from early_exit_router.decode.output import GenerationOutput
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stats import plain_stats
from early_exit_router.decode.stopping import DecodeRequest, as_stop_strings, as_token_ids
from early_exit_router.models import _compat

ROUTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
# The router decodes from token ids and places them as the mask says: calls with these run plain HF
PLAIN_ONLY_INPUTS = ("inputs_embeds", "position_ids")
# HF's own criteria that judge each row by itself, keep no state and never read their scores: the router calls them
# row by row
PER_ROW_CRITERIA = (MaxLengthCriteria, MaxTimeCriteria, EosTokenCriteria, StopStringCriteria)
ROUTER_ATTR = "_early_exit_router"  # back-reference, to refuse patching one model twice
# model -> (a weak reference to) its router, kept also while the router is inside disabled(), where the model holds
# no back-reference: a second router patching it then would be overwritten when the block ends
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
GENERATE_ATTR = "generate"  # instance attribute: model.generate() routes through the router


def check_patchable(model: nn.Module) -> None:
    """Refuse a model that is patched already or whose `generate` another plugin overrides (nothing is changed)."""
    owner = _OWNERS.get(model)
    if getattr(model, ROUTER_ATTR, None) is not None or (owner is not None and owner() is not None):
        raise ValueError(
            "This model is already patched by an EarlyExitRouter (perhaps inside its disabled() block): reuse that "
            "router, or call its unpatch() first."
        )
    if GENERATE_ATTR in model.__dict__:
        raise ValueError(
            "model.generate is overridden on this model object (by another plugin or a custom_generate repo); "
            "the router would hide it. Delete that attribute first (del model.generate)."
        )


def attach(router: Any) -> None:
    """Patch `router.model` in place: the back-reference and the routed `generate`; undone exactly by `detach`."""
    model = router.model
    try:
        model.__dict__[ROUTER_ATTR] = router
        _OWNERS[model] = weakref.ref(router)
        if hasattr(type(model), "generate"):
            model.__dict__[GENERATE_ATTR] = RoutedGenerate(router)  # shadows the class's generate
    except BaseException:
        detach(model, release=True)
        raise


def detach(model: nn.Module, release: bool = False) -> None:
    """Remove everything `attach` added; `release`: the router lets the model go for good (unpatch), so that
    another may patch it."""
    model.__dict__.pop(ROUTER_ATTR, None)
    if release:
        _OWNERS.pop(model, None)
    if isinstance(model.__dict__.get(GENERATE_ATTR), RoutedGenerate):
        del model.__dict__[GENERATE_ATTR]


class RouterLock(_thread.RLock):
    """The router's re-entrant lock. The patch makes the router part of the model's `__dict__`, so copying the
    model (`copy.deepcopy`, as TRL's reference models do) copies the router too: a copy gets a lock of its own."""

    def __deepcopy__(self, memo: dict[int, Any]) -> RouterLock:
        return type(self)()

    def __reduce__(self) -> tuple[type, tuple]:
        return type(self), ()


class RoutedGenerate:
    """The patched model's `generate`: same signature and results as HF's, routed where the router applies."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self._plain = type(router.model).generate  # the class's function, never the instance attribute
        functools.update_wrapper(self, self._plain)
        # update_wrapper leads inspect.signature to the class's function, `self` first: the bound method's signature
        # starts after it (callers that bind arguments to it would put the ids in `self`)
        unbound = inspect.signature(self._plain)
        self.__signature__ = unbound.replace(parameters=list(unbound.parameters.values())[1:])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.router.model
        bound = inspect.signature(self._plain).bind(model, *args, **kwargs)
        named = dict(bound.arguments)
        named.pop(next(iter(named)))  # self
        extra = named.pop("kwargs", {})
        config = self._routable(named, extra)
        if config is None:
            self.router.last_stats = None  # this call is not the router's: no statistics of an earlier one stay
            return self._plain(model, **named, **extra)
        streamer = named.pop("streamer", None)  # a callable custom_generate never receives it: we stream
        # generate() drops `tokenizer` on the way to a callable custom_generate, and would then refuse stop strings
        # for want of one: the router matches them itself, as HF's StopStringCriteria does.
        stops = as_stop_strings(config.stop_strings)
        tokenizer = extra.get("tokenizer") or self.router.tokenizer
        if stops:
            if tokenizer is None:
                raise ValueError("stop_strings need a tokenizer: pass tokenizer= to generate(), or build the router "
                                 "with one (EarlyExitRouter.from_model(model, tokenizer, ...)).")  # fmt: skip
            extra["stop_strings"] = None  # the highest-priority setting: HF builds no criterion of its own
        decode = functools.partial(_routed_decoding, self.router, streamer=streamer, stops=(stops, tokenizer))
        named.pop("custom_generate", None)  # None (a wrapper that passes every argument): ours takes its place
        return self._plain(model, **named, custom_generate=decode, **extra)

    def _routable(self, named: dict[str, Any], extra: dict[str, Any]) -> Any:
        """The call's generation config, merged as generate() merges it, where the router serves the call (else
        None: plain HF generation runs it)."""
        if named.get("custom_generate") is not None or named.get("assistant_model") is not None:
            return None
        if any(extra.get(k) is not None for k in PLAIN_ONLY_INPUTS):
            return None
        if _compat.syncs_gpus(self.router.model, named.get("synced_gpus")):  # custom_generate never receives it
            return None
        config = _compat.merged_generation_config(self.router.model, named.get("generation_config"), extra)
        if (config.num_return_sequences or 1) > 1 or config.output_hidden_states or config.output_attentions:
            return None
        # Processors that keep state across calls (classifier-free guidance's own cache, SynthID's context) must see
        # each token once, which drafting does not do; token healing needs the tokenizer custom_generate loses.
        stateful = config.guidance_scale not in (None, 1) or config.watermarking_config is not None
        if stateful or config.token_healing:
            return None
        return config if config.get_generation_mode() in ROUTED_MODES else None


def _routed_decoding(
    router: Any,
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    stops: tuple[tuple[str, ...], Any] = ((), None),
    **model_kwargs: Any,
) -> Any:
    """A decoding method with `GenerationMixin._sample`'s signature that runs the router's decoder; `stops`: the
    call's stop strings and the tokenizer to match them with."""
    mask = model_kwargs.get("attention_mask")
    cache = model_kwargs.get(_compat.GENERATE_CACHE_KWARG)
    batched = input_ids.shape[0] != 1 or (mask is not None and not bool((mask != 0).all()))
    # A cache the caller passed holds the run's states afterwards, as in HF: the decode's layers go into it where
    # they line up with what HF would leave there (one sequence, an empty dynamic cache). A cache to continue from,
    # and a static, quantized or offloading one (the caller's, or the one `cache_implementation` asks for): HF.
    mine = cache if getattr(cache, "_is_user_defined", False) else None
    plain_cache = (cache is not None and not _compat.can_adopt_layers(cache)) or (mine is not None and batched)
    unpadded = mask is not None and padding_problem(mask) is not None  # HF generates from it; the router refuses it
    mode = getattr(generation_config, "early_exit_mode", None) or router.config.mode
    want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    # The merged config's EOS ids only (None: no EOS, as generate(eos_token_id=None) asks).
    eos_ids = as_token_ids(generation_config.eos_token_id)
    # The batch decoder returns no per-step scores; HF streamers take one row; a batch's rows decode at their own
    # pace, so criteria and processors that read the whole batch at once (or a row's index in it) see it only in HF.
    per_batch = batched and (want_scores or want_logits or streamer is not None or _reads_the_batch(
        logits_processor, stopping_criteria, eos_ids, stops[0]))  # fmt: skip
    # HF hands stopping criteria the scores so far only when per-step scores are asked for (else None, as the router
    # does): a caller's own criteria may then read them.
    scored = want_scores and any(not isinstance(c, PER_ROW_CRITERIA) for c in stopping_criteria or ())
    # A batch whose rows decode one after another would run them all on HF's one max_time clock: the first row
    # could spend it all, where HF's batch gives every row the same steps.
    timed = any(isinstance(c, MaxTimeCriteria) for c in stopping_criteria or ())
    sampling = bool(generation_config.do_sample)
    timed_alone = batched and timed and not router.can_batch(None, mode, sampling)
    # HF returns the run's cache with the outputs; a batch decoded per row (or row after row) has none to return.
    keeps_cache = generation_config.return_dict_in_generate and generation_config.use_cache is not False
    cacheless = batched and keeps_cache and not router.can_batch(None, mode, sampling, cache=True)
    if plain_cache or per_batch or unpadded or scored or timed_alone or cacheless:
        if streamer is not None:  # generate() skipped the prompt's put: the streamer was ours to handle
            streamer.put(input_ids.cpu())
        if stops[0]:
            criterion = StopStringCriteria(tokenizer=stops[1], stop_strings=stops[0])
            stopping_criteria = StoppingCriteriaList([*(stopping_criteria or ()), criterion])
        return type(model)._sample(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            synced_gpus,
            streamer,
            **model_kwargs,
        )
    stack = router.stack
    # Finished rows are filled as generate() fills them: its pad id, else its first EOS id (in the order given).
    pads = as_token_ids(generation_config.pad_token_id)  # an int, or a tensor or numpy value as HF takes it
    pad = pads[0] if pads else eos_ids[0] if eos_ids else None
    request = DecodeRequest(
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        eos_token_ids=frozenset(eos_ids),
        stop_strings=stops[0],
        stopping_criteria=stopping_criteria,
        streamer=streamer,
        tokenizer=stops[1],
        output_logits=want_scores or want_logits,
    )
    # HF's processors already hold the sampling warpers (temperature, top-k, top-p): no second set here
    selector = TokenSelector(SamplingParams(do_sample=sampling), stack.device, logits_processor)
    ids, mask = router.check_input_ids(input_ids, mask)
    out = router.decode(ids, mask, request, selector, mode=mode, pad_token_id=pad)
    router.last_stats = out.stats
    if mine is not None:
        _compat.adopt_layers(mine, out.cache)
    home = input_ids.device  # HF takes ids on the CPU for a model elsewhere and returns what it made there
    sequences = out.sequences.to(home)
    if not generation_config.return_dict_in_generate:
        return sequences
    scores = None
    if want_scores:  # scores are the processed logits each token was chosen from, as HF reports them
        prompt_len = input_ids.shape[1]
        scores = tuple(
            selector.scores(out.sequences[:, : prompt_len + i], row).to(home) for i, row in enumerate(out.logits)
        )
    logits = tuple(t.to(home) for t in out.logits) if want_logits and out.logits is not None else None
    kept = None if generation_config.use_cache is False else mine if mine is not None else out.cache
    return _compat.generate_output(sequences, scores, logits, kept)


def _reads_the_batch(processors: Any, criteria: Any, eos_ids: list[int], stop_strings: tuple[str, ...]) -> bool:
    """Whether HF's processors or stopping criteria for a batch need it whole: a caller's own criterion (lm-eval's
    keeps a flag per row of the batch), a processor that picks constraints by row index, or a stop without EOS
    (HF then lets a stopped row run on with real tokens, where the router pads it)."""
    if any(not isinstance(c, PER_ROW_CRITERIA) for c in criteria or ()):
        return True
    if any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in processors or ()):
        return True
    return not eos_ids and bool(stop_strings or any(isinstance(c, StopStringCriteria) for c in criteria or ()))


def plain_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams,
    num_layers: int,
    **hf_kwargs: Any,
) -> GenerationOutput:
    """Plain HF generation with the router's arguments (greedy or sampling, `hf_kwargs` passed on), reported as
    every token at full depth."""
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        do_sample=params.do_sample,
        return_dict_in_generate=True,
        attention_mask=attention_mask,
        **{k: v for k, v in hf_kwargs.items() if v is not None},
    )
    if params.do_sample:
        kwargs.update(temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p or 1.0)
    # HF samples from the global generator: a seed is set on it for this call only, and the caller's state comes back
    seeded = params.do_sample and params.seed is not None
    device = input_ids.device
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, enabled=seeded), torch.no_grad():
        if seeded:
            torch.manual_seed(params.seed)
        start = time.perf_counter()
        out = model.generate(input_ids, **kwargs)
        wall = time.perf_counter() - start
    new = out.sequences.shape[1] - input_ids.shape[1]
    logits = tuple(out.logits) if kwargs.get("output_logits") and out.logits is not None else None
    full = num_layers - 1
    return GenerationOutput(out.sequences, plain_stats(new, wall, num_layers), logits, _compat.forward_cache(out),
                            [full] * new)  # fmt: skip
