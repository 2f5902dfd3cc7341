"""`EarlyExitRouter`: the public object that wraps one HF causal LM, its exit heads and its routing.

It loads (a base model and its heads), hands out decoders (`decoder()`), generates (`generate()`, which runs one
decoder to its end) and saves. The loop is `decode/`, the heads and their format `heads/`, the decisions `routing/`,
the patch on the model `integrations/hf_generate.py`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from early_exit_router.config import RouterConfig
from early_exit_router.config_checks import split_config
from early_exit_router.decode import inputs
from early_exit_router.decode.ask import warm_graphs
from early_exit_router.decode.batch import batch_layout
from early_exit_router.decode.loop import Decoder
from early_exit_router.decode.output import GenerationOutput, run_rows_alone, run_to_end
from early_exit_router.decode.sampling import SamplingParams, TokenSelector
from early_exit_router.decode.stats import GenerationStats
from early_exit_router.decode.stopping import DecodeRequest, as_criteria, as_stop_strings, eos_ids_for, pad_id_for
from early_exit_router.heads.adapted_base import apply_adaptation, copy_adapted
from early_exit_router.heads.checkpoint import (
    CONFIG_NAME,
    KNOWN_EXTRA_FILES,
    WEIGHTS_NAME,
    SavedRouter,
    heads_from_saved,
    is_router_dir,
    load_router,
    save_router,
    saved_base,
    saved_heads,
    saved_router,
)
from early_exit_router.heads.draft_path import DraftPath, load_draft_path
from early_exit_router.heads.exit_heads import UNTRAINED_EXIT_MODE, ExitHeads, fresh_heads
from early_exit_router.heads.own_head import own_head_config
from early_exit_router.integrations import hf_generate
from early_exit_router.models import _compat
from early_exit_router.models.architecture import LayerStack
from early_exit_router.models.discovery import stack_for
from early_exit_router.models.loading import load_base_model, parse_dtype
from early_exit_router.routing.costs import CostModel, chunk_widths, config_costs, config_key, warm_widths
from early_exit_router.routing.exit_rule import ExitRule, guards_repeats, word_ids
from early_exit_router.routing.ngram import SuffixStore, store_for

__all__ = ["EarlyExitRouter", "GenerationOutput"]


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
        inputs.check_tokenizer(tokenizer, stack.vocab_size)  # use from_model / from_pretrained: they validate and patch
        self._model = model
        self.tokenizer = tokenizer
        self.config = config
        self._heads = heads
        self.stack = stack  # the model's layers, norm and head as the decoder runs them
        self.name_or_path = name_or_path
        self._state = "new"  # -> "patched"; "disabled" inside disabled(); "unpatched" for good
        self.last_stats: GenerationStats | None = None  # the last model.generate() call's (None: it ran plain HF)
        self._warned_untrained = False
        # The cost policy's table: measured on first use (cached on disk per model shape and device); assign a
        # CostModel here to decide from another table (e.g. CostModel.synthetic for a what-if).
        self.cost_model: CostModel | None = None
        self._measured: CostModel | None = None
        self._ngram_store: SuffixStore | None = None
        # One decode step at a time per router: the n-gram store, the measured costs and `last_stats` are shared
        # by every call, so two threads calling `generate` are served one after the other, never interleaved
        # inside a step. Re-entrant, so a streamer may itself call `generate`.
        self.lock = hf_generate.RouterLock()
        self.adapted_from: tuple[Path, dict[str, Any]] | None = None  # (folder, entry): the base is adapt-base's
        self.draft_path: DraftPath | None = None  # adapted copies of the first layers that only drafts run

    # -------------------------------------------------------------------------------------------- construction
    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        tokenizer: Any = None,
        config: RouterConfig | None = None,
        *,
        name_or_path: str | None = None,
        pack_weights: bool = True,
        heads: str | Path | None = None,
        **overrides: Any,
    ) -> EarlyExitRouter:
        """Attach fresh (untrained) exit heads to `model` in place, or with `heads` (a `save_pretrained` folder, or
        an alias with shipped heads) those trained heads, checked against `model`; no weight is copied.

        `overrides` replace fields of `config` (`exit_layers=[10, 20]`). All is checked before the model is touched:
        an error leaves it as it was. `pack_weights=False` keeps the router's passes on the model's own products
        (`LayerStack.use_packed_weights`: on a CPU, prepacked float32 and native bf16 weights, for faster passes at
        about one more copy of the weights' memory).
        """
        _compat.check_supported()
        hf_generate.check_patchable(model)
        if isinstance(tokenizer, (RouterConfig, Mapping)):
            raise TypeError("from_model(model, tokenizer, config): the second argument is the tokenizer (or None).")
        config, overrides = split_config(config, overrides, RouterConfig)
        name = name_or_path or getattr(model.config, "_name_or_path", "") or type(model).__name__
        name = str(Path(name).resolve()) if Path(name).exists() else name  # a relative path: from anywhere later
        if heads is not None:
            saved = saved_router(str(heads)) or load_router(heads)  # load_router says what is missing
            if saved.adapted:
                raise ValueError(
                    f"{heads} holds an adapted base (adapt-base): its exits need the adapted weights, which from_model "
                    f"does not put into your model. Load it with EarlyExitRouter.from_pretrained({str(heads)!r})."
                )
            return cls._from_saved(model, tokenizer, saved, config, name, pack_weights, **overrides)
        config, own_head = own_head_config(model, name, config, overrides)  # a LayerSkip checkpoint: its own exit
        stack = stack_for(model)
        config, fresh = fresh_heads(stack, config)
        config = config.replace(heads_trained=own_head)
        stack.use_packed_weights(pack_weights)
        return cls(model, tokenizer, config, fresh, stack, name)._patched()

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
        pack_weights: bool = True,
        warm_up: bool = True,
        **overrides: Any,
    ) -> EarlyExitRouter:
        """Load a base model and its exit heads.

        `name_or_path` is an alias (`smollm2-135m`, which uses its shipped trained heads when present), a local HF
        model folder, a `.gguf` file, or a folder written by `save_pretrained`. `config` replaces the saved
        config; `overrides` change single fields (thresholds, mode, ...). Changing `exit_layers` or the adapter
        of saved heads is refused, since those heads would not exist. `fresh_heads=True` ignores saved or shipped
        heads and attaches new, untrained ones (for training). `quantize` loads the base quantized: "int8" or
        "int4" (torchao weight-only, any device) or "bnb-8bit" / "bnb-4bit" (bitsandbytes, CUDA); the heads stay
        dense. `pack_weights`: see `from_model`. `warm_up=False` leaves to the first call what `warm_up()` pays here
        (the cost table, kernels' first calls): for a router that will not decode (training, reports).
        """
        dtype, (config, overrides) = parse_dtype(dtype), split_config(config, overrides, RouterConfig)
        RouterConfig.check_names(overrides)  # before any weight is loaded
        saved = saved_router(str(name_or_path))
        if quantize and saved is not None and saved.adapted and saved.adapted["format"] == "lora":
            raise ValueError(
                f"{name_or_path} is a LoRA-adapted base, which merges into dense weights: load it without quantize, or "
                "run adapt-base with --merge and quantize the merged folder when loading it."
            )
        source = saved_base(str(name_or_path), saved) if is_router_dir(str(name_or_path)) else str(name_or_path)
        model, tokenizer, name = load_base_model(source, dtype, device, quantize)
        if saved is not None and saved.adapted:
            model = apply_adaptation(model, saved.path, saved.adapted)
        if saved is None or fresh_heads:
            fresh = (config or RouterConfig()) if fresh_heads else config  # heads to train: not a checkpoint's own
            router = cls.from_model(model, tokenizer, fresh, name_or_path=name, pack_weights=pack_weights, **overrides)
        else:
            router = cls._from_saved(model, tokenizer, saved, config, name, pack_weights, **overrides)
        if saved is not None and saved.adapted:
            router.adapted_from = (saved.path, saved.adapted)
            if saved.adapted["scope"] == "draft":  # the model stays as it is: the copies are the adaptation
                router.draft_path = load_draft_path(router.stack, saved.path, saved.adapted)
        if warm_up:
            router.warm_up()
        return router

    @classmethod
    def _from_saved(
        cls,
        model: nn.Module,
        tokenizer: Any,
        saved: SavedRouter,
        config: RouterConfig | None,
        name: str,
        pack_weights: bool = True,
        **overrides: Any,
    ) -> EarlyExitRouter:
        config = saved.config_for(config, overrides)  # the saved layout; heads_trained the heads', not the config's
        stack = stack_for(model)
        heads = heads_from_saved(saved, stack, config, name)
        stack.use_packed_weights(pack_weights)
        return cls(model, tokenizer, config, heads, stack, name)._patched()

    def load_saved_heads(self, name_or_path: str | Path) -> ExitHeads:
        """The trained heads saved at `name_or_path` (a `save_pretrained` folder, or an alias with shipped heads),
        built on this router's base model without attaching them: what a warm start trains from. Their base model
        must be this one; no second copy of it is loaded."""
        return saved_heads(name_or_path, self.stack, self.name_or_path)

    # ------------------------------------------------------------------------------------------------ patching
    def _patched(self) -> EarlyExitRouter:
        hf_generate.attach(self)
        self._state = "patched"
        return self

    def unpatch(self) -> nn.Module:
        """Remove everything the patch added and return the original model object. The router is unusable after."""
        self._require_patched()
        hf_generate.detach(self._model, release=True)
        self.stack.use_packed_weights(False)  # frees the packed copies
        self._state = "unpatched"
        return self._model

    @contextlib.contextmanager
    def disabled(self) -> Iterator[nn.Module]:
        """Inside, the model is exactly the plain model and `generate` runs plain HF generation."""
        self._require_patched()
        hf_generate.detach(self._model)
        self._state = "disabled"
        try:
            yield self._model
        finally:
            self._patched()

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
        """The exit adapters and gates, on the model's current device and in its dtype (moved when the user moved or
        cast the model)."""
        return self._heads.follow(self.stack.lm_head.weight)

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
        self.heads.set_gate(layer, gate, self.stack.device)

    def describe(self) -> str:
        """One line about the heads: exit layers, adapter and their size (and the prepacked weights, where used)."""
        line = self.heads.describe(self.name_or_path, self.stack, self.config, self.added_parameter_share())
        if self.draft_path is None:
            return line
        size = self.draft_path.nbytes() / 2**20
        return f"{line}; draft path: adapted copies of layers 0..{self.draft_path.exit_layer} ({size:.1f} MB)"

    # ------------------------------------------------------------------------------------------------ decoding
    def decoder(
        self,
        config: RouterConfig | Mapping[str, Any] | None = None,
        mode: str | None = None,
        *,
        batch: bool = False,
        sampling: bool = False,
        pad_token_id: int | None = None,
    ) -> Decoder:
        """A decoder for one call, or for a batch that rows join and leave (the server's), under `config` (default:
        the router's; a mapping changes fields of it) in `mode` (default: the config's).

        `batch=True`: several rows will share it, so it consults only the exits batches can and runs the design
        `config.batch_design` and `sampling` call for (`decode.batch.batch_layout`). Hold `router.lock` around each
        of its steps where other threads use this router."""
        cfg = self.call_config(config)
        mode = inputs.check_mode(mode, cfg)
        design = "synchronous"
        if batch:
            layout = batch_layout(cfg, self.heads, mode, sampling, self.stack)
            if layout is None:
                raise ValueError("These heads batch only row by row (their consulted exits all have blocks).")
            cfg, design = layout
        costs = self.costs(config=cfg) if cfg.policy == "cost" else None
        pad = self.pad_token_id() if pad_token_id is None else pad_token_id
        words = word_ids(self.tokenizer) if guards_repeats(cfg, mode) else frozenset()  # read once per tokenizer
        return Decoder(self.stack, self.heads, ExitRule(cfg, self.stack.vocab_size, words), cfg, mode, costs=costs,
                       store=self.ngram_store(cfg), batch_design=design, pad_token_id=pad,
                       draft_path=self.draft_path)  # fmt: skip

    def batch_config(self, config: RouterConfig | None = None) -> RouterConfig | None:
        """The config a batch runs under (block exits sit out), or None when its rows must run one after another."""
        layout = batch_layout(config := config or self.config, self.heads, config.mode, False, self.stack)
        return None if layout is None else layout[0]

    def can_batch(
        self, config: RouterConfig | None = None, mode: str | None = None, sampling: bool = False, cache: bool = False
    ) -> bool:
        """Whether several rows under `config` share one decoder, rather than running one after another (`cache`:
        one that returns the batch's cache, which a per-row batch does not)."""
        layout = batch_layout(config := config or self.config, self.heads, mode or config.mode, sampling, self.stack)
        return layout is not None and (not cache or layout[1] == "synchronous")

    def encode(self, prompt: str, chat: bool = False) -> torch.LongTensor:
        """Token ids (1, n) for a text prompt; `chat=True` applies the tokenizer's chat template."""
        return inputs.encode_prompt(self.tokenizer, prompt, chat, self.stack.device)

    def generate(
        self,
        input_ids: torch.Tensor | str,
        max_new_tokens: int = 128,
        mode: str | None = None,
        *,
        config: RouterConfig | Mapping[str, Any] | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
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

        `input_ids`: a LongTensor (b, n) (left-padded, with `attention_mask`, for several rows), or a string when a
        tokenizer is attached. `config` sets this call's routing, not `router.config`: a `RouterConfig`, or a mapping
        of fields to change (`{"high_conf_threshold": 0.8}`). Unset `eos_token_id`, `do_sample`, `temperature`,
        `top_k` and `top_p` come from the model's generation config, as in HF (top_k 50 unless set; 0 turns it off);
        its other fields (repetition_penalty, ...) apply through the patched `model.generate`. With `seed`, verify
        mode samples the tokens HF samples after `torch.manual_seed(seed)`, whatever was drafted. Stopping criteria
        see one row, (1, n), at each final token (never a draft), and None as scores, as HF hands them. Inside
        `disabled()`, this runs plain HF generation. Calls from several threads are served one after another.
        """
        if self._state == "unpatched":
            raise RuntimeError("This router was unpatched: build a new one with EarlyExitRouter.from_model(model).")
        cfg = self.call_config(config)
        mode = inputs.check_mode(mode, cfg)
        if isinstance(input_ids, str):
            input_ids = self.encode(input_ids)
        input_ids, attention_mask = self.check_input_ids(input_ids, attention_mask)
        inputs.check_length(input_ids.shape[1], max_new_tokens, self.context_length)
        params = SamplingParams.unset_from(self._model, do_sample, temperature, top_k, top_p, seed)
        stop_strings = as_stop_strings(stop_strings)
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: build the router with one.")
        eos = self.eos_token_ids(eos_token_id)
        if self._state == "disabled":
            return hf_generate.plain_generate(
                self._model, input_ids, attention_mask, max_new_tokens, params, self.stack.num_layers,
                eos_token_id=eos or None, streamer=streamer, output_logits=output_logits,
                stopping_criteria=stopping_criteria, logits_processor=logits_processor,
                **({"stop_strings": list(stop_strings), "tokenizer": self.tokenizer} if stop_strings else {}),
            )  # fmt: skip
        lossy = mode == "exit" and cfg.holdback is not None  # exited tokens may reach the caller unchecked
        if lossy and not self.config.heads_trained and not self._warned_untrained:
            self._warned_untrained = True
            warnings.warn(UNTRAINED_EXIT_MODE, UserWarning, stacklevel=2)
        request = DecodeRequest(max_new_tokens, frozenset(eos), stop_strings, as_criteria(stopping_criteria),
                                streamer, self.tokenizer, output_logits)  # fmt: skip
        selector = TokenSelector(params, self.stack.device, logits_processor)
        return self.decode(input_ids, attention_mask, request, selector, cfg, mode)

    def decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        request: DecodeRequest,
        selector: TokenSelector,
        config: RouterConfig | None = None,
        mode: str | None = None,
        pad_token_id: int | None = None,
    ) -> GenerationOutput:
        """One whole decode of checked (b, n) left-padded ids (`generate` without its argument handling). Rows that
        cannot share a decoder (`can_batch`) run one after another, with the same output layout; finished rows are
        filled with `pad_token_id` (default: the tokenizer's or the model's pad token, else EOS)."""
        cfg = config or self.config
        mode = inputs.check_mode(mode, cfg)
        batched = input_ids.shape[0] > 1 or not bool(attention_mask.all())
        pad = self.pad_token_id(request.eos_token_ids) if pad_token_id is None else pad_token_id
        if batched and (request.streamer is not None or request.output_logits):
            raise ValueError("Streamers and output_logits take one sequence: generate the batch row by row for them.")
        if batched and not self.can_batch(cfg, mode, selector.params.do_sample):
            alone = functools.partial(self.decode, config=cfg, mode=mode)
            return run_rows_alone(alone, input_ids, attention_mask, pad, request, selector)
        with self.lock:
            decoder = self.decoder(cfg, mode, batch=batched, sampling=selector.params.do_sample, pad_token_id=pad)
            return run_to_end(decoder, input_ids, attention_mask, request, selector)

    # ----------------------------------------------------------------------------------------- call settings
    def call_config(self, config: RouterConfig | Mapping[str, Any] | None = None) -> RouterConfig:
        """The routing config of one call: the router's, another `RouterConfig`, or the router's with the fields in
        a mapping changed. Checked against the loaded heads."""
        return inputs.call_config(config, self.config, self.heads.exit_layers)

    def check_input_ids(self, input_ids: Any, attention_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Validated (b, n) ids on the model's device, and their (b, n) attention mask (all ones when not given)."""
        return inputs.check_input_ids(input_ids, attention_mask, self.stack.vocab_size, self.stack.device)

    @property
    def context_length(self) -> int | None:
        """The model's context (config.max_position_embeddings), or None when it declares none."""
        return getattr(self._model.config, "max_position_embeddings", None)

    def eos_token_ids(self, eos_token_id: int | list[int] | None = None) -> list[int]:
        """The EOS ids a call stops at: `eos_token_id`, else the model's generation config's, else the
        tokenizer's."""
        return eos_ids_for(self._model, self.tokenizer, eos_token_id)

    def pad_token_id(self, eos_token_ids: Iterable[int] | None = None) -> int:
        """What finished rows of a batch are filled with: the tokenizer's or the model's pad token, else the
        smallest EOS id (default: this router's), else 0. (`model.generate` on a patched model fills them as HF
        does: the generation config's pad id, else its first EOS id.)"""
        return pad_id_for(self._model, self.tokenizer, eos_token_ids)

    def costs(self, refresh: bool = False, config: RouterConfig | None = None) -> CostModel:
        """The cost model the policy decides from: `cost_model` when assigned, else measured on this device for
        `config`'s draft vocabulary (default: the router's config).

        Measuring takes a few seconds once per model shape, device, dtype and library versions, whatever the config
        asks; the result is cached on disk (see `routing/costs.py`). `refresh=True` measures again."""
        if self.cost_model is not None and not refresh:
            return self.cost_model
        key = config_key(self.stack, config := config or self.config)
        stale = self._measured is not None and self._measured.stale  # decoders timed steps the table does not fit
        if refresh or stale or self._measured is None or self._measured.key != key:  # in memory: no disk read per call
            self._measured = config_costs(self.stack, self.heads, config, refresh or stale)
        return self._measured

    def warm_up(self, new_tokens: int = 8) -> None:
        """Pay now what a fresh router's first call would otherwise pay: the cost table (read from disk, or measured
        once per machine), every kernel's first call (a throw-away verify decode of `new_tokens` tokens over a
        repeating prompt, then every chunk width the config's drafts can run: `costs.warm_widths`) and packing
        the block adapters' layers. Nothing else stays: the n-gram store and `last_stats` are as they were."""
        with self.lock:  # the decoder the decode builds reads (or measures) the cost table
            for layer in self.heads.block_layers():  # a short decode need not probe them
                self.stack.packed_module(layer)
            store, last, self._ngram_store = self._ngram_store, self.last_stats, None
            try:
                ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4]], device=self.stack.device) % self.stack.vocab_size
                self.generate(ids, new_tokens, mode="verify", do_sample=False)
                warm_widths(self.stack, widths := chunk_widths(self.config, self.costs))
                if self.config.compile:  # the graphs too: a decode would compile each at its first use
                    warm_graphs(self.stack, self.heads, self.config, widths)
            finally:
                self._ngram_store, self.last_stats = store, last

    def clear_ngram_store(self) -> None:
        """Forget the earlier outputs the n-gram tier copies from (benchmarks start every run from nothing)."""
        with self.lock:
            self._ngram_store = None

    def ngram_store(self, config: RouterConfig | None = None) -> SuffixStore | None:
        """This router's store of earlier sequences for the n-gram tier, as `config` (default: the router's) sizes it;
        None where that config keeps no store (`ngram_store_tokens` 0, or the tier off): such a call neither reads
        nor adds to it. A config that sizes it differently starts a new one."""
        store = store_for(self._ngram_store, config or self.config)
        if store is not None:  # a config that keeps none leaves the router's as it is
            self._ngram_store = store
        return store

    # ----------------------------------------------------------------------------------------------- save/load
    def save_pretrained(self, path: str | Path) -> None:
        """Write `early_exit_config.json` and `early_exit_heads.safetensors` (heads only, never base weights; an
        adapted base's LoRA or merged model is copied along, so that the folder loads as this router)."""
        adapted = self.adapted_from[1] if self.adapted_from else None
        if self.adapted_from:
            copy_adapted(self.adapted_from[0], Path(path), adapted, {CONFIG_NAME, WEIGHTS_NAME, *KNOWN_EXTRA_FILES})
        save_router(path, self.config, self.heads, self.stack, self.name_or_path, adapted)
