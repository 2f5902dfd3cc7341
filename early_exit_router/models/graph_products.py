"""The stack's prepacked weights (`packed.py`) as inputs of its compiled graphs.

Inductor lowers `F.linear` to a GEMM over a weight laid out for nothing, and its weight freezing (which packs weights
as graph constants) would need a graph per layer. Here, for the length of one compiled call, each packed linear holds
its packed copy as a buffer and a forward that calls the packed product as an opaque operator
(`early_exit_router::packed_linear`): dynamo lifts that buffer to a graph input as it lifts the weight, so one graph
still serves every layer of a shape and the model keeps one prepared copy of its weights. Measured, a float32
SmolLM2 pass over all 30 layers on a 2-core AMD host: eager from the packed copies 44.3 ms at one position and 63.6
at eight; compiled with inductor's own products 37.3 and (at two positions already) 60.2; compiled from the packed
copies 34.2 and 50.4.

A stacked group's members (a layer's query, key and value projections: `packed._Group`) each call the product of
the same input over the same stacked copy and take their own columns; the graph pass `SharedProducts` keeps one of
those calls, as the eager forward's `_latest` does.

Inductor calls an operator without a lowering of its own through Python (its dispatcher, then the operator's
Python body, then the library's operator), about 40 us a product; a pass makes four a layer. So the operator
carries the name of the kernel its copies were packed for, and its lowering (`_lower`) has the graph call that
kernel's library operator itself where the kernel names one (`PackedKernel.call`): measured, 24 products of
SmolLM2's shapes in one graph (2-core AMD host, oneDNN's copies) took 4.4 ms against 5.3 through Python at one
row and 5.7 against 6.6 at four.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from early_exit_router.models import kernels

logger = logging.getLogger("early_exit_router")

_OP = "early_exit_router::packed_linear"
_BUFFERS = ("_eer_packed", "_eer_weight", "_eer_bias")  # what a module holds while a compiled call runs
PYTHON = "python"  # the kernel name that has graphs call the operator's Python body (the process's `product`)


def _define() -> Any:
    """The packed product as an operator inductor calls as it is (None where this torch has no custom operators)."""
    if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
        return None

    @torch.library.custom_op(_OP, mutates_args=())
    def packed_linear(
        x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str
    ) -> torch.Tensor:
        x = x.contiguous()  # a graph may hand over a view; the kernels read rows in place
        # the kernel every copy of this dtype was packed with (`PackedLinears` asks the same function); `kernel`
        # only names it, which keeps graphs lowered for one kernel apart from another's in inductor's disk cache
        return kernels.kernel_for(x.dtype).product(x, packed, weight, bias, x.numel() // x.shape[-1])

    @packed_linear.register_fake
    def _(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: Any, kernel: str) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return packed_linear


packed_linear = _define()


def _graph_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A packed linear's forward while a compiled call holds its copy (an eager caller meanwhile, another thread
    running the model, gets the module's own forward)."""
    if not torch.compiler.is_compiling():
        return type(self).forward(self, x)
    buffers = self._buffers
    out = packed_linear(x, buffers["_eer_packed"], buffers["_eer_weight"], buffers["_eer_bias"], self._eer_kernel)
    columns = self._eer_columns
    return out if columns is None else out[..., columns[0] : columns[1]]


def _shared_products_pass() -> Any:
    """The graph pass that keeps one of several identical packed products (None where inductor takes no custom
    passes: each member then computes the stacked product, as slow as unpacked)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None

    class SharedProducts(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            target = torch.ops.early_exit_router.packed_linear.default
            first: dict[tuple, torch.fx.Node] = {}
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target is not target:
                    continue
                key = (node.args, tuple(sorted(node.kwargs.items())))
                if key in first:
                    node.replace_all_uses_with(first[key])
                    graph.erase_node(node)
                else:
                    first[key] = node

        def uuid(self) -> str:  # inductor's on-disk cache keys graphs by the passes that ran on them
            return "early-exit-router-shared-products-2"  # 2: the kernel's name, its operator lowered

    return SharedProducts()


SHARED_PRODUCTS = _shared_products_pass()


_LOWERED: list[bool] = []  # whether `_lower` is registered with inductor (once per process)


def _lower() -> bool:
    """Register how inductor lowers `packed_linear`: a call of the kernel's library operator itself where the kernel
    names one and the graph's row count suits it, else the operator's Python body (False where this torch's inductor
    takes no lowering: graphs then call the Python body, as before)."""
    try:
        import sympy
        from torch._inductor import ir
        from torch._inductor.lowering import fallback_handler, register_lowering
    except ImportError:
        return False
    python_body = torch.ops.early_exit_router.packed_linear.default

    def lowering(x: Any, packed: Any, weight: Any, bias: Any, kernel: str) -> Any:
        chosen = kernels.kernel_for(x.get_dtype())
        size = x.get_size()
        rows = sympy.Mul(*size[:-1]) if len(size) > 1 else sympy.Integer(1)  # a width symbol keeps it a product
        direct = chosen is not None and chosen.name == kernel and chosen.call is not None
        if not direct or (chosen.static_rows and not rows.is_Integer):
            return fallback_handler(python_body, add_to_fallback_set=False)(x, packed, weight, bias, kernel)
        x = ir.ExternKernel.require_contiguous(x)  # the operators read rows in place
        operator, args = chosen.call(x, packed, weight, bias, int(rows) if rows.is_Integer else rows)
        return fallback_handler(operator, add_to_fallback_set=False)(*args)

    try:
        register_lowering(python_body, type_promotion_kind=None)(lowering)
    except Exception as error:  # noqa: BLE001 (inductor internals: the Python body is always there)
        logger.info("early-exit-router: packed products stay Python calls in graphs (%s)", error)
        return False
    return True


def compile_options() -> dict[str, Any]:
    """Inductor options the graphs that run packed products need (their lowering registered at the first ask)."""
    if not _LOWERED:
        _LOWERED.append(packed_linear is not None and _lower())
    return {} if SHARED_PRODUCTS is None else {"post_grad_custom_pre_pass": SHARED_PRODUCTS}


def how() -> str:
    """How this process's graphs compute packed products: "operators" (the kernels' own, `_lower`) or PYTHON."""
    return "operators" if _LOWERED and _LOWERED[0] else PYTHON


def graph_kernel(kernel: kernels.PackedKernel) -> str:
    """The name a graph's product carries for copies `kernel` packed: the kernel's own where a graph can call its
    operator (`_lower`), else PYTHON."""
    return kernel.name if kernel.call is not None and how() != PYTHON else PYTHON


def available() -> bool:
    """Whether compiled graphs can run packed products on this torch."""
    return packed_linear is not None and SHARED_PRODUCTS is not None and hasattr(torch.compiler, "is_compiling")


@contextmanager
def products_from_packed(packed: Any, modules: Iterable[nn.Module], rows: int) -> Iterator[None]:
    """Within the block, compiled graphs over `modules` compute each product a packed copy serves at `rows` rows
    from that copy (`packed`: the stack's `PackedLinears`, or None); every module is put back after."""
    held: list[nn.Module] = []
    try:
        for module, kernel, copy, weight, bias, columns in packed.graph_copies(modules, rows) if packed else ():
            buffers = module._buffers
            buffers["_eer_packed"], buffers["_eer_weight"], buffers["_eer_bias"] = copy, weight, bias
            module.__dict__["_eer_columns"] = columns
            module.__dict__["_eer_kernel"] = graph_kernel(kernel)
            module._non_persistent_buffers_set.update(_BUFFERS)  # never in a state_dict
            module.__dict__["forward"] = _graph_forward.__get__(module)
            held.append(module)
        yield
    finally:
        for module in held:
            for name in _BUFFERS:
                module._buffers.pop(name, None)
            module._non_persistent_buffers_set.difference_update(_BUFFERS)
            for name in ("forward", "_eer_columns", "_eer_kernel"):
                module.__dict__.pop(name, None)
