"""Checking what a caller hands a decode: token ids (or a text prompt to encode), their attention mask, the room
left in the context, the call's mode and routing config, and a tokenizer that fits the model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from early_exit_router.config import MODES, RouterConfig
from early_exit_router.config_checks import split_config


def check_mode(mode: str | None, config: RouterConfig) -> str:
    """A call's mode: `mode`, else the config's; one of `MODES`."""
    mode = mode or config.mode
    if mode not in MODES:
        raise ValueError(f"Unknown mode {mode!r}: use one of {', '.join(MODES)}.")
    return mode


def call_config(
    config: RouterConfig | Mapping[str, Any] | None, base: RouterConfig, exit_layers: list[int]
) -> RouterConfig:
    """The routing config of one call: `base`, another `RouterConfig`, or `base` with the fields in a mapping
    changed; its exit layers must be the loaded heads' `exit_layers` (unset: those)."""
    cfg, changes = split_config(config, {}, RouterConfig)
    cfg = (cfg or base).replace(**changes)
    cfg = cfg if cfg.exit_layers is not None else cfg.replace(exit_layers=exit_layers)  # the default
    if cfg.exit_layers != exit_layers:
        raise ValueError(
            f"config.exit_layers {cfg.exit_layers} differ from the loaded heads' {exit_layers}: "
            "change thresholds with config.replace(...), or build a router with new heads for other layers."
        )
    return cfg


def check_tokenizer(tokenizer: Any, vocab_size: int) -> None:
    """Refuse a tokenizer with more tokens than the model's LM head scores (it belongs to another model)."""
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's LM head only {vocab_size}: they do "
            "not belong together. Pass the tokenizer that was saved with this model."
        )


def encode_prompt(tokenizer: Any, prompt: str, chat: bool, device: torch.device) -> torch.LongTensor:
    """Token ids (1, n) on `device` for a text prompt; `chat=True` applies the tokenizer's chat template."""
    if tokenizer is None:
        raise ValueError("No tokenizer is attached: pass input_ids, or build the router with a tokenizer.")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("The tokenizer has no chat template: use chat=False.")
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = encoded if torch.is_tensor(encoded) else encoded["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    return ids.to(device)


def check_input_ids(
    input_ids: Any, attention_mask: torch.Tensor | None, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated (b, n) ids on `device`, and their (b, n) attention mask (all ones when not given)."""
    if not torch.is_tensor(input_ids):
        raise TypeError(f"input_ids must be a LongTensor of shape (b, n) or a string, got {type(input_ids)}.")
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be 2-D (batch, length), got shape {tuple(input_ids.shape)}; "
            "for one sequence use input_ids.unsqueeze(0)."
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: give at least one prompt token (e.g. the BOS token).")
    if input_ids.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab_size}): min {low}, max {high}.")
    if attention_mask is None:
        return input_ids.to(device=device, dtype=torch.long), torch.ones_like(input_ids, device=device)
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}."
        )
    mask = (attention_mask != 0).long().to(device)
    problem = padding_problem(mask)
    if problem is not None:
        raise ValueError(problem)
    return input_ids.to(device=device, dtype=torch.long), mask


def check_prefill(
    ids: Any, mask: torch.Tensor, requests: int, selectors: int, rows_held: int, stack: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Decoder.prefill`'s (b, n) ids and mask validated as `check_input_ids` validates a call's, for a decoder that
    holds no rows, with one request and one selector per row."""
    if rows_held:
        raise RuntimeError("This decoder holds rows: prefill starts a batch; add a sequence with join.")
    ids, mask = check_input_ids(ids, mask, stack.vocab_size, stack.device)
    if requests != ids.shape[0] or selectors != ids.shape[0]:
        raise ValueError(
            f"prefill needs one request and one selector per row: {ids.shape[0]} rows, {requests} requests, "
            f"{selectors} selectors."
        )
    return ids, mask


def check_one_sequence(ids: Any) -> None:
    """Refuse ids of several rows where `Decoder.join` takes one sequence (1, n) (the rest: `check_prefill`)."""
    if not torch.is_tensor(ids):
        raise TypeError(f"input_ids must be a LongTensor of shape (1, n), got {type(ids)}.")
    if ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(
            f"join adds one sequence, ids of shape (1, n), got {tuple(ids.shape)}: join each row on its own, "
            "or start a batch with prefill."
        )


def padding_problem(attention_mask: torch.Tensor) -> str | None:
    """What keeps a (b, n) attention mask from being a decode's (None: it pads rows on the left only, each row
    holding at least one token)."""
    mask = attention_mask != 0
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        return "Only left padding is supported: pad each prompt on the left (tokenizer.padding_side = 'left')."
    if not bool(mask[:, -1].all()):
        return "A row of attention_mask is all padding: every prompt needs at least one token."
    return None


def check_length(prompt_len: int, max_new_tokens: Any, context: int | None) -> None:
    """Refuse a max_new_tokens that is not a positive integer, or a prompt that leaves it no room in `context`."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if context and prompt_len + max_new_tokens > context:
        raise ValueError(
            f"The prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{context} positions (config.max_position_embeddings): shorten the prompt or lower max_new_tokens."
        )
