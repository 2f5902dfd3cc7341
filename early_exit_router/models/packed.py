"""Prepacked linear weights: the same products, bitwise, in about half the time, where the CPU computes bf16 natively.

On a CPU a bf16 matrix product goes through oneDNN, which reorders the weight into its blocked layout on every call.
At the few rows decoding multiplies (one position, or a verify pass of a few) that reorder costs as much as the
product itself: measured on a 2-core AVX512-BF16/AMX CPU, the 576 x 1536 projection takes 0.07 ms as `F.linear` and
0.03 ms from a weight reordered once, at every row count from 1 to 16, and the 49,152-row LM head 2.4-4.0 ms against
1.4-2.1 ms. The outputs are bitwise the same (both run oneDNN's kernel; only the reorder moves).

So the stack keeps one reordered copy of each linear weight it runs (the decoder layers' and the LM head's: as much
memory again as those weights) and, for the length of one of its own calls, points those `nn.Linear` modules'
`forward` at it; a `finally` puts every `forward` back. The model itself never changes: its parameters, state_dict and
plain HF `generate` are the base's. A weight changed in place (training, `load_state_dict`) is noticed by its version
counter and packed again; anything the packed kernel does not serve exactly (gradients, a non-contiguous input,
another dtype) takes the module's own `forward`.

Used where it is measured to pay and checked to be exact: bf16 weights on a CPU with AVX512-BF16 or AMX (float32
products run MKL, which a reorder does not speed up at these shapes; float16 measured no faster), each weight shape
compared bitwise with `F.linear` once before it is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("early_exit_router")

PACK_HINT_ROWS = 8  # the row count oneDNN packs for; measured as fast as a 1-row pack at 1 row and faster above
CHECK_ROWS = (1, 3, 8)  # row counts each weight shape is checked at before it is used


def packing_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why prepacked weights are not used on `device` in `dtype` (None: they are)."""
    if device.type != "cpu":
        return "not a CPU"
    if dtype != torch.bfloat16:
        return f"{str(dtype).replace('torch.', '')} weights (packing pays for bfloat16)"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN linear"
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if not ((native is not None and native()) or (amx is not None and amx())):
        return "this CPU does not compute bfloat16 natively"
    return None


@dataclass
class _Packed:
    """One module's packed weight, the weight state it was packed from, and the forward that uses it."""

    module: nn.Linear
    packed: torch.Tensor
    version: int
    data_ptr: int
    forward: Callable[[torch.Tensor], torch.Tensor]


class PackedLinears:
    """Packed copies of a set of `nn.Linear` weights and the scoped swap that uses them (`active`)."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._entries: dict[int, _Packed] = {}
        self._exact: dict[tuple[int, int, bool], bool] = {}  # (out, in, bias) -> checked bitwise against F.linear
        for module in modules:
            entry = self._pack(module)
            if entry is not None:
                self._entries[id(module)] = entry

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory held by the packed copies."""
        return sum(e.module.weight.numel() * e.module.weight.element_size() for e in self._entries.values())

    def _pack(self, module: nn.Module) -> _Packed | None:
        """A packed entry for `module`, or None where it cannot be served exactly (its own forward is then used)."""
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or type(weight) is not nn.Parameter or weight.dtype != torch.bfloat16:
            return None
        if "forward" in module.__dict__ or weight.device.type != "cpu":  # another wrapper owns this forward
            return None
        if not self._checked(module):
            return None
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)
        return _Packed(module, packed, weight._version, weight.data_ptr(), _packed_forward(module, packed))

    def _checked(self, module: nn.Linear) -> bool:
        """Whether the packed product equals `F.linear` bitwise for this weight shape (checked once per shape)."""
        out_features, in_features = module.weight.shape
        shape = (out_features, in_features, module.bias is not None)
        if shape not in self._exact:
            generator = torch.Generator().manual_seed(0)
            weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16) * 0.05
            bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if shape[2] else None
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
            exact = True
            for rows in CHECK_ROWS:
                x = torch.randn(1, rows, in_features, generator=generator).to(torch.bfloat16)
                got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                exact = exact and torch.equal(got, F.linear(x, weight, bias))
            if not exact:
                logger.info("early-exit-router: packed %s weights differ from F.linear; not packing them", shape)
            self._exact[shape] = exact
        return self._exact[shape]

    @contextmanager
    def active(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """Within the block, `modules` that have a packed copy run from it; every `forward` is put back after."""
        swapped: list[nn.Module] = []
        try:
            for module in modules:
                entry = self._entries.get(id(module))
                if entry is None or "forward" in module.__dict__:
                    continue
                weight = module.weight
                if weight._version != entry.version or weight.data_ptr() != entry.data_ptr:
                    entry = self._repack(module)
                    if entry is None:
                        continue
                module.__dict__["forward"] = entry.forward  # an instance attribute shadows the class's forward
                swapped.append(module)
            yield
        finally:
            for module in swapped:
                module.__dict__.pop("forward", None)

    def _repack(self, module: nn.Module) -> _Packed | None:
        """The weight changed in place or moved since it was packed: pack it again (or stop packing it)."""
        entry = self._pack(module)
        if entry is None:
            self._entries.pop(id(module), None)
        else:
            self._entries[id(module)] = entry
        return entry


def _packed_forward(module: nn.Linear, packed: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    original = type(module).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.bfloat16 or not x.is_contiguous() or x.device.type != "cpu":
            return original(module, x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")

    return forward
