"""`model.generate()` on a patched model: greedy and sampling run through the router.

The patch installs a `RoutedGenerate` object as the instance attribute `generate` (the class's method stays
untouched; `unpatch()` and `disabled()` delete the attribute, so plain `generate` is back exactly). Each call goes
to the class's own `generate`, which validates arguments, merges the `GenerationConfig`, builds the logits
processors and stopping criteria as usual, and then hands them to the router's decode loop through transformers'
`custom_generate` callable extension point. Nothing new is added to `generate`'s keyword arguments.

Batches (several sequences, left padding) run through the batch-synchronous engine (`batch_engine.py`), except
verify-mode sampling, per-step scores or logits, and streamers, which run plain HF generation. Calls the router
cannot serve (beam search, assisted generation, a user's own `custom_generate`, a cache to continue from) run plain
HF generation, unchanged. The last call's `GenerationStats` is
`router.last_stats`.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from transformers.generation.configuration_utils import GenerationMode

from early_exit_router.decode.engine import DecodeRequest
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.models import _compat

ROUTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


class RoutedGenerate:
    """The patched model's `generate`: same signature and results as HF's, routed where the router applies."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self._plain = type(router.model).generate  # the class's function, never the instance attribute
        functools.update_wrapper(self, self._plain)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        model = self.router.model
        bound = inspect.signature(self._plain).bind(model, *args, **kwargs)
        named = dict(bound.arguments)
        named.pop(next(iter(named)))  # self
        extra = named.pop("kwargs", {})
        if not self._routable(named, extra):
            return self._plain(model, **named, **extra)
        streamer = named.pop("streamer", None)  # a callable custom_generate never receives it: we stream
        decode = functools.partial(_routed_decoding, self.router, streamer=streamer)
        return self._plain(model, **named, custom_generate=decode, **extra)

    def _routable(self, named: dict[str, Any], extra: dict[str, Any]) -> bool:
        if named.get("custom_generate") is not None or named.get("assistant_model") is not None:
            return False
        config = copy.deepcopy(named.get("generation_config") or self.router.model.generation_config)
        config.update(**{k: v for k, v in extra.items() if hasattr(config, k)})
        if (config.num_return_sequences or 1) > 1:
            return False
        return config.get_generation_mode() in ROUTED_MODES


def _routed_decoding(
    router: Any,
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    **model_kwargs: Any,
) -> Any:
    """A decoding method with `GenerationMixin._sample`'s signature that runs the router's engine."""
    mask = model_kwargs.get("attention_mask")
    cache = model_kwargs.get(_compat.GENERATE_CACHE_KWARG)
    continuing = cache is not None and cache.get_seq_length() > 0
    batched = input_ids.shape[0] != 1 or (mask is not None and not bool((mask != 0).all()))
    mode = getattr(generation_config, "early_exit_mode", None) or router.config.mode
    want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    # The batch engines return no per-step scores; HF streamers take one row.
    batch_routable = not (want_scores or want_logits)
    if continuing or synced_gpus or (batched and (not batch_routable or streamer is not None)):
        if streamer is not None:  # generate() skipped the prompt's put: the streamer was ours to handle
            streamer.put(input_ids.cpu())
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

    stack = router._stack
    request = DecodeRequest(
        mode=mode,
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        eos_token_ids=frozenset(router._eos_ids(generation_config.eos_token_id)),
        stopping_criteria=stopping_criteria,
        streamer=streamer,
        tokenizer=router.tokenizer,
        output_logits=want_scores or want_logits,
    )
    # HF's processors already hold the sampling warpers (temperature, top-k, top-p): no second set here
    selector = TokenSelector(
        SamplingParams(do_sample=bool(generation_config.do_sample)), stack.device, logits_processor
    )
    if batched:
        ids, mask = router._check_input_ids(input_ids, mask)
        pad = generation_config.pad_token_id
        out = router._run_batch(ids, mask, request, selector, router.config, pad if isinstance(pad, int) else None)
        router.last_stats = out.stats
        if not generation_config.return_dict_in_generate:
            return out.sequences
        return _compat.generate_output(out.sequences, None, None, out.cache)
    sequences, stats, logits, cache, _ = router._run_engine(input_ids.to(stack.device), request, selector)
    router.last_stats = stats
    if not generation_config.return_dict_in_generate:
        return sequences
    prompt_len = input_ids.shape[1]
    scores = None
    if want_scores:  # scores are the processed logits each token was chosen from, as HF reports them
        scores = tuple(selector.scores(sequences[:, : prompt_len + i], row) for i, row in enumerate(logits))
    return _compat.generate_output(sequences, scores, tuple(logits) if want_logits else None, cache)
