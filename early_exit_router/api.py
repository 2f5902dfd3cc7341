"""`EarlyExitRouter`: the public object that wraps one HF causal LM, its exit heads and its router."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from early_exit_router._version import __version__
from early_exit_router.config import MODES, RouterConfig
from early_exit_router.decode.batch_engine import BatchEngine, combined_stats, padded_sequences, per_row
from early_exit_router.decode.engine import DecodeRequest, Engine
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stats import GenerationStats
from early_exit_router.heads.adapters import needs_context
from early_exit_router.heads.block import block_source
from early_exit_router.heads.checkpoint import (
    BaseModelIdentity,
    head_fingerprint,
    head_hash,
    is_router_dir,
    load_router,
    save_router,
    shipped_checkpoint,
)
from early_exit_router.heads.exit_heads import DRAFT_RANKING, ExitHeads
from early_exit_router.integrations.hf_generate import RoutedGenerate
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack
from early_exit_router.models.discovery import stack_for
from early_exit_router.models.loading import load_base_model, resolve_alias
from early_exit_router.routing.costs import CostModel, cost_key, cost_model_for
from early_exit_router.routing.exit_rule import Router
from early_exit_router.routing.ngram import SuffixStore

ROUTER_ATTR = "_early_exit_router"  # back-reference, to refuse patching one model twice
GENERATE_ATTR = "generate"  # instance attribute: model.generate() routes through the router


@dataclass
class GenerationOutput:
    """What `EarlyExitRouter.generate` returns."""

    sequences: torch.LongTensor  # (b, prompt + new), like HF generate (rows padded after their EOS)
    stats: GenerationStats
    logits: tuple[torch.Tensor, ...] | None = None  # per new token, (1, vocab) raw logits it was chosen from
    cache: Any = None  # the KV cache: every layer holds sequences[:, :-1], as a full forward pass would
    depths: list = field(default_factory=list)  # per new token: the 0-based layer it left at (-1: n-gram tier);
    # for a batch, one such list per row
    row_stats: list[GenerationStats] | None = None  # a batch's per-row statistics (`stats` then sums the rows)


class EarlyExitRouter:
    """Early-exit generation for one HF causal LM, patched in place.

    Build it with `from_pretrained` (alias, HF folder, GGUF file or saved router folder) or `from_model` (an
    already loaded model). The patch adds no module, parameter, buffer or hook to the model: the exit heads live
    in the router (saved only by `router.save_pretrained`) and follow the model's device and dtype when it moves,
    so `model.state_dict()` and `model.save_pretrained()` stay exactly the base's. `unpatch()` removes the routed
    `generate` and the back-reference and returns the untouched model.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        config: RouterConfig,
        heads: ExitHeads,
        stack: LayerStack,
        name_or_path: str,
    ) -> None:
        # Use from_model / from_pretrained: they validate and patch.
        if tokenizer is not None and len(tokenizer) > stack.vocab_size:
            raise ValueError(
                f"The tokenizer has {len(tokenizer)} tokens but the model's LM head only {stack.vocab_size}: they do "
                "not belong together. Pass the tokenizer that was saved with this model."
            )
        self._model = model
        self.tokenizer = tokenizer
        self.config = config
        self._heads = heads
        self._stack = stack
        self.name_or_path = name_or_path
        self._state = "new"  # -> "patched"; "disabled" inside disabled(); "unpatched" for good
        self.last_stats: GenerationStats | None = None  # of the last model.generate() call the router served
        self._warned_untrained = False
        # The cost policy's table: measured on first use (cached on disk per model shape and device); assign a
        # CostModel here to decide from another table (e.g. CostModel.synthetic for a what-if).
        self.cost_model: CostModel | None = None
        self._measured: CostModel | None = None
        self._ngram_store: SuffixStore | None = None
        # One decode step at a time per router: the n-gram store, the measured costs and `last_stats` are shared
        # by every call, so two threads calling `generate` are served one after the other, never interleaved
        # inside a step. Re-entrant, so a streamer may itself call `generate`.
        self.lock = threading.RLock()

    # -------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        tokenizer: Any = None,
        config: RouterConfig | None = None,
        *,
        name_or_path: str | None = None,
        **overrides: Any,
    ) -> EarlyExitRouter:
        """Attach fresh (untrained) exit heads to `model` in place; no weight is copied.

        `overrides` replace fields of `config` (e.g. `exit_layers=[10, 20]`). Everything is validated before the
        model is touched, so an error leaves it exactly as it was.
        """
        _compat.check_supported()
        config = (config or RouterConfig()).replace(**overrides) if overrides else (config or RouterConfig())
        if getattr(model, ROUTER_ATTR, None) is not None:
            raise ValueError(
                "This model is already patched by an EarlyExitRouter: reuse that router, or call its unpatch() first."
            )
        if GENERATE_ATTR in model.__dict__:
            raise ValueError(
                "model.generate is overridden on this model object (by another plugin or a custom_generate repo); "
                "the router would hide it. Delete that attribute first (del model.generate)."
            )
        stack = stack_for(model)
        exit_layers = config.resolved_exit_layers(stack.num_layers)
        # Fresh heads are the logit lens, whatever a reused config says.
        config = config.replace(exit_layers=exit_layers, heads_trained=False)
        kinds = {e: config.adapter_for(e) for e in exit_layers}
        heads = ExitHeads(exit_layers, stack.hidden_size, kinds, config.adapter_rank, block_source(stack))
        heads.to(device=stack.device, dtype=stack.dtype).eval()
        name = name_or_path or getattr(model.config, "_name_or_path", "") or type(model).__name__
        router = cls(model, tokenizer, config, heads, stack, name)
        router._patch()
        return router

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        config: RouterConfig | None = None,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        quantize: str | None = None,
        fresh_heads: bool = False,
        **overrides: Any,
    ) -> EarlyExitRouter:
        """Load a base model and its exit heads.

        `name_or_path` is an alias (`smollm2-135m`, which uses its shipped trained heads when present), a local HF
        model folder, a `.gguf` file, or a folder written by `save_pretrained`. `config` replaces the saved
        config; `overrides` change single fields (thresholds, mode, ...). Changing `exit_layers` or the adapter
        of saved heads is refused, since those heads would not exist. `fresh_heads=True` ignores saved or shipped
        heads and attaches new, untrained ones (for training). `quantize` loads the base quantized: "int8" or
        "int4" (torchao weight-only, any device) or "bnb-8bit" / "bnb-4bit" (bitsandbytes, CUDA); the heads stay
        dense.
        """
        dtype = _parse_dtype(dtype)
        saved = _saved_router(str(name_or_path))
        source = saved.identity.name_or_path if is_router_dir(str(name_or_path)) else str(name_or_path)
        model, tokenizer, name = load_base_model(source, dtype, device, quantize)
        if saved is None or fresh_heads:
            return cls.from_model(model, tokenizer, config, name_or_path=name, **overrides)
        return cls._from_saved(model, tokenizer, saved, config, name, **overrides)

    @classmethod
    def _from_saved(
        cls, model: nn.Module, tokenizer: Any, saved: Any, config: RouterConfig | None, name: str, **overrides: Any
    ) -> EarlyExitRouter:
        base_config = config or saved.config
        fixed = {"exit_layers": saved.exit_layers, "adapter": saved.config.adapter}
        fixed["adapter_rank"] = saved.config.adapter_rank
        fixed["exit_adapters"] = saved.config.exit_adapters
        for key, value in fixed.items():
            if overrides.get(key, value) != value or getattr(base_config, key) != value:
                raise ValueError(
                    f"The saved heads have {key}={value!r}; they cannot be loaded with another {key}. "
                    "Train new heads for a different layout."
                )
        config = base_config.replace(**overrides) if overrides else base_config
        stack = stack_for(model)
        heads = _saved_heads(saved, stack, config, name)
        router = cls(model, tokenizer, config, heads, stack, name)
        router._patch()
        return router

    def load_saved_heads(self, name_or_path: str | Path) -> ExitHeads:
        """The trained heads saved at `name_or_path` (a `save_pretrained` folder, or an alias with shipped heads),
        built on this router's base model without attaching them: what a warm start trains from. Their base model
        must be this one; no second copy of it is loaded."""
        saved = _saved_router(str(name_or_path))
        if saved is None:
            raise ValueError(
                f"{str(name_or_path)!r} holds no saved exit heads: pass a folder written by save_pretrained "
                "(or train-heads), or an alias with shipped heads."
            )
        return _saved_heads(saved, self._stack, saved.config, self.name_or_path)

    # ------------------------------------------------------------------------------------------------ patching
    def _patch(self) -> None:
        model = self._model
        try:
            model.__dict__[ROUTER_ATTR] = self
            if hasattr(type(model), "generate"):
                model.__dict__[GENERATE_ATTR] = RoutedGenerate(self)  # shadows the class's generate
        except BaseException:
            self._detach()
            raise
        self._state = "patched"

    def _detach(self) -> None:
        model = self._model
        model.__dict__.pop(ROUTER_ATTR, None)
        if isinstance(model.__dict__.get(GENERATE_ATTR), RoutedGenerate):
            del model.__dict__[GENERATE_ATTR]

    def unpatch(self) -> nn.Module:
        """Remove everything the patch added and return the original model object. The router is unusable after."""
        self._require_patched()
        self._detach()
        self._state = "unpatched"
        return self._model

    @contextlib.contextmanager
    def disabled(self) -> Iterator[nn.Module]:
        """Inside, the model is exactly the plain model and `generate` runs plain HF generation."""
        self._require_patched()
        self._detach()
        self._state = "disabled"
        try:
            yield self._model
        finally:
            self._patch()

    def _require_patched(self) -> None:
        if self._state == "unpatched":
            raise RuntimeError("This router was unpatched: build a new one with EarlyExitRouter.from_model(model).")
        if self._state == "disabled":
            raise RuntimeError("The router is inside disabled(): leave that block first.")

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def is_enabled(self) -> bool:
        return self._state == "patched"

    # -------------------------------------------------------------------------------------------------- heads
    @property
    def heads(self) -> ExitHeads:
        """The exit adapters and gates, on the model's current device and in its dtype."""
        heads, weight = self._heads, self._stack.lm_head.weight
        first = next(heads.parameters(), None)
        if first is None:
            return heads
        dtype = weight.dtype if weight.dtype.is_floating_point else first.dtype  # an integer-stored quantized head
        if first.device != weight.device or first.dtype != dtype:
            heads.to(device=weight.device, dtype=dtype)  # the user moved or cast the model
        return heads

    @property
    def exit_layers(self) -> list[int]:
        return list(self.heads.exit_layers)

    def num_added_parameters(self) -> int:
        """Parameters the exit heads add (adapters and gates; the shared norm and LM head are not counted)."""
        return self.heads.num_parameters()

    def added_parameter_share(self) -> float:
        """Added parameters as a share of the base model's (tied embeddings counted once)."""
        base = {id(p): p.numel() for p in self._model.parameters()}
        return self.num_added_parameters() / max(1, sum(base.values()))

    def set_gate(self, layer: int, gate: nn.Module | None) -> None:
        """Install (or remove, with None) a learned gate before exit `layer`: hidden (1, H) -> probability (1,)."""
        if layer not in self.heads.exit_layers:
            raise ValueError(f"Layer {layer} has no exit head; exit layers are {self.heads.exit_layers}.")
        key = str(layer)
        if gate is None:
            self.heads.gates.pop(key, None)
        else:
            self.heads.gates[key] = gate.to(device=self._stack.device)

    def describe(self) -> str:
        """One line about the heads: exit layers, adapter and their size."""
        trained = "trained" if self.config.heads_trained else "UNTRAINED (logit lens)"
        return (
            f"{self.name_or_path}: {self._stack.num_layers} layers, exits at {self.exit_layers} "
            f"({self._adapter_summary()} adapters, {trained}); added parameters {self.num_added_parameters():,} "
            f"({self.added_parameter_share():.2%} of the base model)"
        )

    def _adapter_summary(self) -> str:
        kinds = self.heads.kinds
        if len(set(kinds.values())) == 1:
            return next(iter(kinds.values()))
        return ", ".join(f"L{e} {kind}" for e, kind in kinds.items()) or self.config.adapter

    # ------------------------------------------------------------------------------------------------ generate
    def encode(self, prompt: str, chat: bool = False) -> torch.LongTensor:
        """Token ids (1, n) for a text prompt; `chat=True` applies the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("No tokenizer is attached: pass input_ids, or build the router with a tokenizer.")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("The tokenizer has no chat template: use chat=False.")
            encoded = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
            )
            ids = encoded if torch.is_tensor(encoded) else encoded["input_ids"]
        else:
            ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        return ids.to(self._stack.device)

    def generate(
        self,
        input_ids: torch.Tensor | str,
        max_new_tokens: int = 128,
        mode: str | None = None,
        *,
        config: RouterConfig | Mapping[str, Any] | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | list[int] | None = None,
        stop_strings: str | list[str] | None = None,
        stopping_criteria: Any = None,
        logits_processor: Any = None,
        streamer: Any = None,
        attention_mask: torch.Tensor | None = None,
        output_logits: bool = False,
    ) -> GenerationOutput:
        """Generate with early exit. Arguments follow HF `generate`; `mode` is 'exit' or 'verify'.

        `input_ids` is a LongTensor (1, n), or a string when a tokenizer is attached. `config` sets this call's
        routing without touching `router.config`: a `RouterConfig`, or a mapping of fields to change (e.g.
        `{"high_conf_threshold": 0.8}`). `eos_token_id` defaults to the model's generation config. `seed` makes
        sampling reproducible. Inside `disabled()`, this runs plain HF generation (same arguments) and reports every
        token at full depth. Calls from several threads are served one after another.
        """
        if self._state == "unpatched":
            raise RuntimeError("This router was unpatched: build a new one with EarlyExitRouter.from_model(model).")
        cfg = self.call_config(config)
        mode = mode or cfg.mode
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}: use one of {', '.join(MODES)}.")
        if isinstance(input_ids, str):
            input_ids = self.encode(input_ids)
        input_ids, attention_mask = self._check_input_ids(input_ids, attention_mask)
        self.check_length(input_ids.shape[1], max_new_tokens)
        batched = input_ids.shape[0] > 1 or not bool(attention_mask.all())
        params = SamplingParams(do_sample, temperature, top_k, top_p, seed)
        stop_strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: build the router with one.")
        eos = self._eos_ids(eos_token_id)
        if self._state == "disabled":
            return self._plain_generate(
                input_ids,
                attention_mask,
                max_new_tokens,
                params,
                eos,
                stop_strings,
                stopping_criteria,
                logits_processor,
                streamer,
                output_logits,
            )
        self._warn_if_untrained(mode)
        request = DecodeRequest(
            mode=mode,
            max_new_tokens=max_new_tokens,
            eos_token_ids=frozenset(eos),
            stop_strings=stop_strings,
            stopping_criteria=stopping_criteria,
            streamer=streamer,
            tokenizer=self.tokenizer,
            output_logits=output_logits,
        )
        selector = TokenSelector(params, self._stack.device, logits_processor)
        if batched:
            return self._run_batch(input_ids, attention_mask, request, selector, cfg)
        sequences, stats, logits, cache, depths = self._run_engine(input_ids, request, selector, cfg)
        return GenerationOutput(
            sequences=sequences,
            stats=stats,
            logits=tuple(logits) if output_logits else None,
            cache=cache,
            depths=list(depths),
        )

    def _run_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        request: DecodeRequest,
        selector: TokenSelector,
        config: RouterConfig,
        pad_token_id: int | None = None,
    ) -> GenerationOutput:
        """Several sequences (left-padded) through the batch-synchronous engine (`batch_engine.py`); finished rows
        are filled with `pad_token_id` (default: the tokenizer's or the model's pad token, else EOS)."""
        if request.streamer is not None or request.output_logits:
            raise ValueError("Streamers and output_logits take one sequence: generate the batch row by row for them.")
        pad = self.pad_token_id(request.eos_token_ids) if pad_token_id is None else pad_token_id
        sampling = selector.params.do_sample
        if per_row(config, request.mode, sampling) and not _compat.cache_rows_can_change(self._stack.new_cache()):
            # A sliding window keeps the last slots, holes included: per-row batches need plain cache layers.
            if sampling:
                return self._run_rows_alone(input_ids, attention_mask, request, selector, config, pad)
            config = config.replace(batch_design="synchronous")
        batch_config = self.batch_config(config)
        if batch_config is None:
            return self._run_rows_alone(input_ids, attention_mask, request, selector, config, pad)
        config = batch_config
        costs = self.costs(config=config) if config.policy == "cost" else None
        engine = BatchEngine(self._stack, self.heads, Router(config, self._stack.vocab_size), config, costs,
                             self.ngram_store())  # fmt: skip
        with self.lock:
            sequences, rows, cache, depths = engine.generate(
                input_ids,
                attention_mask,
                request,
                selector,
                pad,
            )
        return GenerationOutput(sequences, combined_stats(rows), None, cache, depths, rows)

    def batch_config(self, config: RouterConfig | None = None) -> RouterConfig | None:
        """The config a batch runs under, or None when its rows must run one after another.

        Block adapters keep a KV cache of their own per sequence, which batches do not carry: a batch consults the
        other exits (verify mode stays exact whichever exits draft), and only when every consulted exit has a
        block do the rows run alone."""
        config = config or self.config
        consulted = config.consulted_exit_layers()
        plain = [e for e in consulted if not needs_context(self.heads.adapter(e))]
        if len(plain) == len(consulted):
            return config
        return config.replace(active_exit_layers=plain) if plain else None

    def batch_synchronous(self, config: RouterConfig | None = None) -> bool:
        """Whether batches under `config` run in the batch engines rather than row by row (`batch_config`)."""
        return self.batch_config(config) is not None

    def _run_rows_alone(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        request: DecodeRequest,
        selector: TokenSelector,
        config: RouterConfig,
        pad_token_id: int,
    ) -> GenerationOutput:
        """A left-padded batch decoded one row at a time (same output layout as the batch engine; no cache)."""
        outputs, rows, depths = [], [], []
        for r in range(input_ids.shape[0]):
            ids = input_ids[r : r + 1, attention_mask[r].bool()]  # (1, n_r): the row without its left padding
            sequences, stats, _, _, row_depths = self._run_engine(ids, request, selector, config)
            outputs.append(sequences[0, ids.shape[1] :])
            rows.append(stats)
            depths.append(list(row_depths))
        sequences = padded_sequences(input_ids, outputs, pad_token_id)
        return GenerationOutput(sequences, combined_stats(rows), None, None, depths, rows)

    def pad_token_id(self, eos_token_ids: Iterable[int] = ()) -> int:
        """What finished rows of a batch are filled with: the tokenizer's or the model's pad token, else the
        smallest of `eos_token_ids` (HF's fallback), else 0."""
        for candidate in (
            getattr(self.tokenizer, "pad_token_id", None),
            getattr(self._model.generation_config, "pad_token_id", None),
        ):
            if isinstance(candidate, int):
                return candidate
        return min(eos_token_ids, default=0)

    def call_config(self, config: RouterConfig | Mapping[str, Any] | None = None) -> RouterConfig:
        """The routing config of one call: the router's, another `RouterConfig`, or the router's with the fields in
        a mapping changed. Checked against the loaded heads."""
        if config is None:
            cfg = self.config
        elif isinstance(config, RouterConfig):
            cfg = config
        elif isinstance(config, Mapping):
            cfg = self.config.replace(**config)
        else:
            raise TypeError(f"config must be a RouterConfig or a mapping of its fields, got {type(config).__name__}.")
        if cfg.exit_layers != self.heads.exit_layers:
            raise ValueError(
                f"config.exit_layers {cfg.exit_layers} differ from the loaded heads' {self.heads.exit_layers}: "
                "change thresholds with config.replace(...), or build a router with new heads for other layers."
            )
        return cfg

    def check_length(self, prompt_len: int, max_new_tokens: Any) -> None:
        """Refuse a max_new_tokens that is not a positive integer, or a prompt that leaves it no room."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
        context = self.context_length
        if context and prompt_len + max_new_tokens > context:
            raise ValueError(
                f"The prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {context} positions (config.max_position_embeddings): shorten the prompt or lower "
                "max_new_tokens."
            )

    @property
    def context_length(self) -> int | None:
        """The model's context (config.max_position_embeddings), or None when it declares none."""
        return getattr(self._model.config, "max_position_embeddings", None)

    def engine(self, config: RouterConfig | None = None) -> Engine:
        """A decode engine for one call under `config` (default: the router's). `generate` uses one per call; a
        scheduler interleaving several decodes (the server) uses `start` / `advance` / `finish` on it, holding
        `router.lock` around each."""
        config = config or self.config
        costs = self.costs(config=config) if config.policy == "cost" else None
        router = Router(config, self._stack.vocab_size)
        return Engine(self._stack, self.heads, router, config, costs, self.ngram_store())

    def _run_engine(
        self,
        input_ids: torch.Tensor,
        request: DecodeRequest,
        selector: TokenSelector,
        config: RouterConfig | None = None,
    ) -> tuple:
        """One decode under `config` (default: the router's): `Engine.generate`'s (sequences, stats, logits, cache,
        depths)."""
        with self.lock:
            return self.engine(config).generate(input_ids, request, selector)

    def costs(self, refresh: bool = False, config: RouterConfig | None = None) -> CostModel:
        """The cost model the policy decides from: `cost_model` when assigned, else measured on this device for
        `config`'s draft vocabulary and chunk lengths (default: the router's config).

        Measuring takes a few seconds once per model shape, device, dtype and library versions; the result is
        cached on disk (see `costs.py`). `refresh=True` measures again."""
        if self.cost_model is not None and not refresh:
            return self.cost_model
        config = config or self.config
        max_chunk = max(16, config.max_pending + 1)
        key = cost_key(self._stack, config.draft_vocab_size, max_chunk)
        if refresh or self._measured is None or self._measured.key != key:  # in memory: no disk read per call
            self._measured = cost_model_for(
                self._stack, self.heads, config.draft_vocab_size, max_chunk, refresh=refresh
            )
        return self._measured

    def clear_ngram_store(self) -> None:
        """Forget the earlier outputs the n-gram tier copies from (benchmarks start every run from nothing)."""
        with self.lock:
            self._ngram_store = None

    def ngram_store(self) -> SuffixStore | None:
        """This router's store of earlier sequences for the n-gram tier (None when `ngram_store_tokens` is 0)."""
        cfg = self.config
        if not cfg.ngram_tier or cfg.ngram_store_tokens <= 0:
            return None
        store = self._ngram_store
        shape = (cfg.ngram_store_tokens, cfg.ngram_size, cfg.ngram_min_size)
        if store is None or (store.max_tokens, store.max_ngram, store.min_ngram) != shape:
            store = self._ngram_store = SuffixStore(*shape)
        return store

    def _check_input_ids(
        self, input_ids: Any, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated (b, n) ids on the model's device, and their (b, n) attention mask (all ones when not given)."""
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
        vocab = self._stack.vocab_size
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab}): min {low}, max {high}.")
        device = self._stack.device
        if attention_mask is None:
            return input_ids.to(device=device, dtype=torch.long), torch.ones_like(input_ids, device=device)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}."
            )
        mask = (attention_mask != 0).long().to(device)
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError(
                "Only left padding is supported: pad each prompt on the left (tokenizer.padding_side = 'left')."
            )
        if bool((mask[:, -1] == 0).any()):
            raise ValueError("A row of attention_mask is all padding: every prompt needs at least one token.")
        return input_ids.to(device=device, dtype=torch.long), mask

    def _eos_ids(self, eos_token_id: int | list[int] | None) -> list[int]:
        if eos_token_id is None:
            gen_config = getattr(self._model, "generation_config", None)
            eos_token_id = getattr(gen_config, "eos_token_id", None)
            if eos_token_id is None and self.tokenizer is not None:
                eos_token_id = self.tokenizer.eos_token_id
        if eos_token_id is None:
            return []
        return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]

    def _warn_if_untrained(self, mode: str) -> None:
        if mode == "exit" and not self.config.heads_trained and not self._warned_untrained:
            self._warned_untrained = True
            warnings.warn(
                "Exit mode with UNTRAINED exit heads (the logit lens): shallow layers of off-the-shelf models are "
                "confidently wrong, so exited tokens often differ from the full model's. Load trained heads, or "
                "use mode='verify' for output identical to the full model.",
                UserWarning,
                stacklevel=3,
            )

    def _plain_generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        eos: list[int],
        stop_strings: tuple[str, ...],
        stopping_criteria: Any,
        logits_processor: Any,
        streamer: Any,
        output_logits: bool,
    ) -> GenerationOutput:
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            do_sample=params.do_sample,
            eos_token_id=eos or None,
            streamer=streamer,
            return_dict_in_generate=True,
            output_logits=output_logits,
            attention_mask=attention_mask,
        )
        if params.do_sample:
            kwargs.update(temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p or 1.0)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if stop_strings:
            kwargs.update(stop_strings=list(stop_strings), tokenizer=self.tokenizer)
        if stopping_criteria is not None:
            kwargs["stopping_criteria"] = stopping_criteria
        if logits_processor is not None:
            kwargs["logits_processor"] = logits_processor
        start = time.perf_counter()
        with torch.no_grad():
            out = self._model.generate(input_ids, **kwargs)
        wall = time.perf_counter() - start
        new = out.sequences.shape[1] - input_ids.shape[1]
        full = self._stack.num_layers - 1
        stats = GenerationStats(
            new_tokens=new,
            exit_histogram={full: new},
            deep_passes=max(0, new - 1),
            mean_fill_chunk=1.0 if new > 1 else 0.0,
            wall_time_s=wall,
            tokens_per_s=new / wall if wall > 0 else 0.0,
            mode="plain",
            num_layers=self._stack.num_layers,
        )
        logits = tuple(out.logits) if output_logits and out.logits is not None else None
        return GenerationOutput(
            sequences=out.sequences, stats=stats, logits=logits, cache=_compat.forward_cache(out), depths=[full] * new
        )

    # ----------------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, path: str | Path) -> None:
        """Write `early_exit_config.json` and `early_exit_heads.safetensors` (heads only, never base weights)."""
        save_router(
            path,
            self.config,
            self.heads.state_dict(),
            self.exit_layers,
            has_gates=len(self.heads.gates) > 0,
            identity=_identity(self._stack, self.name_or_path),
            library_version=__version__,
        )


def _saved_router(name_or_path: str) -> Any:
    """The saved router at `name_or_path`: a folder written by `save_pretrained`, or an alias's shipped heads;
    None when there is none (a plain base model)."""
    if is_router_dir(name_or_path):
        return load_router(name_or_path)
    alias = resolve_alias(name_or_path)
    shipped = shipped_checkpoint(alias) if alias is not None else None
    return load_router(shipped) if shipped is not None else None


def _saved_heads(saved: Any, stack: LayerStack, config: RouterConfig, name: str) -> ExitHeads:
    """`saved`'s trained heads (adapters, gates, draft ranking) built on `stack`'s base model, which must be the
    one they were trained for; on its device and in its dtype."""
    saved.identity.check_matches(_identity(stack, name))
    kinds = {e: config.adapter_for(e) for e in saved.exit_layers}
    heads = ExitHeads(saved.exit_layers, stack.hidden_size, kinds, config.adapter_rank, block_source(stack))
    if saved.has_gates:  # the saved weights say which features the gates were trained with
        heads.add_gates(
            stack.hidden_size,
            context=any(k.endswith(".context.weight") for k in saved.tensors),
            head=any(k.endswith(".head.weight") for k in saved.tensors),
        )
    if DRAFT_RANKING in saved.tensors:
        try:
            heads.set_draft_token_ranking(saved.tensors[DRAFT_RANKING], stack.vocab_size)
        except ValueError as exc:
            raise ValueError(
                f"The saved heads' draft token ranking is broken: {exc} Re-save or retrain them."
            ) from None
    expected = heads.state_dict()
    wrong = {
        k: (tuple(v.shape), tuple(expected[k].shape))
        for k, v in saved.tensors.items()
        if k in expected and v.shape != expected[k].shape
    }
    if wrong:
        raise ValueError(
            f"Saved head tensors have the wrong shapes (saved, expected): {wrong}. The heads file does not belong "
            "to this config or base model: re-save or retrain the heads."
        )
    missing, unexpected = heads.load_state_dict(saved.tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"Saved heads do not fit their config: missing {missing}, unexpected {unexpected}.")
    heads.to(device=stack.device, dtype=stack.dtype).eval()
    return heads


def _identity(stack: LayerStack, name: str) -> BaseModelIdentity:
    tensors = stack.shared_head_tensors()
    return BaseModelIdentity(
        name_or_path=name,
        model_type=str(stack.config.model_type),
        num_hidden_layers=stack.num_layers,
        hidden_size=stack.hidden_size,
        vocab_size=stack.vocab_size,
        head_hash=head_hash(tensors),
        head_fingerprint=head_fingerprint(tensors),
    )


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"Unknown dtype {dtype!r}: use one of {', '.join(names)}.")
    return names[dtype]
