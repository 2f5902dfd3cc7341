"""Compiled passes: positions through the decoder layers as torch.compile graphs over a static KV cache.

One graph per pass shape serves every group of `GROUP` consecutive decoder layers (and one more every single layer):
dynamo lifts a module's weights to graph inputs, and each layer sees its cache through a `LayerView` (its own static
buffers, whatever index its attention passes), so no layer index reaches a graph. Compiling then costs seconds once
per process (inductor keeps its artifacts on disk for the next), not a graph per layer range. A range's mask and
rotary tables are one more small graph (built against a copy of the cache that holds the range's first layer alone,
so one serves every range), the final norm and LM head another. The mask is HF's own (`_compat.build_mask` against
the static cache); routing decisions stay in Python between graphs.

A chunk of up to `MAX_WIDTH` positions (a plain step, a fill, verify or tree pass) runs as a graph: a plain step's
one position as its own graph, 2 to `MAX_WIDTH` positions as one graph whose width is a symbol (dynamo's
`mark_dynamic`), so two graph shapes serve every pass and none is padded; where the stack has prepacked weights the
graphs compute their products from those copies (`graph_products.py`). Wider chunks and left-padded rows run eagerly
from the prepacked weights on the same static cache, and so does the LM head where a packed copy serves its rows (a
graph only wraps its one product).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from early_exit_router.models import _compat, graph_products
from early_exit_router.models.precise_logits import refines

logger = logging.getLogger(__name__)

# The widest chunk that runs as a graph (wider ones run eagerly). Widths 2 to MAX_WIDTH share one graph whose width
# is a symbol: measured, a float32 SmolLM2 pass from the packed copies (2-core AMD host) took the same at each width
# as graphs compiled for it alone (40.1 ms at 2 positions, 45.0 at 3, 53.9 at 8, against 39.7, 45.9 and 54.3), and a
# cold first use compiles one graph instead of one per width (chunks padded to 1, 2, 4 or 8: 98 s at load). Past 8,
# compiling saves little over the eager pass (12 positions: 68.4 ms eagerly).
MAX_WIDTH = 8
SPAN = f"2-{MAX_WIDTH}"  # the shape key of the graph of 2 to MAX_WIDTH positions
SHAPES = (1, SPAN)  # the graphs of each kind a decode compiles
# Consecutive layers per graph call (a range's rest runs one layer a call): fewer calls and fusion across layers.
# Measured, a float32 SmolLM2 step: 35.2 ms one layer a call, 30.0 in groups of 6 (12 s to compile), 30.3 of 15 (28 s).
# A graph of pairs for the rest measured no faster on SmolLM2's ranges (0-16 and 16-30 at one position: 37.7-40.4 ms
# against 37.6-38.6, within the host's noise) and would add a third of a group's compile time.
GROUP = 6
# Graphs per compiled function (dynamo counts them per function, for every model of the process): one per width,
# layer-group size, static length and model; dynamo's default of 8 (256 over all functions) would fail the passes
# of the second or third model a process compiles (the family sweep in the tests runs 27).
RECOMPILE_LIMIT, ALL_GRAPHS_LIMIT = 1024, 8192
_DYNAMO = {  # the names before torch 2.7: cache_size_limit, accumulated_cache_size_limit
    next(key for key in (new, old) if hasattr(torch._dynamo.config, key)): limit
    for new, old, limit in (
        ("recompile_limit", "cache_size_limit", RECOMPILE_LIMIT),
        ("accumulated_recompile_limit", "accumulated_cache_size_limit", ALL_GRAPHS_LIMIT),
        # only the chunk's width is a symbol (`_mark_width`): a new static length is a new graph, as every shape
        # was before, not a recompile that makes it (and whatever else changed) a symbol too
        ("automatic_dynamic_shapes", "automatic_dynamic_shapes", False),
    )
    if hasattr(torch._dynamo.config, new) or hasattr(torch._dynamo.config, old)
}


class LayerView:
    """One static cache layer as a decoder layer's attention sees a cache: every update goes to this layer's buffers
    (the attention's `layer_idx` is ignored, which keeps it out of the graph)."""

    is_compileable = True

    def __init__(self, layer: Any) -> None:
        self.layer = layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.layer.update(key_states, value_states)


def compile_unsupported(stack: Any) -> str | None:
    """Why `stack`'s passes do not compile (None: they do)."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if any(kind != "full_attention" for kind in stack.mask_kinds):
        return "sliding-window layers keep a rolling cache that a rollback cannot reuse"
    if stack.quantized:
        return "quantized weights"
    if stack.device.type not in ("cpu", "cuda"):
        return f"device {stack.device.type} (compiled passes run on CPUs and CUDA)"
    implementation = getattr(stack.config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "eager"):  # flash kernels take no mask: they would read the unwritten slots
        return f"attention implementation {implementation!r} (compiled passes take sdpa or eager attention)"
    if stack.device.type == "cpu" and stack.dtype != torch.float32:
        # measured on SmolLM2, Xeon with AMX: 47.9 ms a compiled step against 44.2 from the packed weights
        return f"{str(stack.dtype).replace('torch.', '')} on a CPU, where the prepacked products are faster"
    return None


def _range_inputs(
    stack: Any, hidden: torch.Tensor, cache: Any, positions: torch.Tensor, kind: str, tree: torch.Tensor | None
) -> Any:
    """A range's mask (a tree's own, `tree`, widened to the static length) and rotary tables; `cache` holds the
    range's first layer alone (`_first_layer`), so no layer index reaches the graph and one serves every range."""
    mask = _compat.build_mask(kind, stack.config, hidden, cache, positions, 0, tree)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # as SDPA adds it, once for every layer
        mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask, stack._position_embeddings(hidden, positions, kind)


def _layers_pass(
    stack: Any, layers: tuple[nn.Module, ...], hidden: torch.Tensor, mask: Any, positions: torch.Tensor, rotary: Any,
    views: tuple[Any, ...],
) -> torch.Tensor:  # fmt: skip
    for layer, view in zip(layers, views):
        hidden = stack._call_layer(layer, hidden, mask, positions, rotary, view)
    return hidden


def _head_pass(stack: Any, hidden: torch.Tensor) -> torch.Tensor:
    return stack.finish_logits(stack.lm_head(stack.final_norm(hidden)))


class CompiledLayers:
    """The compiled graphs of one `LayerStack`, and the reason they stopped being used (`failed`)."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self._layers_in_order = tuple(stack.layers)  # sliced per call (a ModuleList slice builds a module)
        self.failed: str | None = None
        self.compile_s = 0.0  # seconds spent in first calls (compiling), this process
        # The static length decodes take: the longest any needed so far (shorter ones reuse its graphs, as HF's
        # static cache does across generate calls).
        self.static_slots = 0
        self._announced = False
        # C++ wrappers: ~6% of a float32 step on 2 cores. No CUDA graphs yet ("reduce-overhead"): one graph serves
        # every layer, each call with other weights, which CUDA graph trees would record once per layer.
        options = {"cpp_wrapper": True} if stack.device.type == "cpu" else {}
        # Products from the packed copies where the stack has them (else inductor's own GEMMs over the weights).
        self._packed = stack.packed_weights if graph_products.available() else None
        if self._packed is not None:
            options.update(graph_products.compile_options())
        kwargs = {"fullgraph": True, "dynamic": None, "options": options}  # None: `_mark_width` names the one symbol
        self._prep = torch.compile(_range_inputs, **kwargs)
        self._layers = torch.compile(_layers_pass, **kwargs)
        self._head = torch.compile(_head_pass, **kwargs)
        self._kwargs = kwargs
        self._graphs: dict[Any, Any] = {}  # other functions run as graphs (`call`), by function
        self._broken: dict[Any, str] = {}  # those that failed to compile, and why
        self._seen: set[tuple] = set()  # (graph, shape) pairs already compiled

    def serves(self, hidden: torch.Tensor, attention_mask: Any) -> bool:
        """Whether a pass over `hidden` runs as graphs: one sequence, a chunk of up to `MAX_WIDTH` positions, and no
        mask or a tree's own (4D: left-padded rows' 2D masks need the eager pass)."""
        tree_or_none = attention_mask is None or attention_mask.dim() == 4
        one_chunk = hidden.shape[0] == 1 and graph_shape(hidden.shape[1]) is not None
        return self.failed is None and one_chunk and tree_or_none

    def run(
        self,
        hidden: torch.Tensor,
        start: int,
        stop: int,
        cache: Any,
        positions: torch.Tensor,
        tree: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layers [start, stop) over `hidden` (1, q, hidden_size) at `positions` (under `tree`, a token tree's own
        (1, 1, q, slots so far + q) mask) as the graphs of `graph_shape(q)` (the cache has room for the chunk); falls
        back to eager passes (and stays there, logged) where a graph fails to compile."""
        q = hidden.shape[1]
        shape = graph_shape(q)
        views = _views(cache)
        length = cache.layers[start].max_cache_len  # the static length: part of every graph's shapes
        held = cache.layers[start].cumulative_length.clone()  # every layer of the range holds these slots
        chunk, chunk_positions = _fresh(hidden), _fresh(positions)
        # a tree's mask at the static length before the graph: its width (slots so far) would be a new shape a pass
        static_tree = _compat.pad_custom_mask(tree, cache, start) if tree is not None else None
        _mark_width(q, (chunk, -2), (chunk_positions, -1), (static_tree, -2))
        j, size = start, 1
        try:
            # Grouped heads attend without copying the static buffers (`attention.py`): a static cache's step has
            # a mask (the unwritten slots), which makes HF's sdpa repeat every key and value head over its length.
            with torch._dynamo.config.patch(**_DYNAMO), self.stack._attention(2):
                kind = self.stack.mask_kinds[start]
                range_key = ("range", kind, length, shape, tree is not None)
                mask, rotary = self._call(self._prep, range_key, self.stack, chunk, _first_layer(cache, start),
                                          chunk_positions, kind, static_tree)  # fmt: skip
                _mark_width(q, (mask, -2), (rotary, -2))  # (1, 1, q, length) and (1, q, head_dim) tables
                while j < stop:
                    size = GROUP if stop - j >= GROUP else 1  # two graphs a shape: a group, one layer
                    layers, group_views = self._layers_in_order[j : j + size], tuple(views[j : j + size])
                    with self._products([m for k in range(j, j + size) for m in self.stack._layer_linears[k]], q):
                        chunk = self._call(self._layers, ("layers", size, length, shape), self.stack, layers, chunk,
                                           mask, chunk_positions, rotary, group_views)  # fmt: skip
                    j += size
        except Exception as error:  # noqa: BLE001 (any compiler failure: the eager pass is always there)
            self._fail(error)
            for k in range(start, stop):  # this pass's slots in every layer it reached: the eager pass writes them
                cache.layers[k].cumulative_length.copy_(held)
            return self.stack._run(hidden, start, stop, cache, positions, tree)
        return chunk

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Final norm + LM head (+ the family's finish) over (1, q) positions, q up to `MAX_WIDTH`, or None where it
        does not compile."""
        q = hidden.shape[1]
        shape = graph_shape(q) if hidden.shape[0] == 1 else None
        if self.failed is not None or shape is None:
            return None
        chunk = _fresh(hidden)
        _mark_width(q, (chunk, -2))
        try:
            with torch._dynamo.config.patch(**_DYNAMO), self._products((self.stack.lm_head,), q):
                return self._call(self._head, ("head", shape), self.stack, chunk)
        except Exception as error:  # noqa: BLE001
            self._fail(error)
            return None

    def call(self, function: Any, shape: tuple, *args: Any) -> Any:
        """`function(*args)` as a graph compiled as the passes are (its first call of `shape` timed as compiling), or
        None where it does not compile: the caller runs it eagerly then, and from then on (logged once)."""
        if self.failed is not None or function in self._broken:
            return None
        graph = self._graphs.get(function)
        if graph is None:
            graph = self._graphs[function] = torch.compile(function, **self._kwargs)
        try:
            with torch._dynamo.config.patch(**_DYNAMO):
                return self._call(graph, shape, *args)
        except Exception as error:  # noqa: BLE001 (any compiler failure: the eager function is always there)
            self._broken[function] = reason = _reason(error)
            logger.warning("early-exit-router: %s did not compile (%s); it runs eagerly", function.__name__, reason)
            return None

    def _products(self, linears: Sequence[nn.Module], rows: int) -> Any:
        """The scope in which the graphs over `linears` take their products from the packed copies."""
        return graph_products.products_from_packed(self._packed, linears, rows)

    def _call(self, graph: Any, shape: tuple, *args: Any) -> Any:
        """Call a compiled function, timing (and announcing, once) a first call of a new `shape`: the compile."""
        if shape in self._seen:
            return graph(*args)
        if not self._announced:
            self._announced = True
            logger.warning("early-exit-router: compiling the decode passes (a few graphs, seconds each, once per "
                           "process; inductor caches them on disk for the next)")  # fmt: skip
        started = time.perf_counter()
        out = graph(*args)
        self.compile_s += time.perf_counter() - started
        self._seen.add(shape)
        return out

    def _fail(self, error: Exception) -> None:
        self.failed = _reason(error)
        logger.warning("early-exit-router: compiled passes failed (%s); eager passes from now on", self.failed)


def _reason(error: Exception) -> str:
    """A compiler error in one line, for the log."""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def graph_shape(q: int) -> int | str | None:
    """The graph a chunk of q positions runs as: 1 (a plain step's), `SPAN` (the one graph of 2 to `MAX_WIDTH`
    positions) or None (wider: an eager pass)."""
    return 1 if q == 1 else SPAN if 2 <= q <= MAX_WIDTH else None


def _mark_width(q: int, *tensors: tuple[Any, int]) -> None:
    """Name dimension `dim` of each (tensors, dim) pair's tensors (any nesting; None skipped), the chunk's width q,
    dynamo's symbol for the graph of 2 to `MAX_WIDTH` positions (a plain step's width 1 stays a constant)."""
    if q == 1:
        return
    for tree, dim in tensors:
        for leaf in torch.utils._pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= -dim and leaf.shape[dim] == q:
                torch._dynamo.mark_dynamic(leaf, leaf.dim() + dim, min=2, max=MAX_WIDTH)


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `tensor`: a graph's input may be marked (`_mark_width`), and a slice of a longer tensor
    (a prompt's last row) keeps strides the guards would take for a new shape."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _first_layer(cache: Any, start: int) -> Any:
    """A shallow copy of the static `cache` whose only layer is its layer `start` (what a range's mask is sized
    against): the mask graph then sees no layer index."""
    view = copy.copy(cache)
    view.layers = [cache.layers[start]]
    return view


def _views(cache: Any) -> list[LayerView]:
    """The per-layer views of `cache`, made once per cache."""
    views = getattr(cache, "_layer_views", None)
    if views is None or [v.layer for v in views] != cache.layers:  # identity: layers define no __eq__
        views = cache._layer_views = [LayerView(layer) for layer in cache.layers]
    return views


def compiles_here(stack: Any) -> bool:
    """Whether `stack`'s passes run as graphs when a config asks (they compile here and none has failed)."""
    compiled = compiled_layers(stack)
    return compiled is not None and compiled.failed is None


def compiled_layers(stack: Any) -> CompiledLayers | None:
    """`stack`'s compiled passes (made at the first ask), None where they do not compile here."""
    if stack._compiled is None and compile_unsupported(stack) is None:
        stack._compiled = CompiledLayers(stack)
    return stack._compiled


def run_range(
    stack: Any,
    hidden: torch.Tensor,
    start: int,
    stop: int,
    cache: Any,
    positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """`LayerStack._run`, as graphs where the cache is static and the pass's shape compiles (room made first)."""
    if start < stop and _compat.is_static(cache):
        _compat.make_room(cache, start, _compat.static_held(cache, start) + hidden.shape[1])
        compiled = compiled_layers(stack)
        if compiled is not None:  # a grown cache: later decodes start at its length (its graphs are compiled)
            compiled.static_slots = max(compiled.static_slots, cache.layers[start].max_cache_len)
        if compiled is not None and compiled.serves(hidden, attention_mask):
            return compiled.run(hidden, start, stop, cache, positions, attention_mask)
    return stack._run(hidden, start, stop, cache, positions, attention_mask)


def compiled_logits(stack: Any, hidden: torch.Tensor, precise: bool) -> torch.Tensor | None:
    """A chunk's final norm + LM head as a graph, or None where it runs eagerly: from a packed copy of the head that
    serves its rows (one product, which a graph only wraps: measured, 5.3 ms compiled against 4.9 eagerly at one row
    on the AMD host), or as a float32 refinement of a bf16 head's leading logits."""
    packed, rows = stack.packed_weights, hidden.shape[0] * hidden.shape[1]
    if (packed is not None and packed.holds(stack.lm_head) and packed.serves(rows)) or (
        precise and refines(stack.lm_head)
    ):
        return None
    compiled = compiled_layers(stack)
    return None if compiled is None else compiled.logits(hidden)


@torch.inference_mode()
def warm_passes(stack: Any, widths: Iterable[int]) -> None:
    """Compile now the graphs (`SHAPES`) that decodes at the static length in use run chunks of `widths` positions
    as: a range's mask (and a tree's), a group of layers, a single layer and, where it runs as a graph
    (`compiled_logits`), the LM head; announced, then timed (inductor's disk cache makes a later process's compile
    quicker)."""
    compiled = compiled_layers(stack)
    if compiled is None or compiled.failed is not None or not compiled.static_slots:
        return
    # each shape at the narrowest of `widths` it serves
    shapes = {graph_shape(q): q for q in sorted(widths, reverse=True) if graph_shape(q) is not None}
    cache = stack.new_cache(compiled.static_slots)
    if cache is None:
        return
    first = torch.zeros(1, 1, stack.hidden_size, dtype=stack.dtype, device=stack.device)
    stack._run(first, 0, stack.num_layers, cache, torch.zeros(1, 1, dtype=torch.long, device=stack.device))  # buffers
    for layer in cache.layers:  # empty again: a tree's mask below covers its own slots alone
        _compat.drop_static_slots(layer, 1)
    compiled._announced = True  # this line says it
    logger.warning("early-exit-router: compiling the decode passes: %d graph shapes (once per process; inductor "
                   "caches them on disk)", len(shapes))  # fmt: skip
    before = compiled.compile_s
    for width in shapes.values():
        hidden = first.expand(1, width, -1)
        positions = torch.arange(1, width + 1, device=stack.device).unsqueeze(0)
        causal = torch.ones(1, width, width, dtype=torch.bool, device=stack.device).tril()
        tree = _compat.tree_attention_mask(stack.config, causal, stack.dtype)  # a tree pass's mask graph
        for stop, mask in ((stack.num_layers, None), (1, None), (1, tree)):  # groups of layers, one layer, a tree
            compiled.run(hidden, 0, stop, cache, positions, mask)
            for layer in cache.layers[:stop]:
                _compat.drop_static_slots(layer, width)
        compiled_logits(stack, hidden, precise=False)
    logger.warning("early-exit-router: compiled in %.0f s", compiled.compile_s - before)


_said: set[str] = set()


def say_eager(reason: str) -> None:
    """Log once per process and reason why a decode asked to compile runs its passes eagerly."""
    if reason not in _said:
        _said.add(reason)
        logger.warning("early-exit-router: compile=True, but this decode's passes run eagerly: %s", reason)
