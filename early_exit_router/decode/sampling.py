"""Token selection from logits: greedy, or sampling with temperature / top-k / top-p, as HF generate does it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from early_exit_router.models import _compat


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters; the names and meanings are HF generate's."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @classmethod
    def unset_from(
        cls,
        model: Any,
        do_sample: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        seed: int | None,
    ) -> SamplingParams:
        """A call's parameters, those it left unset (None) taken from `model`'s generation config, merged as HF's
        generate merges it (HF's global defaults included: top_k 50)."""
        generation_config = _compat.merged_generation_config(model, None, {})

        def pick(value: Any, name: str) -> Any:
            return getattr(generation_config, name, None) if value is None else value

        sample = pick(do_sample, "do_sample")
        return cls(bool(sample), pick(temperature, "temperature"), pick(top_k, "top_k"), pick(top_p, "top_p"), seed)

    def __post_init__(self) -> None:
        if self.temperature is None:  # HF's None: the default
            object.__setattr__(self, "temperature", 1.0)
        if self.do_sample and not self.temperature > 0:  # greedy ignores it, as HF's generate does
            raise ValueError(f"temperature must be > 0, got {self.temperature}; use do_sample=False for greedy.")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")


class TokenSelector:
    """Chooses the next token from one row of logits: user processors, then (when sampling) the warpers."""

    def __init__(
        self, params: SamplingParams, device: torch.device, logits_processor: LogitsProcessorList | None = None
    ) -> None:
        self.params = params
        self.processors = LogitsProcessorList(logits_processor or [])
        self.warpers = LogitsProcessorList()
        if params.do_sample:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p is not None and params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(params.top_p))
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.padding: torch.Tensor | None = None  # (1, k) left padding the processors see first (`after_padding`)
        self.batch_row: tuple[int, int] | None = None  # (r, rows): row r of a batch decoded alone (`alone_in_batch`)

    def after_padding(self, padding: torch.Tensor) -> TokenSelector:
        """This selector (its random generator shared) for a batch row decoded without its (1, k) left padding: the
        processors see the padding first, as in HF's padded batch (min_new_tokens counts from the padded prompt's
        end)."""
        selector = copy.copy(self)
        selector.padding = padding if padding.numel() else None
        return selector

    def alone_in_batch(self, r: int, rows: int) -> TokenSelector:
        """This selector (its random generator shared) for row r of a batch of `rows` decoded one row after another:
        its sampling noise is row r of the (rows, vocab) blocks HF's batched sampling draws (`decode/noise.py`)."""
        selector = copy.copy(self)
        selector.batch_row = (r, rows)
        return selector

    def for_row(self, r: int, rows: int) -> TokenSelector:
        """This selector (its random generator shared) for row r of a batch of `rows` whose processors are called
        one row at a time: processors that hold a value per row of the batch keep row r's (HF's repetition penalty
        holds each row's padding length). Itself where no processor does."""
        mine = [_row_of(p, r, rows) for p in self.processors]
        if all(a is b for a, b in zip(mine, self.processors)):
            return self
        selector = copy.copy(self)
        selector.processors = LogitsProcessorList(mine)
        return selector

    def scores(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """(1, vocab) raw logits -> (1, vocab) scores the token is chosen from."""
        if self.padding is not None:
            input_ids = torch.cat([self.padding, input_ids], dim=1)
        # Processors get a copy, as HF hands them one: a processor may edit its scores in place, and the logits are
        # kept (output_logits, and output_scores recomputed from them). Without processors nothing needs one.
        scores = self.processors(input_ids, logits.to(torch.float32, copy=True)) if self.processors else logits.float()
        if self.params.do_sample:
            scores = self.warpers(input_ids, scores)
        return scores

    def choose(self, input_ids: torch.Tensor, logits: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """(1, vocab) raw logits -> (1,) token id, on the logits' device (greedy: no host sync). Sampling draws with
        `noise`, the position's (vocab,) draw (`decode/noise.py`; None: a fresh one, as torch.multinomial draws), after
        one host sync that checks there is something to draw."""
        scores = self.scores(input_ids, logits)
        if not self.params.do_sample:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        if noise is None:
            return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(-1)
        # torch.multinomial refuses such a row (as HF's sampling does); the draw's argmax would pick token 0 silently.
        if not bool(torch.isfinite(probs).all()):
            raise RuntimeError(
                "Sampling found no token to draw: every score is -inf or NaN after the logits processors and warpers "
                "(a processor that bans every token, or NaN logits). Loosen the processors, or load the model in a "
                "wider dtype if the logits overflow."
            )
        return (probs / noise).argmax(dim=-1)


def _row_of(processor: LogitsProcessor, r: int, rows: int) -> LogitsProcessor:
    """`processor` as row r of a batch of `rows` sees it alone: a copy holding row r's value where it holds one per
    row, which HF's processors refuse to apply to another batch size (the repetition penalty: each row's padding
    length; the encoder repetition penalty: each row's prompt; encoder n-gram blocking: each row's prompt n-grams)."""
    if isinstance(processor, RepetitionPenaltyLogitsProcessor):
        ignore = processor.prompt_ignore_length
        if torch.is_tensor(ignore) and ignore.dim() == 1 and ignore.shape[0] == rows:
            return _with(processor, prompt_ignore_length=ignore[r : r + 1])
    elif isinstance(processor, EncoderRepetitionPenaltyLogitsProcessor):
        if processor.encoder_input_ids.shape[0] == rows:  # (rows, n): each row's prompt
            return _with(processor, encoder_input_ids=processor.encoder_input_ids[r : r + 1])
    elif isinstance(processor, EncoderNoRepeatNGramLogitsProcessor) and processor.batch_size == rows:
        return _with(processor, batch_size=1, generated_ngrams=processor.generated_ngrams[r : r + 1])
    return processor


def _with(processor: LogitsProcessor, **values: Any) -> LogitsProcessor:
    """A shallow copy of `processor` holding `values` in place of its own."""
    mine = copy.copy(processor)
    for name, value in values.items():
        setattr(mine, name, value)
    return mine
