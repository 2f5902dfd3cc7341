"""A measured cost model: what one decoder layer, the full LM head and an exit's draft head cost on this device.

The router decides from these numbers, not from layer counts. Whether drafting pays depends on how the cost of a
chunk grows with its length: on a GPU at batch 1 a chunk of 8 positions costs about what one position costs
(decoding is bound by reading the weights), on a 2-core CPU it costs about twice as much, and some BLAS builds are
slower at 2-3 rows than at 4. One policy reads the same table everywhere and drafts long where chunks are cheap and
sparingly where they are not.

Costs are measured once per model shape, device, dtype and library versions, in milliseconds, and cached on disk as
JSON (`cache_root()/costs/<key hash>.json`), so later processes load them in a millisecond.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

COST_FORMAT_VERSION = 2  # 2: interleaved measurement rounds and a timed real step
PAD_MIN_GAIN = 0.15  # pad a chunk only when the padded length is measured at least this much cheaper


@dataclass
class CostModel:
    """Milliseconds per operation, measured on one device. Tables are indexed by chunk length - 1."""

    layer_ms: list[float]  # one decoder layer over a chunk of m new positions, m = 1..len(layer_ms)
    head_ms: list[float]  # final norm + full LM head over m rows
    draft_head_ms: float  # one row through an exit adapter, the final norm and the trimmed draft head
    gate_ms: float  # one learned-gate call (0 where there are no gates)
    num_layers: int
    key: dict[str, Any] = field(default_factory=dict)
    context: int = 0  # cached positions each layer held while measured
    real_step_ms: float = 0.0  # a timed real plain decoding step (every layer, one position, one head row): a check

    @property
    def max_chunk(self) -> int:
        return len(self.layer_ms)

    @staticmethod
    def _at(table: list[float], m: int) -> float:
        """The measured cost at chunk length m; past the table's end, linear in m (the compute-bound regime)."""
        if m <= 0:
            return 0.0
        if m <= len(table):
            return table[m - 1]
        return table[-1] * m / len(table)

    @staticmethod
    def _padded(table: list[float], m: int) -> int:
        """The chunk length to run m positions at: the cheapest measured length >= m, if it is at least
        PAD_MIN_GAIN cheaper than m itself; else m.

        Some BLAS builds are slower at 2-4 rows than at 5 or 8 (measured on this project's 2-core CPU: 2 rows of
        the LM head take 2.3x as long as 1, and 8 rows 1.5x); padding a chunk with throw-away rows is then faster
        than running it as it is. A single position is never padded: a plain step stays exactly the plain model's
        work (in bf16 here a 2-row chunk measured cheaper than 1 row in isolation, yet padded plain steps ran 7%
        slower end to end), and small measured differences are noise, not a reason to spend compute."""
        if m <= 1 or m > len(table):
            return m
        best = min(range(m, len(table) + 1), key=lambda k: (table[k - 1], k))
        return best if table[best - 1] <= (1.0 - PAD_MIN_GAIN) * table[m - 1] else m

    def layer_pad(self, m: int) -> int:
        """Positions to run a chunk of m positions through the layers at (see `_padded`)."""
        return self._padded(self.layer_ms, m)

    def head_pad(self, m: int) -> int:
        """Rows to run m rows through the LM head at (see `_padded`)."""
        return self._padded(self.head_ms, m)

    def layers(self, count: int, m: int) -> float:
        """`count` layers over a chunk of m positions (padded to the cheapest length, as the engine runs it)."""
        return count * self._at(self.layer_ms, self.layer_pad(m))

    def head(self, m: int) -> float:
        """The full LM head over m rows (padded, as the engine runs it)."""
        return self._at(self.head_ms, self.head_pad(m))

    def pass_ms(self, rows: int, width: int) -> float:
        """Every layer and the full head over `rows` rows of `width` positions each. One row runs padded, as the
        decoder runs it; several are costed as rows x width positions in one chunk (compute-bound once batching
        fills the device, as it does on a CPU)."""
        if rows == 1:
            return self.layers(self.num_layers, width) + self.head(width)
        m = rows * width
        return self.num_layers * self._at(self.layer_ms, m) + self._at(self.head_ms, m)

    def plain_step(self) -> float:
        """One token of plain decoding: every layer for one position, one head row."""
        return self.layers(self.num_layers, 1) + self.head(1)

    def markdown(self) -> str:
        """The table `early-exit-router profile` prints."""
        plain = self.plain_step()
        lines = [
            f"cost model ({self.key.get('device', '?')}, {self.key.get('dtype', '?')}, {self.num_layers} layers, "
            f"cache of {self.context} positions): plain decoding step {plain:.2f} ms",
            f"draft head (exit adapter + norm + trimmed head, 1 row): {self.draft_head_ms:.3f} ms; "
            f"learned gate: {self.gate_ms:.3f} ms"
            + (f"; a timed real decoding step: {self.real_step_ms:.2f} ms" if self.real_step_ms else ""),
            "",
            "Measured per chunk length m; 'run as' is the cheapest length >= m, which the engine pads to.",
            "",
            "| chunk m | one layer ms | layers run as | full head ms | head run as | verify pass / plain step |",
            "|---|---|---|---|---|---|",
        ]
        for m in range(1, self.max_chunk + 1):
            full = self.layers(self.num_layers, m)
            lines.append(
                f"| {m} | {self._at(self.layer_ms, m):.3f} | {self.layer_pad(m)} | {self._at(self.head_ms, m):.2f} | "
                f"{self.head_pad(m)} | {(full + self.head(m)) / plain:.2f} |"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": COST_FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        data = dict(data)
        version = data.pop("format_version", None)
        if version != COST_FORMAT_VERSION:
            raise ValueError(f"cost model format {version!r} is not {COST_FORMAT_VERSION}")
        return cls(**data)

    @classmethod
    def synthetic(
        cls, num_layers: int, layer_ms: list[float], head_ms: list[float], draft_head_ms: float = 0.0
    ) -> CostModel:
        """A hand-made table (tests, what-if analysis): e.g. flat chunk costs for a bandwidth-bound GPU."""
        return cls(list(layer_ms), list(head_ms), draft_head_ms, 0.0, num_layers, {"device": "synthetic"})


def cost_key(stack: Any, draft_vocab_size: int, max_chunk: int) -> dict[str, Any]:
    """What the measured costs depend on: the model's shape, the device, dtype, threads and library versions."""
    import transformers

    from early_exit_router._version import __version__

    cfg = stack.config
    device = stack.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    return {
        "model_type": str(getattr(cfg, "model_type", "")),
        "num_layers": stack.num_layers,
        "hidden_size": stack.hidden_size,
        "intermediate_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": getattr(cfg, "num_attention_heads", None),
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None),
        "vocab_size": stack.vocab_size,
        "device": f"{device.type}:{name}",
        "dtype": str(stack.dtype).replace("torch.", ""),
        "weights": sorted(stack.weight_formats()),  # a quantized base has costs of its own
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "library": __version__,
        "draft_vocab_size": draft_vocab_size,
        "max_chunk": max_chunk,
    }


def cache_path(key: dict[str, Any]) -> Path:
    from early_exit_router.models.loading import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "costs" / f"{digest}.json"


def load_cached(key: dict[str, Any]) -> CostModel | None:
    """The cached cost model for exactly this key, or None (missing, unreadable, or written for another key)."""
    path = cache_path(key)
    try:
        model = CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return model if model.key == key else None


def save_cached(model: CostModel) -> Path:
    path = cache_path(model.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(model.to_dict(), indent=2) + "\n")
    tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    return path


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of `reps` calls (after one warm-up), synchronising the device around each."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        samples = []
        for _ in range(reps):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            samples.append((time.perf_counter() - start) * 1000)
        return statistics.median(samples)

    return timed


@torch.no_grad()
def measure(
    stack: Any,
    heads: Any,
    draft_vocab_size: int,
    max_chunk: int = 16,
    context: int = 128,
    reps: int = 3,
    rounds: int = 3,
    probe_layers: int = 4,
) -> CostModel:
    """Time `probe_layers` decoder layers at chunk lengths 1..max_chunk over a cache of `context` positions, the
    full head at 1..max_chunk rows, one draft-head row and one gate call. Layers of one model share their shape,
    so a few of them give the per-layer cost of all.

    The chunk lengths are swept `rounds` times, interleaved, and each entry is the median of its rounds' medians:
    a transient slowdown (another process, a kernel's first call at a new shape) then spoils one round of a few
    entries, not the table. A real plain decoding step is timed too, as a check printed beside the table."""
    from early_exit_router.heads.adapters import needs_context
    from early_exit_router.heads.draft import draft_logits
    from early_exit_router.heads.gates import gate_probability
    from early_exit_router.models._compat import crop_cache_layer, prepare_for_rollback

    device, dtype, hidden = stack.device, stack.dtype, stack.hidden_size
    timed = _timer(device, reps)
    count = min(probe_layers, stack.num_layers)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def states(m: int) -> torch.Tensor:
        return (torch.randn(1, m, hidden, generator=generator) * 0.5).to(device=device, dtype=dtype)

    cache = stack.new_cache()
    prepare_for_rollback(cache)  # sliding-window layers: keep evicted states so the crops below can undo a chunk
    stack.run(states(context), 0, stack.num_layers, cache, torch.arange(context, device=device).unsqueeze(0))

    def chunk(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """m new positions after the cached ones: (1, m, hidden) states and (1, m) positions."""
        return states(m), torch.arange(context, context + m, device=device).unsqueeze(0)

    def run_and_undo(x: torch.Tensor, positions: torch.Tensor, stop: int) -> None:
        """Layers [0, stop) over the chunk, then crop it off again, so every call sees the same cache."""
        stack.run(x, 0, stop, cache, positions)
        for layer_idx in range(stop):
            crop_cache_layer(cache, layer_idx, context)

    layer_rounds: list[list[float]] = [[] for _ in range(max_chunk)]
    head_rounds: list[list[float]] = [[] for _ in range(max_chunk)]
    for _ in range(rounds):
        for m in range(1, max_chunk + 1):
            x, positions = chunk(m)
            layer_rounds[m - 1].append(timed(lambda x=x, p=positions: run_and_undo(x, p, count)) / count)
            head_rounds[m - 1].append(timed(lambda x=x: stack.logits(x)))
    layer_ms = [statistics.median(r) for r in layer_rounds]
    head_ms = [statistics.median(r) for r in head_rounds]
    x, positions = chunk(1)
    real_step_ms = timed(lambda: (run_and_undo(x, positions, stack.num_layers), stack.logits(x)))
    row = states(1)[:, 0]
    exit_layer = heads.exit_layers[0] if heads.exit_layers else None
    adapter = heads.adapter(exit_layer) if exit_layer is not None else None
    if needs_context(adapter):  # a block adapter costs one decoder layer: the policy adds it from the layer table
        adapter = None
    draft = heads.draft_head(stack, draft_vocab_size) if draft_vocab_size else None
    draft_ms = timed(lambda: draft_logits(stack, adapter, draft, row)) if exit_layer is not None else 0.0
    gate = heads.gate(exit_layer) if exit_layer is not None else None
    gate_ms = 0.0
    if gate is not None:  # a head gate also reads the head's output: time it with the features it computes
        logits = draft_logits(stack, adapter, draft, row)
        gate_ms = timed(lambda: gate_probability(gate, row, None, logits, None, draft))
    key = cost_key(stack, draft_vocab_size, max_chunk)
    return CostModel(layer_ms, head_ms, draft_ms, gate_ms, stack.num_layers, key, context, real_step_ms)


def cost_model_for(stack: Any, heads: Any, draft_vocab_size: int, max_chunk: int, refresh: bool = False) -> CostModel:
    """The cached cost model for this model and device, measured (a few seconds) and cached when missing."""
    key = cost_key(stack, draft_vocab_size, max_chunk)
    cached = None if refresh else load_cached(key)
    if cached is not None:
        return cached
    model = measure(stack, heads, draft_vocab_size, max_chunk)
    try:
        save_cached(model)
    except OSError:  # a read-only cache folder: keep the measurement for this process only
        pass
    return model
