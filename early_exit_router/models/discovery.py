"""Architecture discovery and the numeric self-test that every patch runs.

For a family without a spec file, `discover_spec` reads the module tree and the config: the decoder layers are the
`ModuleList` as long as the model is deep, the embeddings and LM head are what the model itself reports
(`get_input_embeddings` / `get_output_embeddings`), the final norm is the one normalisation module beside the
layers, the rotary table is the module beside them that computes rotary embeddings, and the masks follow the
config's `layer_types` or `sliding_window`. Scalings are not guessed from names: the embedding multiplier and the
logit multiplier are measured on a probe against the model's own forward pass.

`self_test` then runs the segmented forward the engine uses (a prefill, then the last positions through two
segments against the cache) and compares it with the model's own forward: logits at every position and every
layer's keys and values. A family whose forward has something the stack does not reproduce is refused, with the
part that did not match, instead of generating silently wrong text.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from early_exit_router.models import _compat
from early_exit_router.models.architecture import ArchitectureSpec, LayerStack, architecture_table, spec_for

PROBE_LEN = 7
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}  # relative to the largest magnitude; others: 3e-2


class ArchitectureMismatchError(ValueError):
    """The stack's segmented forward does not reproduce the model's own forward."""


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules() if name}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or "norm" in type(module).__name__.lower()


def discover_spec(model: nn.Module) -> ArchitectureSpec:
    """Infer where `model` keeps its parts; raise ValueError naming the part that could not be found."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    depth = getattr(config, "num_hidden_layers", None)
    paths = _module_paths(model)

    def refuse(what: str) -> ValueError:
        return ValueError(
            f"Cannot use {type(model).__name__} (model_type {model_type!r}): {what}. early-exit-router needs a "
            "decoder-only causal LM with one stack of decoder layers, a final norm and an LM head."
        )

    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth and n]
    if not lists:
        raise refuse(f"no ModuleList of {depth} decoder layers (config.num_hidden_layers)")
    layers_path, _ = min(lists, key=lambda item: item[0].count("."))
    base_path = layers_path.rpartition(".")[0]
    base = operator.attrgetter(base_path)(model) if base_path else model
    prefix = f"{base_path}." if base_path else ""

    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embed is None or id(embed) not in paths:
        raise refuse("the model reports no input embedding module")
    if head is None or id(head) not in paths or getattr(head, "weight", None) is None:
        raise refuse("no LM head (get_output_embeddings); load it with AutoModelForCausalLM")

    norms = [name for name, m in base.named_children() if m is not None and _is_norm(m)]
    if len(norms) != 1:
        raise refuse(f"expected one final norm beside the layers, found {norms or 'none'}")
    rotary = [name for name, m in base.named_children() if "rotary" in type(m).__name__.lower()]
    if len(rotary) > 1:
        raise refuse(f"several rotary tables beside the layers ({rotary})")
    rotary_path = f"{prefix}{rotary[0]}" if rotary else None
    position_style, position_embed = "rotary_shared", None
    if rotary_path is not None:
        params = inspect.signature(operator.attrgetter(rotary_path)(model).forward).parameters
        if "layer_type" in params:
            position_style = "rotary_per_layer_type"
    else:
        learned = [
            name
            for name, m in base.named_children()
            if isinstance(m, nn.Embedding) and m is not embed and m.num_embeddings >= PROBE_LEN
        ]
        if len(learned) > 1:
            raise refuse(f"several position embeddings ({learned})")
        if learned:
            position_style, position_embed = "learned", f"{prefix}{learned[0]}"
    if getattr(config, "layer_types", None):
        mask_rule = "layer_types"
    elif getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        mask_rule = "sliding_window_config"
    else:
        mask_rule = "full"
    softcap = "final_logit_softcapping" if getattr(config, "final_logit_softcapping", None) else None
    spec = ArchitectureSpec(
        family=f"{model_type} (discovered)",
        model_types=(model_type,),
        layers=layers_path,
        embed_tokens=paths[id(embed)],
        final_norm=f"{prefix}{norms[0]}",
        lm_head=paths[id(head)],
        rotary_emb=rotary_path,
        position_embed=position_embed,
        position_style=position_style,
        mask_rule=mask_rule,
        final_logit_softcapping_attr=softcap,
        notes="discovered from the module tree and config; multipliers measured",
    )
    return _measure_multipliers(model, spec)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) inside; every module's own flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _probe_ids(stack: LayerStack) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(stack.vocab_size, 1000), (1, PROBE_LEN), generator=g).to(stack.device)


def _scale(reference: torch.Tensor, ours: torch.Tensor) -> float:
    """The scalar s that best fits reference = s * ours (least squares)."""
    a, b = reference.double().flatten(), ours.double().flatten()
    return float((a @ b) / (b @ b).clamp_min(1e-30))


@torch.no_grad()
def _measure_multipliers(model: nn.Module, spec: ArchitectureSpec) -> ArchitectureSpec:
    """The embedding multiplier (first layer's input / embeddings) and the logit multiplier (model's logits / LM
    head of the final norm's output), each kept only where it differs from 1.

    The two tensors are read with forward hooks that are removed again before returning (not with
    `output_hidden_states`, which leaves transformers' own capturing hooks installed on the model)."""
    stack = LayerStack(model, spec)
    ids = _probe_ids(stack)
    seen: dict[str, torch.Tensor] = {}

    def layer_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("embedded", args[0] if args else kwargs["hidden_states"])

    def norm_output(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["normed"] = output

    handles = [
        stack.layers[0].register_forward_pre_hook(layer_input, with_kwargs=True),
        stack.final_norm.register_forward_hook(norm_output),
    ]
    try:
        with evaluating(model):
            logits = model(ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    embed = _scale(seen["embedded"], stack.embed(ids))
    # Soft-capped families keep their cap as data (the cap is not a multiplier).
    logit = 1.0 if spec.final_logit_softcapping_attr else _scale(logits, stack.lm_head(seen["normed"]))
    return replace(
        spec,
        embed_multiplier=None if abs(embed - 1) < 1e-3 else embed,
        logit_multiplier=None if abs(logit - 1) < 1e-3 else logit,
    )


@torch.no_grad()
def self_test(stack: LayerStack) -> None:
    """Compare the stack's segmented forward with the model's own: logits and every layer's cache.

    Raises ArchitectureMismatchError naming what differs. The model's weights, flags and caches are untouched."""
    model = stack.model
    ids = _probe_ids(stack)
    with evaluating(model):
        reference = model(ids, use_cache=True)
    ref_cache = _compat.forward_cache(reference)
    tol = TOLERANCE.get(stack.dtype, 3e-2)
    split = PROBE_LEN - 3
    middle = stack.num_layers // 2
    cache = stack.new_cache()
    first = torch.arange(split, device=stack.device).unsqueeze(0)
    rest = torch.arange(split, PROBE_LEN, device=stack.device).unsqueeze(0)
    hidden = stack.run(stack.embed(ids[:, :split]), 0, stack.num_layers, cache, first)
    tail = stack.run(stack.embed(ids[:, split:], split), 0, middle, cache, rest)
    tail = stack.run(tail, middle, stack.num_layers, cache, rest)
    logits = stack.logits(torch.cat([hidden, tail], dim=1))

    def close(ref: torch.Tensor, ours: torch.Tensor) -> float:
        return float((ref.float() - ours.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))

    where = f"{type(model).__name__} ({stack.spec.family})"
    if ref_cache is not None:
        for idx in range(stack.num_layers):
            ref_layer, our_layer = ref_cache.layers[idx], cache.layers[idx]
            if ref_layer.keys.shape != our_layer.keys.shape:
                raise ArchitectureMismatchError(
                    f"{where}: layer {idx}'s cache holds {tuple(our_layer.keys.shape)} in the segmented forward but "
                    f"{tuple(ref_layer.keys.shape)} in the model's own; this family is not supported."
                )
            err = max(close(ref_layer.keys, our_layer.keys), close(ref_layer.values, our_layer.values))
            if err > tol:
                hint = "the embeddings or positions" if idx == 0 else f"layer {idx - 1}'s output or the positions"
                raise ArchitectureMismatchError(
                    f"{where}: layer {idx}'s keys/values differ from the model's own forward (relative error "
                    f"{err:.2e} > {tol:.0e}); {hint} are not reproduced. This family is not supported."
                )
    err = close(reference.logits, logits)
    if err > tol:
        raise ArchitectureMismatchError(
            f"{where}: the logits differ from the model's own forward (relative error {err:.2e} > {tol:.0e}) while "
            "the caches match: the final norm, LM head or a logit scaling is not reproduced. This family is not "
            "supported."
        )


def stack_for(model: nn.Module) -> LayerStack:
    """The checked layer stack of `model`: its spec file or, without one, discovery; then the self-test."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    try:
        spec = spec_for(model) if model_type in architecture_table() else discover_spec(model)
        stack = LayerStack(model, spec)
        self_test(stack)
    except ValueError:  # a part not found, or the self-test's mismatch: the message says which
        raise
    except Exception as exc:  # the family's modules reject the stack's calling convention
        raise ArchitectureMismatchError(
            f"{name} (model_type {model_type!r}): its modules cannot be run segment by segment "
            f"({type(exc).__name__}: {exc}); this family is not supported."
        ) from exc
    return stack
