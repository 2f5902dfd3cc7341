"""Per-architecture knowledge as an `ArchitectureSpec`, and the layer stack it drives.

A spec says where a model family keeps its parts (`model.layers`, `model.norm`, ...), how positions reach the
layers, which attention mask each layer needs, and the multipliers its forward applies. `discovery.py` infers it
from the model (an override in `patches/<family>.json` is read here, where one exists). `LayerStack` turns it into
the few operations the engine needs: embed tokens, run layers `[start, stop)` over a chunk of positions against the
shared cache, and apply the final norm and LM head. It calls the model's own modules; no HF modeling code is copied.
"""

from __future__ import annotations

import copy
import json
import operator
import weakref
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from early_exit_router.models import _compat
from early_exit_router.models.attention import check_native_gqa, native_gqa, native_gqa_supported
from early_exit_router.models.compiled import CompiledLayers, compiled_layers, compiled_logits, run_range
from early_exit_router.models.kernels import packing_supported
from early_exit_router.models.packed import PackedLinears
from early_exit_router.models.precise_logits import precise_top_logits, refines

POSITION_STYLES = ("rotary_shared", "rotary_per_layer_type", "learned")
# Inputs a family's decoder layer requires that the stack does not compute, and the config flag under which the layer
# actually needs them. Without the flag they are passed as None (Falcon's rotary configs take `alibi=None`); with it
# the family is refused, with the reason, also where a release computes the input elsewhere (transformers 5.25 folds
# Falcon's ALiBi into the mask, which the stack builds without it).
OPTIONAL_LAYER_INPUTS = {"alibi": "alibi"}
MASK_RULES = ("full", "layer_types", "sliding_window_config")


@dataclass(frozen=True)
class ArchitectureSpec:
    """Where one model family keeps its parts. Loaded from `patches/<family>.json`."""

    family: str
    model_types: tuple[str, ...]
    layers: str
    embed_tokens: str
    final_norm: str
    lm_head: str
    rotary_emb: str | None = None
    position_embed: str | None = None  # learned absolute positions added to the token embeddings (GPT-2)
    position_style: str = "rotary_shared"
    mask_rule: str = "full"
    embed_multiplier: float | None = None  # measured by discovery: the forward scales embeddings (Granite, Gemma)
    logit_multiplier: float | None = None  # measured by discovery: the forward scales logits (Cohere, Granite)
    final_logit_softcapping_attr: str | None = None
    # Names of linears that read one input, each set packed as one weight (`packed.py`). A wrong guess costs only
    # speed: a member called with another input gets its columns from a product of its own.
    shared_input_linears: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    notes: str = ""

    def __post_init__(self) -> None:
        if self.position_style not in POSITION_STYLES:
            raise ValueError(f"patch {self.family}: unknown position_style {self.position_style!r}")
        if self.mask_rule not in MASK_RULES:
            raise ValueError(f"patch {self.family}: unknown mask_rule {self.mask_rule!r}")
        if (self.position_style == "learned") != (self.position_embed is not None):
            raise ValueError(f"patch {self.family}: position_style 'learned' goes with a position_embed module")


def _patch_files() -> list[tuple[str, str]]:
    """(name, text) of every patch file, from the installed package or, in a checkout, from `patches/`."""
    try:
        root = resources.files("early_exit_router.patches")
        found = [(p.name, p.read_text()) for p in root.iterdir() if p.name.endswith(".json")]
        if found:
            return found
    except ModuleNotFoundError:
        pass
    checkout = Path(__file__).resolve().parents[2] / "patches"
    return [(p.name, p.read_text()) for p in sorted(checkout.glob("*.json"))]


@lru_cache(maxsize=1)
def architecture_table() -> dict[str, ArchitectureSpec]:
    """model_type -> spec, for every supported model type."""
    table: dict[str, ArchitectureSpec] = {}
    known = {f.name for f in fields(ArchitectureSpec)}
    for name, text in _patch_files():
        data = json.loads(text)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"patch file {name} has unknown keys {sorted(unknown)}")
        data["model_types"] = tuple(data["model_types"])
        if "shared_input_linears" in data:
            data["shared_input_linears"] = tuple(tuple(names) for names in data["shared_input_linears"])
        spec = ArchitectureSpec(**data)
        for model_type in spec.model_types:
            table[model_type] = spec
    return table


def spec_for(model: nn.Module) -> ArchitectureSpec:
    """The override spec for `model`'s model_type (see `architecture_table`), with its module paths checked."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = architecture_table()[model_type]
    for path in (spec.layers, spec.embed_tokens, spec.final_norm, spec.lm_head, spec.rotary_emb):
        if path is not None:
            try:
                operator.attrgetter(path)(model)
            except AttributeError:
                raise ValueError(
                    f"{type(model).__name__} (model_type {model_type!r}) has no `{path}`; early-exit-router needs a "
                    "causal LM with its LM head (e.g. AutoModelForCausalLM), not a bare base model."
                ) from None
    return spec


class LayerStack:
    """The operations the engine runs on one HF causal LM: embed, run a layer range, final norm + LM head."""

    def __init__(self, model: nn.Module, spec: ArchitectureSpec) -> None:
        self.model = model
        self.spec = spec
        self.config = model.config
        self.layers: nn.ModuleList = operator.attrgetter(spec.layers)(model)
        self.embed_tokens: nn.Module = operator.attrgetter(spec.embed_tokens)(model)
        self.final_norm: nn.Module = operator.attrgetter(spec.final_norm)(model)
        self.lm_head: nn.Module = operator.attrgetter(spec.lm_head)(model)
        self.rotary_emb: nn.Module | None = operator.attrgetter(spec.rotary_emb)(model) if spec.rotary_emb else None
        self.position_embed: nn.Module | None = (
            operator.attrgetter(spec.position_embed)(model) if spec.position_embed else None
        )
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.mask_kinds = [self._mask_kind(j) for j in range(self.num_layers)]
        self._cache_kwarg = _compat.cache_kwarg_for(type(self.layers[0]))
        self._absent_inputs = _inputs_passed_as_none(model, self.layers[0], self._cache_kwarg)
        self._softcap = (
            getattr(self.config, spec.final_logit_softcapping_attr, None) if spec.final_logit_softcapping_attr else None
        )
        self._layer_linears = [_linears(layer) for layer in self.layers]
        self._packed: PackedLinears | None = None  # see `use_packed_weights`
        # Packed copies of layers the stack runs but does not own (a block adapter's), dropped with the layer.
        self._module_packs: weakref.WeakKeyDictionary[nn.Module, PackedLinears] = weakref.WeakKeyDictionary()
        self._packing: tuple[bool, torch.device, torch.dtype] = (False, self.device, self.dtype)
        self._native_gqa: bool | None = None  # see `_attention`
        self._compiled: CompiledLayers | None = None  # see `compiled_layers`

    def __deepcopy__(self, memo: dict[int, Any]) -> LayerStack:
        """A copy (of a model copied whole, router and all) packs its copied weights again: packed weights are
        opaque tensors that cannot be copied."""
        copied = memo[id(self)] = object.__new__(type(self))
        fresh = {"_module_packs": weakref.WeakKeyDictionary(), "_packed": None, "_compiled": None}  # made again
        copied.__dict__.update({k: fresh[k] if k in fresh else copy.deepcopy(v, memo) for k, v in vars(self).items()})
        copied.use_packed_weights(self._packing[0])
        return copied

    def use_packed_weights(self, enabled: bool = True) -> str | None:
        """Run the layers' and the LM head's products from prepacked weights where that is faster (float32, and
        bf16 on CPUs that compute it natively: `packed.py`), at the memory of one more copy of those weights per
        packed row count; a model later moved or cast is packed again for its new place. Returns why they are not
        used (None: they are)."""
        self._packed = None
        self._module_packs.clear()
        self._packing = (enabled, self.device, self.dtype)
        reason = "switched off" if not enabled else packing_supported(self.device, self.dtype)
        if reason is None:
            layers = [m for group in self._layer_linears for m in group]
            groups = [g for layer in self.layers for g in _shared_input_groups(layer, self.spec.shared_input_linears)]
            self._packed = PackedLinears(layers, head=self.lm_head, groups=groups) or None
            reason = None if self._packed is not None else "no weight large enough for packing to pay"
        return reason

    @property
    def packed_weights(self) -> PackedLinears | None:
        """The prepacked weights in use (None: the modules' own products)."""
        enabled, device, dtype = self._packing
        if enabled and (device, dtype) != (self.device, self.dtype):  # the user moved or cast the model
            self.use_packed_weights(True)
        return self._packed

    def _mask_kind(self, layer_idx: int) -> str:
        rule = self.spec.mask_rule
        if rule == "layer_types":
            layer_types = getattr(self.config, "layer_types", None)
            return layer_types[layer_idx] if layer_types else "full_attention"
        if rule == "sliding_window_config":
            return "full_attention" if getattr(self.config, "sliding_window", None) is None else "sliding_attention"
        return "full_attention"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, static_slots: int | None = None) -> Any:
        """An empty cache: dynamic, or with `static_slots` a static one (the compiled passes'), None where the
        model's layers cannot use one."""
        if static_slots is not None:
            return _compat.new_static_cache(self.config, static_slots)
        return _compat.new_cache(self.config)

    def compiled_layers(self) -> CompiledLayers | None:
        """The compiled passes over a static cache (`compiled.py`), None where they do not compile here."""
        return compiled_layers(self)

    def embed(self, input_ids: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(b, q) token ids at positions start..start+q-1 (or at `positions`, (b, q), for left-padded rows) ->
        (b, q, hidden)."""
        hidden = self.embed_tokens(input_ids)
        if self.spec.embed_multiplier is not None:
            hidden = hidden * torch.tensor(self.spec.embed_multiplier, dtype=hidden.dtype)
        if self.position_embed is not None:  # learned absolute positions; rotary models add theirs in attention
            if positions is None:
                positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            hidden = hidden + self.position_embed(positions.clamp(min=0))  # left padding sits below 0 (HF: at 1)
        return hidden

    def run(
        self,
        hidden: torch.Tensor,
        start: int,
        stop: int,
        cache: Any,
        positions: torch.Tensor,
        pad_to: int = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run layers `[start, stop)` over a chunk of consecutive positions.

        `hidden` is (b, q, hidden_size) for positions `positions` (b, q); every layer in the range must hold exactly
        the slots before this chunk in `cache`, and gains these q slots. `attention_mask` (b, slots so far + q) marks
        the real slots of left-padded rows (None: every slot is real). `pad_to > q` runs the chunk with throw-away
        positions appended (copies of the last one, where causal attention keeps them from touching the real ones)
        and crops them from the cache again: faster where the device is slow at q rows. Sliding-window layers must
        record their past (`_compat.prepare_for_rollback`) to be padded.
        """
        q = hidden.shape[1]
        if start >= stop or pad_to <= q:
            return run_range(self, hidden, start, stop, cache, positions, attention_mask)
        extra = pad_to - q
        # (b, q) -> (b, pad_to): the throw-away positions continue each row's count
        steps = torch.arange(1, extra + 1, device=positions.device).unsqueeze(0)
        padded_positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], extra)], 1)
        out = run_range(self, _pad_rows(hidden, pad_to), start, stop, cache, padded_positions, attention_mask)
        for layer_idx in range(start, stop):
            _compat.drop_last_positions(cache, layer_idx, extra)
        return out[:, :q]

    def _run(
        self,
        hidden: torch.Tensor,
        start: int,
        stop: int,
        cache: Any,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layers: Sequence[nn.Module] | None = None,
    ) -> torch.Tensor:
        if start >= stop:
            return hidden
        masks: dict[str, Any] = {}
        rotary: dict[str, Any] = {}
        rows = hidden.shape[0] * hidden.shape[1]
        linears = (m for j in range(start, stop) for m in self._layer_linears[j])
        own = layers is None
        with self._attention(hidden.shape[1]), self._products(linears, rows) if own else nullcontext():
            for layer_idx in range(start, stop):
                kind = self.mask_kinds[layer_idx]
                if kind not in masks:
                    # Sized against this layer's cache: deep layers may hold fewer positions than shallow ones.
                    masks[kind] = _compat.build_mask(
                        kind, self.config, hidden, cache, positions, layer_idx, attention_mask
                    )
                    rotary[kind] = self._position_embeddings(hidden, positions, kind)
                layer = self.layers[layer_idx] if own else layers[layer_idx]
                with nullcontext() if own else self._module_products(layer, rows):
                    hidden = self._call_layer(layer, hidden, masks[kind], positions, rotary[kind], cache)
        return hidden

    def _products(self, linears: Iterable[nn.Module], rows: int) -> AbstractContextManager[None]:
        """The scope in which `linears` compute over `rows` rows: from their prepacked weights where those serve that
        row count (`linears` is walked only then)."""
        packed = self.packed_weights
        return packed.active(linears) if packed is not None and packed.serves(rows) else nullcontext()

    def run_module(
        self,
        layer: nn.Module,
        kind: str,
        hidden: torch.Tensor,
        cache: Any,
        positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one decoder layer that is not the model's own (a block adapter: the model's layer class, its cache
        at layer 0 of `cache`, or None for no cache) over a chunk, with this model's mask and positions of `kind`."""
        mask = _compat.build_mask(kind, self.config, hidden, cache, positions, 0, attention_mask)
        rotary = self._position_embeddings(hidden, positions, kind)
        with self._attention(hidden.shape[1]), self._module_products(layer, hidden.shape[0] * hidden.shape[1]):
            return self._call_layer(layer, hidden, mask, positions, rotary, cache)

    def packed_module(self, layer: nn.Module) -> PackedLinears | None:
        """Packed copies of a layer the stack runs but does not own (a block adapter's), packed at the first ask and
        dropped with the layer; None where the model's products are not packed."""
        if self.packed_weights is None:
            return None
        packed = self._module_packs.get(layer)
        if packed is None:
            groups = _shared_input_groups(layer, self.spec.shared_input_linears)
            packed = self._module_packs[layer] = PackedLinears(_linears(layer), groups=groups)
        return packed

    def _module_products(self, layer: nn.Module, rows: int) -> AbstractContextManager[None]:
        """`_products` for a layer the stack does not own. Not while it trains: its weights change at every step."""
        packed = None if torch.is_grad_enabled() else self.packed_module(layer)
        return packed.active(_linears(layer)) if packed is not None and packed.serves(rows) else nullcontext()

    def _attention(self, positions: int) -> AbstractContextManager[None]:
        """The scope in which the layers attend to `positions` new positions: grouped heads without copying the
        cache on a CPU, where the model was checked to take that path exactly (`attention.py`; checked at the first
        pass). One position never copies the cache (HF's sdpa folds the heads), so it keeps HF's path."""
        if positions == 1:
            return nullcontext()
        if self._native_gqa is None:
            self._native_gqa = False  # the check runs passes of its own
            self._native_gqa = check_native_gqa(self)
        return native_gqa(self.config) if self._native_gqa and native_gqa_supported(self.device) else nullcontext()

    def _call_layer(
        self, layer: nn.Module, hidden: torch.Tensor, mask: Any, positions: torch.Tensor, rotary: Any, cache: Any
    ) -> torch.Tensor:
        output = layer(
            hidden,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=rotary,
            use_cache=cache is not None,
            **{self._cache_kwarg: cache},
            **self._absent_inputs,
        )
        return _compat.layer_output_hidden(output)

    def _position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor, kind: str) -> Any:
        """Rotary (cos, sin) for these positions: one table for all layers, or one per layer type (Gemma3)."""
        if self.rotary_emb is None:
            return None
        if self.spec.position_style == "rotary_per_layer_type":
            return self.rotary_emb(hidden, positions, kind)
        return self.rotary_emb(hidden, positions)

    def logits(
        self, hidden: torch.Tensor, pad_to: int = 0, precise: bool = False, compiled: bool = False
    ) -> torch.Tensor:
        """Final norm + LM head (+ soft-capping where configured): (1, q, hidden) -> (1, q, vocab).

        `pad_to > q` computes that many rows (copies of the last) and returns the first q: see `run`. `precise`, on a
        bf16/fp16 head, returns float32 logits whose leading entries are the float32 product (`precise_logits.py`).
        `compiled`: the head may run as a graph (`compiled_logits`; `pad_to` then unused)."""
        q = hidden.shape[1]
        logits = compiled_logits(self, hidden, precise) if compiled else None
        if logits is not None:
            return logits
        normed = self.final_norm(_pad_rows(hidden, pad_to))
        return self._finish(self._head(normed)[:, :q], normed[:, :q], precise)

    def unembed(self, normed: torch.Tensor, precise: bool = False) -> torch.Tensor:
        """LM head (+ the family's multiplier or soft-cap) on final-normed states (..., hidden) -> (..., vocab);
        `precise`: as in `logits`."""
        return self._finish(self._head(normed), normed, precise)

    def _finish(self, raw: torch.Tensor, normed: torch.Tensor, precise: bool) -> torch.Tensor:
        """The head's output `raw` for the input `normed` as logits: the family's finish, after the float32 leading
        entries where `precise` asks for them and the head is bf16/fp16."""
        if precise and refines(self.lm_head):
            return precise_top_logits(raw, normed, self.lm_head, self.finish_logits)
        return self.finish_logits(raw)

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head's own output, before the family's multiplier or soft-cap."""
        with self._products((self.lm_head,), normed.shape[0] * normed.shape[1]):
            return self.lm_head(normed)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What the family does to the LM head's output: a logit multiplier (Cohere, Granite) or soft-capping
        (Gemma), or nothing."""
        if self.spec.logit_multiplier is not None:
            logits = logits * self.spec.logit_multiplier
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def shared_head_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors every exit head shares with the base model (hashed to match saved heads to their base);
        quantized ones dequantized, so that heads trained on the dense model load onto its quantized copy."""
        tensors = {f"lm_head.{k}": dense(v) for k, v in self.lm_head.state_dict().items()}
        tensors.update({f"final_norm.{k}": dense(v) for k, v in self.final_norm.state_dict().items()})
        return tensors

    @property
    def quantized(self) -> bool:
        """Whether any weight of the model is a quantized tensor (torchao, bitsandbytes, ...)."""
        return bool(self.weight_formats() - {"dense"})

    def weight_formats(self) -> set[str]:
        """The storage types of the model's weights: "dense", or a quantized tensor type's name."""
        return {type(p).__name__ if is_quantized(p) else "dense" for p in self.model.parameters()}


def run_in_place_of(
    stack: LayerStack, layers: Sequence[nn.Module], hidden: torch.Tensor, cache: Any, positions: torch.Tensor
) -> torch.Tensor:
    """Run `layers` in place of `stack`'s first len(layers) layers (an adapted draft path's copies of them, or the
    model's own while a LoRA in them trains) over a chunk, against `cache`: the model's masks and positions, each
    layer's products its own (packed apart while nothing trains)."""
    return stack._run(hidden, 0, len(layers), cache, positions, None, layers)


def _inputs_passed_as_none(model: nn.Module, layer: nn.Module, cache_kwarg: str) -> dict[str, None]:
    """The inputs the layers require but the stack does not compute (`OPTIONAL_LAYER_INPUTS`), as None; a config
    that needs one of them is refused."""
    known = {"self", "hidden_states", "attention_mask", "position_ids", "position_embeddings", "use_cache"}
    for name, flag in OPTIONAL_LAYER_INPUTS.items():
        if getattr(model.config, flag, False):
            raise ValueError(_unsupported_input(model, name, flag))
    absent = {}
    for name in _compat.required_layer_inputs(type(layer)):
        if name in known or name == cache_kwarg:
            continue
        if name not in OPTIONAL_LAYER_INPUTS:
            raise ValueError(_unsupported_input(model, name, None))
        absent[name] = None
    return absent


def _unsupported_input(model: nn.Module, name: str, flag: str | None) -> str:
    return (
        f"{type(model).__name__}'s decoder layers need `{name}`"
        + (f" (config.{flag} is set)" if flag else "")
        + ", which early-exit-router does not compute; this configuration is not supported."
    )


def _linears(module: nn.Module) -> list[nn.Module]:
    """Every `nn.Linear` inside `module` (the products packed weights can serve)."""
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def _shared_input_groups(module: nn.Module, names: Sequence[Sequence[str]]) -> list[list[nn.Module]]:
    """The linears in `module`'s tree that read one input, found by `names` among each submodule's children."""
    groups = []
    for parent in module.modules():
        for group in names:
            members = [parent._modules.get(name) for name in group]
            if all(isinstance(m, nn.Linear) for m in members):
                groups.append(members)
    return groups


def is_quantized(tensor: torch.Tensor) -> bool:
    """A weight stored in a quantized tensor type (a torch.Tensor subclass such as torchao's, or bitsandbytes'
    Params4bit and Int8Params), not a dense float tensor."""
    return type(tensor) not in (torch.Tensor, nn.Parameter) or not tensor.is_floating_point()


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a plain dense tensor: quantized weights dequantized (a temporary copy), others unchanged."""
    if not is_quantized(tensor):
        return tensor
    dequantize = getattr(tensor, "dequantize", None)
    if dequantize is None:
        raise ValueError(
            f"A quantized weight of type {type(tensor).__name__} cannot be dequantized; keep the LM head unquantized "
            "or set draft_vocab_size=0 (no trimmed draft head)."
        )
    return dequantize()


def _pad_rows(hidden: torch.Tensor, length: int) -> torch.Tensor:
    """(b, q, hidden) -> (b, max(q, length), hidden): throw-away copies of the last position appended."""
    extra = length - hidden.shape[1]
    return hidden if extra <= 0 else torch.cat([hidden, hidden[:, -1:].expand(-1, extra, -1)], dim=1)
