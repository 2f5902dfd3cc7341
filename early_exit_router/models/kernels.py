"""The packed matrix products a CPU offers for decoding's few rows, and which one this process uses.

A packed kernel lays a weight out once for the library's product (`PackedKernel.pack`) and multiplies from that copy
(`PackedKernel.product`); `models/packed.py` keeps the copies and swaps them in. Measured on a 2-core x86_64 CPU
(SmolLM2-135M's shapes):

- **bf16** (oneDNN, on CPUs with AVX512-BF16 or AMX): the 576 x 1536 projection takes 0.07 ms as `F.linear` and 0.03
  ms from a weight reordered once, at every row count from 1 to 16, and the 49,152-row LM head 2.4-4.0 ms against
  1.4-2.1 ms. One packed copy serves every row count, and its products equal `F.linear`'s bitwise (both run
  oneDNN's kernel; only the reorder moves).
- **float32**, whichever of two kernels is faster on the processor (measured once per process: `float32_kernel`, which
  gives the measurements): MKL's packed GEMM or oneDNN's reordered weights. Each serves every row count from one
  copy, from the fewest at which it is measured faster than `F.linear` (a plain step's single row, on some
  processors); MKL's up to 16 rows, past which its small-row kernel falls behind `F.linear` (a prefill). MKL packs the
  weight operand alike whatever row count it is told (the same size, and products equal bitwise to those from a copy
  packed for their own rows; `packed._checked` confirms it per shape), so a copy packed for 8 rows serves 2 to 16 at
  each count's own price: over SmolLM2's 30 layers 27 ms at 2 rows and 28-32 at 4 against 27.6 ms for one row with
  `F.linear`, where a copy serving 8 rows alone left 2 to 7 rows to `F.linear` (31 ms at 2 and 41-49 at 4) or to a
  pass padded to 8 (33-35 ms). The engine pads a pass to the cheapest measured chunk length (`costs.py`). The
  products agree with `F.linear` to float32 rounding, not bitwise, as a chunked forward already does with a
  one-position one (every bench output stayed identical to greedy).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger("early_exit_router")


@dataclass(frozen=True)
class PackedKernel:
    """One dtype's packed product: how a weight is packed for a row count, the product from it, and its promise."""

    name: str
    dtype: torch.dtype
    layer_rows: tuple[int, ...]  # the row counts a decoder layer's weights are packed for
    head_rows: tuple[int, ...]  # the row counts the LM head is packed for
    any_rows: bool  # one packed copy serves every row count (else only the count it was packed for)
    bitwise: bool  # the product equals F.linear bitwise (else to float rounding)
    pack: Callable[[torch.Tensor, int], torch.Tensor]
    # (x, packed, weight, bias, rows): `rows` is x's row count, the count the product multiplies
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor]
    min_rows: int = 1  # products over fewer rows take the module's own forward (F.linear)
    max_rows: int | None = None  # products over more rows (a prefill) take it too (None: no bound)
    # The product as (its library operator, that operator's arguments), for a compiled graph to call the operator
    # itself (`graph_products.py`); arguments as `product` takes them. None: graphs call `product`.
    call: Callable[[Any, Any, Any, Any, Any], tuple[Any, tuple]] | None = None
    static_rows: bool = False  # the operator takes the row count as an int: graphs of a symbolic width call `product`


def _onednn_product(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    # The overload itself, not the op packet: a plain step makes some 200 of these calls, and the packet's
    # dispatch costs each of them a few microseconds.
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def _onednn_call(x: Any, packed: Any, weight: Any, bias: Any, rows: Any) -> tuple[Any, tuple]:
    return torch.ops.mkldnn._linear_pointwise.default, (x, packed, bias, "none", [], "")


def _mkl_product(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    # The row count told is x's own, whatever the copy was packed for: the op falls back to F.linear where they differ.
    return torch.ops.mkl._mkl_linear.default(x, packed, weight, bias, rows)


def _mkl_call(x: Any, packed: Any, weight: Any, bias: Any, rows: Any) -> tuple[Any, tuple]:
    return torch.ops.mkl._mkl_linear.default, (x, packed, weight, bias, rows)


BFLOAT16 = PackedKernel(
    name="onednn",
    dtype=torch.bfloat16,
    layer_rows=(8,),  # the row count oneDNN packs for: measured as fast as a 1-row pack at 1 row and faster above
    head_rows=(8,),
    any_rows=True,
    bitwise=True,
    pack=lambda weight, rows: torch.ops.mkldnn._reorder_linear_weight(weight, rows),
    product=_onednn_product,
    call=_onednn_call,
)
FLOAT32 = PackedKernel(
    name="mkl",
    dtype=torch.float32,
    layer_rows=(8,),  # one copy serves 2 to 16 rows (the count it is packed for only names the copy)
    head_rows=(8,),  # the head gains most: 49,152 rows, 11.1 ms at 8 rows unpacked against 5.8
    any_rows=True,
    bitwise=False,
    pack=lambda weight, rows: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows),
    product=_mkl_product,
    call=_mkl_call,
    static_rows=True,  # `_mkl_linear`'s batch size is an int, not a symbol
    min_rows=2,  # `float32_kernel` sets it: from where it is measured faster than F.linear (`_fewest_rows`)
    max_rows=16,  # the head at 32 rows: 32 ms against F.linear's 18 (at 12: 15 against 27)
)
FLOAT32_ONEDNN = PackedKernel(
    name="onednn",
    dtype=torch.float32,
    layer_rows=(8,),  # one reordered copy serves every row count from min_rows up
    head_rows=(8,),
    any_rows=True,
    bitwise=False,
    pack=lambda weight, rows: torch.ops.mkldnn._reorder_linear_weight(weight, rows),
    product=_onednn_product,
    call=_onednn_call,
    min_rows=2,  # `float32_kernel` sets it: from where it is measured faster than F.linear (`_fewest_rows`)
)
FLOAT32_KERNELS = (FLOAT32, FLOAT32_ONEDNN)
PROBE_SHAPE, PROBE_COPIES, PROBE_ROWS = (4096, 1024), 4, 8  # 64 MiB of weights: streamed from memory, as in a pass
CHOICE_ROWS = (2, 4, 8)  # the row counts the kernels are compared at: a pass's, from an exit's draft to an n-gram's
PROBE_ROUNDS = 3  # alternating rounds per choice: a 2-core VM's load moves within one kernel's probe
FEWER_ROWS = (1, 2, 4)  # row counts below PROBE_ROWS an any-rows kernel serves only where it beats F.linear there


def packing_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why prepacked weights are not used on `device` in `dtype` (None: they are)."""
    if device.type != "cpu":
        return "not a CPU"
    if dtype == torch.float32:
        return None if _available(FLOAT32) or _available(FLOAT32_ONEDNN) else "this torch build has no packed GEMM"
    if dtype != torch.bfloat16:
        return f"{str(dtype).replace('torch.', '')} weights (packing pays for float32 and bfloat16)"
    if not _available(BFLOAT16):
        return "this torch build has no oneDNN linear"
    if not native_bfloat16(device):
        return "this CPU does not compute bfloat16 natively"
    return None


def native_bfloat16(device: torch.device) -> bool:
    """Whether `device` computes in bfloat16 natively (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type != "cpu":
        return False
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((native is not None and native()) or (amx is not None and amx()))


def kernel_for(dtype: torch.dtype | None) -> PackedKernel | None:
    """The packed product for weights of `dtype` (None: none)."""
    if dtype == torch.float32:
        return float32_kernel()
    return BFLOAT16 if dtype == torch.bfloat16 else None


def _available(kernel: PackedKernel) -> bool:
    """Whether this torch build has `kernel`'s operators (MKL's packed GEMM, or oneDNN's linear)."""
    if kernel.name == "mkl":  # also a copy with its measured row counts
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


_FLOAT32_CHOICE: list[PackedKernel | None] = []  # this process's measured choice, once made


def float32_kernel() -> PackedKernel | None:
    """The faster float32 kernel on this CPU, measured once per process over a pass's row counts (`CHOICE_ROWS`) on
    weights streamed from memory (`_faster`): MKL's packed GEMM or oneDNN's reordered weights (on a 2-core AMD EPYC
    host oneDNN ran the 49,152 x 576 LM head at 8 rows in 3.9 ms, MKL in 14.6, F.linear in 21.2; on an Intel Xeon
    host oneDNN's 2 rows took 1.2-2.0x F.linear's, MKL's about F.linear's). The chosen one serves fewer rows than
    PROBE_ROWS only from where it is faster than `F.linear` (`_fewest_rows`): on the AMD host one row too (the head
    3.7 ms against 10.0)."""
    if not _FLOAT32_CHOICE:
        usable = [k for k in FLOAT32_KERNELS if _available(k)]
        weights = _probe_weights() if usable else []  # one set for every probe: generating it costs as much as one
        packs = {k.name: [k.pack(w, PROBE_ROWS) for w in weights] for k in usable}
        chosen = _faster(usable, CHOICE_ROWS, weights, packs) if len(usable) > 1 else next(iter(usable), None)
        if chosen is not None and chosen.any_rows:
            chosen = dataclasses.replace(chosen, min_rows=_fewest_rows(chosen, weights, packs))
        _FLOAT32_CHOICE.append(chosen)
        if chosen is not None:
            rows = f"{chosen.min_rows}" + ("+" if chosen.max_rows is None else f"-{chosen.max_rows}")
            logger.info("early-exit-router: float32 products from %s weights over %s rows", chosen.name, rows)
    return _FLOAT32_CHOICE[0]


def _fewest_rows(kernel: PackedKernel, weights: list[torch.Tensor], packs: dict[str, list]) -> int:
    """The fewest rows `kernel` (one copy for every row count) serves: the smallest of FEWER_ROWS from which on it
    beats `F.linear` (a tie keeps F.linear, bitwise the model's own), else PROBE_ROWS, which it was chosen for."""
    fewest = PROBE_ROWS
    for rows in sorted(FEWER_ROWS, reverse=True):
        if _faster([None, kernel], (rows,), weights, packs) is not kernel:
            break
        fewest = rows
    return fewest


def _faster(
    kernels: Sequence[PackedKernel | None], rows: Sequence[int], weights: list[torch.Tensor], packs: dict[str, list]
) -> PackedKernel | None:
    """The kernel (None: `F.linear`) with the least median over PROBE_ROUNDS rounds of its probes' sum over `rows`;
    each round times every candidate: a burst of load on a shared machine then slows them alike instead of deciding
    the choice. `packs`: `weights` packed for each kernel, by its name (packed once: 25-30 ms a kernel on the Intel
    host)."""
    copies = [weights if k is None else packs[k.name] for k in kernels]
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(PROBE_ROUNDS):
        for measured, kernel, packed in zip(times, kernels, copies):
            measured.append(sum(_probe_ms(kernel, r, weights, packed) for r in rows))
    return kernels[min(range(len(kernels)), key=lambda i: statistics.median(times[i]))]


def _probe_weights() -> list[torch.Tensor]:
    """PROBE_COPIES weights of PROBE_SHAPE: together too large to stay cached, as a model's are in a pass."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*PROBE_SHAPE, generator=generator) for _ in range(PROBE_COPIES)]


def _probe_ms(
    kernel: PackedKernel | None, rows: int = PROBE_ROWS, weights: list | None = None, packs: list | None = None
) -> float:
    """Median ms of one product over `rows` rows with `kernel` (None: `F.linear`), cycling through `weights`
    (`_probe_weights` where not given) packed as `packs` (packed here where not given)."""
    weights = weights or _probe_weights()
    packs = packs or (weights if kernel is None else [kernel.pack(w, PROBE_ROWS) for w in weights])
    x = torch.randn(rows, PROBE_SHAPE[1], generator=torch.Generator().manual_seed(1))
    times = []
    for k in range(3 * PROBE_COPIES):
        weight, pack = weights[k % PROBE_COPIES], packs[k % PROBE_COPIES]
        start = time.perf_counter()
        F.linear(x, weight) if kernel is None else kernel.product(x, pack, weight, None, rows)
        times.append(time.perf_counter() - start)
    return statistics.median(times[PROBE_COPIES:]) * 1000  # the first round warms the kernel up


def rising_within(costs: list[float], rows: Sequence[int], span: tuple[int, float] | None) -> list[float]:
    """`costs` measured at `rows` (ascending), with the entries inside `span` (the row counts one packed copy serves,
    both ends included) fitted so that they never fall as rows rise: pooled adjacent violators, the least-squares
    such fit. One kernel does more work over more rows (MKL's copy at 2 / 3 / 4 / 8 rows over SmolLM2's layers: 27.0
    / 27.5 / 27.7 / 33.0 ms), so a longer chunk measured cheaper there is the machine's noise, and padding a pass
    to it would spend real compute (a table here ran passes over 8 positions as 16). Outside the span, where a
    library kernel's own choices can make more rows cheaper, the measurements stand."""
    inside = [i for i, r in enumerate(rows) if span is not None and span[0] <= r <= span[1]]
    pools: list[list[float]] = []  # [sum, count] of consecutive entries fitted to one value
    for i in inside:
        pools.append([costs[i], 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    fitted, entries = list(costs), iter(inside)
    for total, count in pools:
        for _ in range(int(count)):
            fitted[next(entries)] = total / count
    return fitted
