"""A measured cost model: what one decoder layer, the full LM head and an exit's draft head cost on this device.

The router decides from these numbers, not from layer counts. Whether drafting pays depends on how the cost of a
chunk grows with its length: on a GPU at batch 1 a chunk of 8 positions costs about what one position costs
(decoding is bound by reading the weights), on a 2-core CPU it costs about twice as much, and some BLAS builds are
slower at 2-3 rows than at 4. One policy reads the same table everywhere and drafts long where chunks are cheap and
sparingly where they are not.

Costs are measured once per model shape, device, dtype and library versions, in milliseconds, at a fixed set of chunk
lengths (every length up to 16, where drafts and verify passes live, then 24, 32, 48 and 64; lengths in between are
interpolated and longer ones extrapolated), so measuring takes the same few seconds whatever a config asks, and cached
on disk as JSON (`cache_root()/costs/<key hash>.json`), so later processes load them in a millisecond.

A table measured while other work held the CPU can be wrong by a factor (one layer 62 ms at one position, 9.9 ms at
13). `CostModel.problems()` checks a table against itself (costs that fall as positions grow) and against a timed real
step; a table with problems is measured again, not cached, and a decoder does not draft from it. A table measured
while other work held more than BUSY_SHARE of the CPUs (`cpu_load.py`) can pass those checks with the contention's
prices: it is cached as a busy one, and the next process measures again, until a measurement is not busy or
BUSY_RETRIES busy ones in a row say that this is how the machine is, so a busy machine's cold start stays bounded.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from early_exit_router.models.compiled import GROUP, compiles_here
from early_exit_router.models.kernels import rising_within
from early_exit_router.routing.cpu_load import other_work_share, read_cpu
from early_exit_router.routing.table_key import MEASURED_CHUNKS, cost_key, cpu_model, device_name  # noqa: F401

COST_FORMAT_VERSION = 4  # 4: keyed by the compiled graphs; 3: fixed chunk lengths; 2: interleaved rounds, a real step
PAD_MIN_GAIN = 0.15  # pad a chunk only when the padded length is measured at least this much cheaper
# A consistent table: a longer chunk costs at least this share of one position, and a timed real step lies within
# this factor of the table's plain step.
MIN_CHUNK_RATIO = 0.5
REAL_STEP_FACTOR = 2.0
OBSERVED_STEPS = 32  # plain steps a decoder's timings are judged over (`CostModel.stale`)
BUSY_SHARE = 0.15  # other work's share of the CPUs while a table is measured above which it counts as busy
BUSY_RETRIES = 3  # busy measurements in a row after which a busy table is this machine's (no process measures again)

logger = logging.getLogger("early_exit_router")


@dataclass
class CostModel:
    """Milliseconds per operation, measured on one device, at the chunk lengths `chunks` (default 1..len(layer_ms))."""

    layer_ms: list[float]  # one decoder layer over a chunk of m new positions, for each m in `chunks`
    head_ms: list[float]  # final norm + full LM head over m rows
    draft_head_ms: float  # one row through an exit adapter, the final norm and the trimmed draft head
    gate_ms: float  # one learned-gate call (0 where there are no gates)
    num_layers: int
    key: dict[str, Any] = field(default_factory=dict)
    context: int = 0  # cached positions each layer held while measured
    real_step_ms: float = 0.0  # a timed real plain decoding step (every layer, one position, one head row): a check
    chunks: list[int] = field(default_factory=list)  # the chunk length of each entry (empty: 1, 2, 3, ...)
    # Measurements in a row during which other work held more than BUSY_SHARE of the CPUs (0: this one was not).
    busy_measurements: int = 0

    @property
    def chunk_lengths(self) -> list[int]:
        return self.chunks or list(range(1, len(self.layer_ms) + 1))

    @property
    def max_chunk(self) -> int:
        return self.chunk_lengths[-1]

    def _at(self, table: list[float], m: int) -> float:
        """The cost at chunk length m: measured, interpolated between the measured lengths around it, or past the
        longest, linear in m (the compute-bound regime)."""
        if m <= 0:
            return 0.0
        chunks = self.chunk_lengths
        i = bisect.bisect_left(chunks, m)
        if i == len(chunks):
            return table[-1] * m / chunks[-1]
        if chunks[i] == m or i == 0:
            return table[i]
        lo, hi = chunks[i - 1], chunks[i]
        return table[i - 1] + (table[i] - table[i - 1]) * (m - lo) / (hi - lo)

    def _padded(self, table: list[float], m: int) -> int:
        """The chunk length to run m positions at: the cheapest measured length >= m, if it is at least
        PAD_MIN_GAIN cheaper than m itself; else m.

        Some BLAS builds are slower at 2-4 rows than at 5 or 8 (measured on this project's 2-core CPU: 2 rows of
        the LM head take 2.3x as long as 1, and 8 rows 1.5x); padding a chunk with throw-away rows is then faster
        than running it as it is. A single position is never padded: a plain step stays exactly the plain model's
        work (in bf16 here a 2-row chunk measured cheaper than 1 row in isolation, yet padded plain steps ran 7%
        slower end to end), and small measured differences are noise, not a reason to spend compute."""
        if m <= 1 or m > self.max_chunk:
            return m
        candidates = [(table[i], k) for i, k in enumerate(self.chunk_lengths) if k >= m]
        cost, best = min(candidates)
        return best if cost <= (1.0 - PAD_MIN_GAIN) * self._at(table, m) else m

    def observe_step(self, ms: float) -> None:
        """A plain decoding step as a decoder timed it; see `stale`."""
        seen = self.__dict__.setdefault("_observed_steps", [])  # not a field: never saved with the table
        seen.append(ms)
        del seen[:-OBSERVED_STEPS]

    @property
    def stale(self) -> bool:
        """Whether the plain steps decoders timed lately (at least OBSERVED_STEPS // 2 of them) took, in the median,
        more than REAL_STEP_FACTOR times or less than 1 / REAL_STEP_FACTOR of what the table says a step costs: the
        machine is not what it was when the table was measured."""
        seen = self.__dict__.get("_observed_steps", [])
        if len(seen) < OBSERVED_STEPS // 2:
            return False
        ratio = statistics.median(seen) / self.plain_step()
        return not 1 / REAL_STEP_FACTOR <= ratio <= REAL_STEP_FACTOR

    def problems(self) -> list[str]:
        """What makes this table implausible (empty: none): non-positive costs, a longer chunk costing less than
        MIN_CHUNK_RATIO of one position (of the shortest chunk, where only chunks run from prepacked weights), or a
        timed real step further than REAL_STEP_FACTOR from the table's."""
        found = []
        for name, table in (("layer", self.layer_ms), ("head", self.head_ms)):
            if not table or not all(v > 0 and v == v and v != float("inf") for v in table):
                found.append(f"{name} costs are not all positive and finite")
                continue
            # Where chunks run from prepacked weights and one position does not, a chunk may cost far less than one
            # position (the timed real step checks that one): chunks are then held to the shortest chunk instead.
            first = 1 if self.key.get("packed_min_rows", 1) > 1 and len(table) > 2 else 0
            low = min(table[first + 1 :], default=table[first])
            if low < MIN_CHUNK_RATIO * table[first]:
                what = f"{self.chunk_lengths[first]} positions'" if first else "one position's"
                reference = f"{MIN_CHUNK_RATIO:g}x {what} {table[first]:.3g} ms"
                found.append(f"a {name} chunk costs {low:.3g} ms, under {reference}")
        if self.real_step_ms > 0 and not found:
            ratio = self.real_step_ms / self.plain_step()
            if not 1 / REAL_STEP_FACTOR <= ratio <= REAL_STEP_FACTOR:
                found.append(
                    f"a timed real step took {self.real_step_ms:.3g} ms, the table predicts {self.plain_step():.3g} ms"
                )
        return found

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

    def tree_pass_ms(self, width: int) -> float:
        """Every layer over one row of `width` positions, unpadded (a tree's mask covers its own positions only),
        and the full head over them."""
        return self.tree_layers(self.num_layers, width) + self.head(width)

    def tree_layers(self, count: int, m: int) -> float:
        """`count` layers over a tree's m positions (unpadded)."""
        return count * self._at(self.layer_ms, m)

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
        for m in self.chunk_lengths:
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


def chunk_widths(config: Any, costs: Callable[[], CostModel]) -> list[int]:
    """Every chunk width one sequence's decode under `config` can run layers or the LM head at: up to its longest
    draft, tree or queue of exited tokens plus the deep pass's own token, and, under the cost policy, the widths the
    table (`costs()`) pads those to."""
    longest = 1 + max(config.max_pending, config.ngram_draft if config.ngram_tier else 0, config.ngram_tree_nodes)
    widths = set(range(1, longest + 1))
    if config.policy == "cost":
        table = costs()
        widths |= {pad(w) for w in range(2, longest + 1) for pad in (table.layer_pad, table.head_pad)}
    return sorted(widths)


@torch.inference_mode()
def warm_widths(stack: Any, widths: list[int]) -> None:
    """Run one layer of each set of weight shapes, and the LM head, once over a throw-away chunk of every width in
    `widths`: a library kernel's first product at a shape can cost more than the product (oneDNN builds one per
    shape: about 3 ms a width of a bf16 pass here, measured), which the first decode to run at that width would
    otherwise pay. Every later layer of the same shapes runs the kernels built."""
    firsts: dict[tuple, int] = {}
    for j, layer in enumerate(stack.layers):
        shapes = tuple(tuple(m.weight.shape) for m in layer.modules() if isinstance(m, torch.nn.Linear))
        firsts.setdefault(shapes, j)
    for width in widths:
        hidden = torch.zeros(1, width, stack.hidden_size, dtype=stack.dtype, device=stack.device)
        positions = torch.arange(width, device=stack.device).unsqueeze(0)
        for j in firsts.values():
            hidden = stack.run(hidden, j, j + 1, stack.new_cache(), positions)
        stack.logits(hidden, precise=True)


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


@torch.inference_mode()  # as the decoder runs its steps
def measure(
    stack: Any,
    heads: Any,
    draft_vocab_size: int,
    chunks: tuple[int, ...] = MEASURED_CHUNKS,
    context: int = 128,
    reps: int = 3,
    rounds: int = 3,
    probe_layers: int = 4,
    compile: bool = False,
    half_draft: bool = False,
) -> CostModel:
    """Time `probe_layers` decoder layers at each of the chunk lengths `chunks` over a cache of `context` positions,
    the full head at as many rows, one draft-head row and one gate call. Layers of one model share their shape, so a
    few of them give the per-layer cost of all.

    The chunk lengths are swept `rounds` times, interleaved, and each entry is the median of its rounds' medians:
    a transient slowdown (another process, a kernel's first call at a new shape) then spoils one round of a few
    entries, not the table. A real plain decoding step is timed in every round too, as a check (`problems`).

    `compile` (where passes compile here): every pass over a static cache as a compiled decode runs it (as graphs up
    to `compiled.MAX_WIDTH` positions), so the policy prices what will run; an untimed first call compiles."""
    from early_exit_router.heads.adapters import needs_context
    from early_exit_router.heads.draft import draft_logits
    from early_exit_router.heads.gates import gate_probability
    from early_exit_router.models._compat import crop_cache_layer, prepare_for_rollback

    device, dtype, hidden = stack.device, stack.dtype, stack.hidden_size
    timed = _timer(device, reps)
    generator = torch.Generator(device="cpu").manual_seed(0)

    def states(m: int) -> torch.Tensor:
        return (torch.randn(1, m, hidden, generator=generator) * 0.5).to(device=device, dtype=dtype)

    compiled = compile and compiles_here(stack)
    count = min(GROUP if compiled else probe_layers, stack.num_layers)  # compiled: one group's graph, as decodes run
    cache = stack.new_cache(context + max(chunks)) if compiled else stack.new_cache()
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

    layer_rounds: list[list[float]] = [[] for _ in chunks]
    head_rounds: list[list[float]] = [[] for _ in chunks]
    step_rounds: list[float] = []
    x1, positions1 = chunk(1)
    for _ in range(rounds):
        for k, m in enumerate(chunks):
            x, positions = chunk(m)
            layer_rounds[k].append(timed(lambda x=x, p=positions: run_and_undo(x, p, count)) / count)
            head_rounds[k].append(timed(lambda x=x: stack.logits(x, compiled=compiled)))
        step_rounds.append(
            timed(lambda: (run_and_undo(x1, positions1, stack.num_layers), stack.logits(x1, compiled=compiled)))
        )
    # Through one packed copy a longer chunk never costs less: fit out the noise that would pad passes to one.
    packed = stack.packed_weights
    span = packed.served_span if packed is not None else None
    layer_ms = rising_within([statistics.median(r) for r in layer_rounds], chunks, span)
    head_span = span if packed is not None and packed.holds(stack.lm_head) else None
    head_ms = rising_within([statistics.median(r) for r in head_rounds], chunks, head_span)
    real_step_ms = statistics.median(step_rounds)
    row = states(1)[:, 0]
    exit_layer = heads.exit_layers[0] if heads.exit_layers else None
    adapter = heads.adapter(exit_layer) if exit_layer is not None else None
    if needs_context(adapter):  # a block adapter costs one decoder layer: the policy adds it from the layer table
        adapter = None
    draft = heads.draft_head(stack, draft_vocab_size, half_draft) if draft_vocab_size else None
    draft_ms = timed(lambda: draft_logits(stack, adapter, draft, row)) if exit_layer is not None else 0.0
    gate = heads.gate(exit_layer) if exit_layer is not None else None
    gate_ms = 0.0
    if gate is not None:  # a head gate also reads the head's output: time it with the features it computes
        logits = draft_logits(stack, adapter, draft, row)
        gate_ms = timed(lambda: gate_probability(gate, row, None, logits, None, draft))
    key = cost_key(stack, draft_vocab_size, compile, half_draft)
    return CostModel(layer_ms, head_ms, draft_ms, gate_ms, stack.num_layers, key, context, real_step_ms, list(chunks))


def cost_model_for(
    stack: Any,
    heads: Any,
    draft_vocab_size: int,
    refresh: bool = False,
    compile: bool = False,
    tries: int = 2,
    half_draft: bool = False,
) -> CostModel:
    """The cached cost model for this model and device; when missing (or implausible, or measured busy fewer than
    BUSY_RETRIES times in a row), measured (a few seconds, said in one log line) and cached. A table that still has
    problems after `tries` measurements is kept for this process only, and decoders do not draft from it
    (`CostModel.problems`). `compile`, `half_draft`: the table of the compiled passes, of a float16 draft head."""
    key = cost_key(stack, draft_vocab_size, compile, half_draft)
    cached = None if refresh else load_cached(key)
    busy_before = cached.busy_measurements if cached is not None else 0
    wrong = cached is not None and bool(cached.problems())
    if cached is not None and not wrong and not 0 < busy_before < BUSY_RETRIES:
        return cached
    path = cache_path(key)
    if cached is None:
        why = "as asked" if refresh else "once"
    else:
        why = "again: the cached table " + ("looks wrong" if wrong else "was measured beside other work")
    for attempt in range(tries):
        logger.warning(
            "early-exit-router: measuring this model's costs on %s (%s; cached at %s)",
            key["device"],
            why if attempt == 0 else "again",
            path,
        )
        before = read_cpu()
        model = measure(stack, heads, draft_vocab_size, compile=compile, half_draft=half_draft)
        busy = other_work_share(before, read_cpu())
        found = model.problems()
        if not found and busy is not None and busy > BUSY_SHARE:
            model = replace(model, busy_measurements=busy_before + 1)
            logger.warning(
                "early-exit-router: other work held %.0f%% of the CPUs while the costs were measured (%d time(s) in a "
                "row): %s (`early-exit-router profile --refresh` on an idle machine replaces the table)",
                100 * busy,
                model.busy_measurements,
                "the next process measures again"
                if model.busy_measurements < BUSY_RETRIES
                else "the table is kept as this machine's",
            )
        if not found:
            try:
                save_cached(model)
            except OSError:  # a read-only cache folder: keep the measurement for this process only
                pass
            return model
        logger.warning("early-exit-router: the measured costs look wrong (%s)%s", "; ".join(found),
                       ", measuring again" if attempt + 1 < tries else ": not cached, decoding plainly")  # fmt: skip
    return model


def config_key(stack: Any, config: Any) -> dict[str, Any]:
    """`cost_key` for what `config` runs: its draft head (size, precision) and its passes (compiled or not)."""
    return cost_key(stack, config.draft_vocab_size, config.compile, config.half_draft_head)


def config_costs(stack: Any, heads: Any, config: Any, refresh: bool = False) -> CostModel:
    """`cost_model_for` the draft head and passes `config` runs."""
    half = config.half_draft_head
    return cost_model_for(stack, heads, config.draft_vocab_size, refresh, config.compile, half_draft=half)
