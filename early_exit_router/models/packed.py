"""Prepacked linear weights: faster matrix products at the few rows decoding multiplies, on CPUs.

On a CPU the library kernels behind `F.linear` lay the weight out for the product on every call, and at the rows
decoding multiplies (one position, or a verify pass of a few) that costs as much as the product. A weight laid out
once, ahead, runs faster (which product serves which dtype on which processor, and what each costs:
`models/kernels.py`).

So the stack keeps packed copies of the linear weights it runs (the decoder layers' and the LM head's: as much memory
again as those weights per packed row count) and, for the length of one of its own calls, points those `nn.Linear`
modules' `forward` at them (for the calling thread only); a `finally` puts every `forward` back. The model itself never
changes: its parameters, state_dict and plain HF `generate` are the base's. A weight changed in place (training,
`load_state_dict`) is noticed by its version counter and packed again; anything a packed kernel does not serve
(gradients, a non-contiguous input, another dtype, a row count not packed) takes the module's own `forward`. Each weight
shape is checked against `F.linear` once before it is used. Linears that read one input (the architecture spec's
`shared_input_linears`: a layer's query, key and value projections, its gate and up projections) are packed as one
stacked weight, so one product serves them (`_Group`); a stacked shape is checked the same way, each member's columns
against its own `F.linear`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from early_exit_router.models import kernels
from early_exit_router.models.kernels import PackedKernel

logger = logging.getLogger("early_exit_router")

CHECK_ROWS = (1, 2, 3, 5, 8, 16)  # row counts a copy serving every row count is checked at, per shape, before use
# Float32 weights smaller than this stay in cache between calls, where MKL's own small-row kernels are as fast.
MIN_ELEMENTS = {torch.float32: 1 << 17}


@dataclass
class _Packed:
    """One module's packed weights (by row count), the weight state they were packed from, and the forward."""

    module: nn.Linear
    kernel: PackedKernel
    packed: dict[int, torch.Tensor]  # row count -> the weight packed for it
    version: int
    data_ptr: int
    forward: Callable[[torch.Tensor], torch.Tensor] = field(repr=False)
    group: _Group | None = None  # the modules packed with it as one weight (None: packed alone)

    @property
    def rows(self) -> tuple[int, ...]:
        return tuple(self.packed)


@dataclass(eq=False)
class _Group:
    """Linears that read one input, packed as one weight (theirs stacked along the output rows): one product, whose
    columns are each module's, serves them all. At decoding's few rows a product costs about as much around the
    kernel as in it (oneDNN: some 40 us a call, 10 in the kernel), so SmolLM2's attention runs one product over
    960 output rows where it ran 576, 192 and 192 (a bf16 step 26.7 -> 23.1 ms in its layers' products here)."""

    members: tuple[nn.Linear, ...]
    bounds: tuple[tuple[int, int], ...]  # each member's output columns in the stacked product
    packed: dict[int, torch.Tensor]  # row count -> the stacked weight packed for it
    weight: torch.Tensor  # what the product takes as the weight: a stand-in of the stacked shape (it reads `packed`)
    bias: torch.Tensor | None  # the members' biases, stacked


class PackedLinears:
    """Packed copies of a set of `nn.Linear` weights and the scoped swap that uses them (`active`). `head` (if given)
    is packed for the kernel's head row counts, the others for its layer row counts. Each of `groups` (modules that
    read one input: a layer's query, key and value projections) is packed as one weight where its members allow it;
    a member called with another input than its group's latest product still gets its own columns, from a product of
    its own over the stacked weight."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        head: nn.Module | None = None,
        groups: Sequence[Sequence[nn.Module]] = (),
    ) -> None:
        self._entries: dict[int, _Packed] = {}
        # The latest stacked product, whose other members' columns the next calls with the same input take:
        # [group, input, input's version, output]; emptied when the scope ends.
        self._latest: list = [None, None, -1, None]
        # The thread inside `active` (None: none): another thread running the model meanwhile takes its own forward.
        self._owner: list[int | None] = [None]
        for group in groups:
            if any(id(m) in self._entries for m in group):  # a module joins one group only
                continue
            for entry in self._pack_group(group):
                self._entries[id(entry.module)] = entry
        for module in [*modules, *([head] if head is not None else [])]:
            if id(module) in self._entries:
                continue
            kernel = kernels.kernel_for(getattr(getattr(module, "weight", None), "dtype", None))
            if kernel is None:
                continue
            entry = self._pack(module, kernel.head_rows if module is head else kernel.layer_rows)
            if entry is not None:
                self._entries[id(module)] = entry
        self._count_rows()

    def __len__(self) -> int:
        return len(self._entries)

    def serves(self, rows: int) -> bool:
        """Whether some packed copy serves a product over `rows` rows (else the modules' own forward runs without the
        swap: in float32 a plain step's single row, unless `float32_kernel` measured its kernel faster there, and
        a prefill past MKL's 16 rows)."""
        return (self._any_from is not None and self._any_from <= rows <= self._any_to) or rows in self._rows

    def _count_rows(self) -> None:
        # The row counts copies packed for any row count serve (_any_from None: no such copy), the counts others serve.
        spans = [(e.kernel.min_rows, e.kernel.max_rows) for e in self._entries.values() if e.kernel.any_rows]
        self._any_from = min((low for low, _ in spans), default=None)
        self._any_to = max((float("inf") if high is None else high for _, high in spans), default=0)
        self._rows = {r for e in self._entries.values() if not e.kernel.any_rows for r in e.packed}

    @property
    def min_rows(self) -> int:
        """The fewest rows a packed copy serves (a plain step's single row runs the modules' own forward above 1)."""
        return min({*self._rows, *([] if self._any_from is None else [self._any_from])}, default=1)

    @property
    def max_rows(self) -> int | None:
        """The most rows a copy serving every row count serves (None: no bound, or no such copy)."""
        return self._any_to if self._any_from is not None and self._any_to != float("inf") else None

    @property
    def served_span(self) -> tuple[int, float] | None:
        """(fewest, most) rows a copy serving every row count serves (most: inf where unbounded; None: no such copy)."""
        return None if self._any_from is None else (self._any_from, self._any_to)

    def holds(self, module: nn.Module) -> bool:
        """Whether `module` has a packed copy."""
        return id(module) in self._entries

    @property
    def served_rows(self) -> str:
        """The row counts the copies serve, in words ("4-16 rows", "2+ rows", "8 and 16 rows")."""
        if self._any_from is not None:
            high = "+" if self.max_rows is None else f"-{self.max_rows}"
            return f"{self._any_from}{high} rows" if self._any_from != self.max_rows else f"{self._any_from} rows"
        return " and ".join(str(r) for r in sorted(self._rows)) + " rows"

    @property
    def kernels(self) -> list[str]:
        """The packed kernels in use, by name (a measured cost depends on them)."""
        return sorted({e.kernel.name for e in self._entries.values()})

    @property
    def groups(self) -> int:
        """How many groups of linears run as one product."""
        return len({id(e.group) for e in self._entries.values() if e.group is not None})

    @property
    def nbytes(self) -> int:
        """Memory held by the packed copies (one weight's size per packed row count)."""
        return sum(e.module.weight.nbytes * len(e.packed) for e in self._entries.values())  # a group's sum to its size

    def _pack(self, module: nn.Module, rows: tuple[int, ...]) -> _Packed | None:
        """A packed entry for `module`, or None where it cannot be served (its own forward is then used)."""
        kernel = self._kernel_for_module(module)
        if kernel is None:
            return None
        weight = module.weight
        out_features, in_features = weight.shape
        if weight.numel() < MIN_ELEMENTS.get(kernel.dtype, 0):
            return None
        if not _checked([out_features], in_features, module.bias is not None, kernel, rows):
            return None
        packed = {r: kernel.pack(weight.detach(), r) for r in rows}
        forward = _packed_forward(module, kernel, packed, self._owner)
        return _Packed(module, kernel, packed, weight._version, weight.data_ptr(), forward)

    def _kernel_for_module(self, module: nn.Module) -> PackedKernel | None:
        """The packed kernel that could serve `module`: a plain `nn.Linear` weight on the CPU in a packed dtype, whose
        `forward` no other wrapper owns (None: none could)."""
        weight = getattr(module, "weight", None)
        kernel = kernels.kernel_for(getattr(weight, "dtype", None))
        if kernel is None or not isinstance(module, nn.Linear) or type(weight) is not nn.Parameter:
            return None
        if weight.device.type != "cpu" or self._wrapped_by_another(module):
            return None
        return kernel

    def _wrapped_by_another(self, module: nn.Module) -> bool:
        """Whether a `forward` other than this stack's own swapped one is set on `module` (another wrapper's)."""
        forward, entry = module.__dict__.get("forward"), self._entries.get(id(module))
        return forward is not None and (entry is None or forward is not entry.forward)

    def _pack_group(self, modules: Sequence[nn.Module]) -> list[_Packed]:
        """Entries for `modules` packed as one weight, or none where they cannot be (each is then packed alone)."""
        members = tuple(modules)
        if len(members) < 2 or len({id(m) for m in members}) < len(members):
            return []
        found = {self._kernel_for_module(m) for m in members}
        kernel = found.pop() if len(found) == 1 else None
        if kernel is None:
            return []
        weights = [m.weight for m in members]
        if len({w.shape[1] for w in weights}) > 1 or len({m.bias is None for m in members}) > 1:
            return []
        rows = kernel.layer_rows
        if sum(w.numel() for w in weights) < MIN_ELEMENTS.get(kernel.dtype, 0):
            return []
        if not _checked([w.shape[0] for w in weights], weights[0].shape[1], members[0].bias is not None, kernel, rows):
            return []
        stacked = torch.cat([w.detach() for w in weights])  # (sum of out_features, in_features)
        bias = torch.cat([m.bias.detach() for m in members]) if members[0].bias is not None else None
        ends = list(itertools.accumulate(w.shape[0] for w in weights))
        bounds = tuple(zip([0, *ends[:-1]], ends))
        group = _Group(members, bounds, {r: kernel.pack(stacked, r) for r in rows}, _stand_in(stacked), bias)
        entries = []
        for m, w in zip(members, weights):
            forward = _packed_forward(m, kernel, group.packed, self._owner, group, self._latest)
            entries.append(_Packed(m, kernel, group.packed, w._version, w.data_ptr(), forward, group))
        return entries

    @contextmanager
    def active(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """Within the block, `modules` that have a packed copy run from it; every `forward` is put back after."""
        swapped: list[nn.Module] = []
        outer, self._owner[0] = self._owner[0], threading.get_ident()
        try:
            for module in modules:
                entry = self._current(module)
                if entry is None:
                    continue
                module.__dict__["forward"] = entry.forward  # an instance attribute shadows the class's forward
                swapped.append(module)
            yield
        finally:
            for module in swapped:
                module.__dict__.pop("forward", None)
            self._latest[:] = [None, None, -1, None]
            self._owner[0] = outer

    def graph_copies(self, modules: Iterable[nn.Module], rows: int) -> Iterator[tuple]:
        """For each of `modules` a packed copy serves at `rows` rows (packed again where its weight changed):
        (module, the kernel it was packed for, copy, weight, bias, its columns of a stacked product or None): what a
        compiled graph's product takes (`graph_products.py`)."""
        for module in modules:
            entry = self._current(module)
            if entry is None or not entry.kernel.min_rows <= rows <= (entry.kernel.max_rows or rows):
                continue
            copy = next(iter(entry.packed.values())) if entry.kernel.any_rows else entry.packed.get(rows)
            if copy is None:
                continue
            group = entry.group
            if group is None:
                yield module, entry.kernel, copy, module.weight, module.bias, None
            else:
                columns = group.bounds[group.members.index(module)]
                yield module, entry.kernel, copy, group.weight, group.bias, columns

    def _current(self, module: nn.Module) -> _Packed | None:
        """`module`'s entry, packed again where its weight changed in place or moved since (None: no copy, or
        another wrapper's `forward` is set on it)."""
        entry = self._entries.get(id(module))
        if entry is None or "forward" in module.__dict__:
            return None
        weight = module._parameters.get("weight")  # module.weight, without nn.Module's attribute lookup
        if weight is None or weight._version != entry.version or weight.data_ptr() != entry.data_ptr:
            return self._repack(module, entry.rows)
        return entry

    def _repack(self, module: nn.Module, rows: tuple[int, ...]) -> _Packed | None:
        """The weight changed in place or moved since it was packed: pack it again (or stop packing it), with the
        rest of its group where it has one."""
        old = self._entries.get(id(module))
        members = old.group.members if old is not None and old.group is not None else (module,)
        grouped = {id(e.module): e for e in self._pack_group(members)}
        for member in members:
            entry = grouped.get(id(member)) or self._pack(member, rows)
            if entry is None:
                self._entries.pop(id(member), None)
            else:
                self._entries[id(member)] = entry
        self._count_rows()
        return self._entries.get(id(module))


_CHECKED: dict[tuple, bool] = {}  # (kernel, dtype, out_features, in_features, bias, rows) -> check passed


def _checked(
    out_features: Sequence[int], in_features: int, bias: bool, kernel: PackedKernel, rows: tuple[int, ...]
) -> bool:
    """Whether the packed product equals `F.linear` for weights of these shapes (several: stacked as one weight, each
    one's columns against its own `F.linear`), bitwise or to float rounding as the kernel promises (checked once per
    shapes and row counts, in this process)."""
    shape = (kernel.name, kernel.dtype, kernel.min_rows, kernel.max_rows, tuple(out_features), in_features, bias, rows)
    if shape not in _CHECKED:
        generator = torch.Generator().manual_seed(0)
        weights = [(torch.randn(o, in_features, generator=generator) * 0.05).to(kernel.dtype) for o in out_features]
        biases = [torch.randn(o, generator=generator).to(kernel.dtype) if bias else None for o in out_features]
        stacked = torch.cat(weights)
        weight = weights[0] if len(weights) == 1 else _stand_in(stacked)
        stacked_bias = torch.cat(biases) if bias and len(biases) > 1 else biases[0]
        exact = True
        served = [r for r in CHECK_ROWS if kernel.min_rows <= r <= (kernel.max_rows or r)]
        for packed_rows in rows:
            packed = kernel.pack(stacked, packed_rows)
            for count in served if kernel.any_rows else (packed_rows,):
                x = torch.randn(1, count, in_features, generator=generator).to(kernel.dtype)
                got = kernel.product(x, packed, weight, stacked_bias, count).split(list(out_features), -1)
                for columns, w, b in zip(got, weights, biases):
                    want = F.linear(x, w, b)
                    same = torch.equal(columns, want) if kernel.bitwise else torch.allclose(columns, want, 1e-4, 1e-4)
                    exact = exact and same
        if not exact:
            logger.info("early-exit-router: packed %s weights differ from F.linear; not packing them", shape)
        _CHECKED[shape] = exact
    return _CHECKED[shape]


def _stand_in(stacked: torch.Tensor) -> torch.Tensor:
    """What a stacked weight's product takes as the weight: its shape, no memory (the kernel reads the packed copy;
    `_checked` confirms that it does)."""
    return stacked.new_zeros(1, 1).expand(stacked.shape)


def _packed_forward(
    module: nn.Linear,
    kernel: PackedKernel,
    packed: dict[int, torch.Tensor],
    owner: list[int | None],
    group: _Group | None = None,
    latest: list | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module`'s forward from `packed`; in a `group`, its columns of the stacked product, which the group's first
    call with an input computes and keeps in `latest` for the others. Only the thread in `owner` uses it: another
    one running the model meanwhile takes the module's own forward."""
    original = type(module).forward
    any_rows = next(iter(packed.values())) if kernel.any_rows else None  # the one copy serving every row count
    # Looked up once: this runs for every linear of every step, where attribute lookups on the module and the
    # kernel cost as much as the checks. `_parameters` is what `module.weight` reads, without nn.Module's lookup.
    parameters, product, dtype, min_rows, max_rows, grad_enabled, thread = (
        module._parameters,
        kernel.product,
        kernel.dtype,
        kernel.min_rows,
        kernel.max_rows or float("inf"),
        torch.is_grad_enabled,
        threading.get_ident,
    )
    start, stop = group.bounds[group.members.index(module)] if group is not None else (0, 0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if grad_enabled() or x.dtype != dtype or not x.is_contiguous() or x.device.type != "cpu":
            return original(module, x)
        if owner[0] != thread():  # another thread than the one inside `active`
            return original(module, x)
        rows = x.numel() // x.shape[-1]
        if rows < min_rows or rows > max_rows:
            return original(module, x)
        copy = any_rows if any_rows is not None else packed.get(rows)
        if copy is None:
            return original(module, x)
        if group is None:
            return product(x, copy, parameters["weight"], parameters["bias"], rows)
        version = -1 if x.is_inference() else x._version  # an inference tensor keeps no version counter
        if latest[0] is not group or latest[1] is not x or latest[2] != version:
            latest[:] = [group, x, version, product(x, copy, group.weight, group.bias, rows)]
        return latest[3][..., start:stop]  # a view: callers split its last axis or multiply it (copies: 3% a pass)

    return forward
