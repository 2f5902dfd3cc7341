"""Prepacked weights (`models/packed.py`): the same numbers as the model's own products (bitwise in bf16, to float32
rounding in float32), a model left untouched, and a weight changed in place packed again. bf16 weights are packed on
CPUs that compute bf16 natively (elsewhere these tests check that nothing is packed); float32 weights large enough
to gain (the tests lower that bound to pack a tiny model's)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from early_exit_router import EarlyExitRouter
from early_exit_router.models import kernels as kernels_module
from early_exit_router.models import packed as packed_module
from early_exit_router.models.kernels import packing_supported
from early_exit_router.models.packed import PackedLinears

from .conftest import assert_cache_matches_full_forward, tiny_llama, tiny_tokenizer

SUPPORTED = packing_supported(torch.device("cpu"), torch.bfloat16) is None
needs_packing = pytest.mark.skipif(not SUPPORTED, reason="this CPU does not compute bfloat16 natively")


def bf16_router(**kwargs) -> EarlyExitRouter:
    model = tiny_llama(0, dtype=torch.bfloat16)
    return EarlyExitRouter.from_model(model, tiny_tokenizer(), exit_layers=[1, 3], **kwargs)


def test_packing_is_used_for_bfloat16_on_a_cpu_that_computes_it_and_for_large_float32_weights():
    assert packing_supported(torch.device("meta"), torch.bfloat16) == "not a CPU"
    assert packing_supported(torch.device("cpu"), torch.float16) is not None
    fp32 = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer(), exit_layers=[1, 3])
    assert fp32.stack.packed_weights is None  # a tiny model's weights stay in cache: nothing to gain
    assert fp32.stack.use_packed_weights() == "no weight large enough for packing to pay"
    assert (bf16_router().stack.packed_weights is not None) == SUPPORTED
    assert bf16_router(pack_weights=False).stack.packed_weights is None


@needs_packing
def test_packed_passes_give_the_models_numbers_bitwise_and_leave_no_trace_on_it():
    router = bf16_router()
    stack, model = router.stack, router.model
    packed = stack.packed_weights
    assert len(packed) == sum(isinstance(m, nn.Linear) for m in model.modules())  # every layer's and the head
    assert packed.groups == 2 * stack.num_layers  # query, key and value; gate and up: one product each
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[3, 17, 5, 9, 40, 41, 42, 3, 17]])
    with torch.no_grad():
        hidden = stack.embed(ids)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        got = stack.logits(stack.run(hidden, 0, stack.num_layers, stack.new_cache(), positions))
        stack.use_packed_weights(False)
        want = stack.logits(stack.run(hidden, 0, stack.num_layers, stack.new_cache(), positions))
        stack.use_packed_weights(True)
    assert torch.equal(got, want)
    assert not any("forward" in m.__dict__ for m in model.modules())  # every swapped forward put back
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for mode in ("verify", "exit"):
        outputs = []
        for on in (True, False):
            stack.use_packed_weights(on)
            outputs.append(router.generate(ids, 12, mode=mode).sequences)
        assert torch.equal(*outputs), mode


@needs_packing
def test_a_weight_changed_in_place_is_packed_again_and_gradients_take_the_modules_own_product():
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    packed = PackedLinears([linear])
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    with torch.no_grad(), packed.active([linear]):
        before = linear(x)
        assert torch.equal(before, nn.functional.linear(x, linear.weight, linear.bias))
    with torch.no_grad():
        linear.weight.mul_(2)  # in place: the version counter moves
        with packed.active([linear]):
            after = linear(x)
    assert torch.equal(after, nn.functional.linear(x, linear.weight, linear.bias)) and not torch.equal(after, before)
    with packed.active([linear]):
        y = linear(x)  # gradients enabled: the module's own forward
    assert y.requires_grad
    assert "forward" not in linear.__dict__


@needs_packing
def test_a_model_cast_to_float32_stops_packing_and_unpatch_frees_the_copies():
    router = bf16_router()
    router.model.to(torch.float32)
    assert router.stack.packed_weights is None  # packing pays for bf16 only
    router.model.to(torch.bfloat16)
    assert router.stack.packed_weights is not None  # packed again for the model's new dtype
    router.unpatch()
    assert router.stack.packed_weights is None


FLOAT32_VARIANTS = {
    "mkl": kernels_module.FLOAT32,
    "onednn": kernels_module.FLOAT32_ONEDNN,
    "onednn from one row": dataclasses.replace(kernels_module.FLOAT32_ONEDNN, min_rows=1),  # where measured faster
}


@pytest.fixture(params=list(FLOAT32_VARIANTS))
def fp32_kernel(monkeypatch, request):
    """Each float32 kernel in turn, packing even tiny weights (the size bound lowered), and a list that counts its
    packed products (the row count each was packed for)."""
    kernel = FLOAT32_VARIANTS[request.param]
    if not kernels_module._available(kernel):
        pytest.skip(f"this torch build has no {kernel.name} packed product")
    monkeypatch.setitem(packed_module.MIN_ELEMENTS, torch.float32, 0)
    calls = []

    def counted(x, packed, weight, bias, rows):
        calls.append(rows)
        return kernel.product(x, packed, weight, bias, rows)

    monkeypatch.setattr(kernels_module, "float32_kernel", lambda: dataclasses.replace(kernel, product=counted))
    return calls


@pytest.fixture
def fp32_packed(fp32_kernel):
    """A float32 router whose tiny weights are packed with each float32 kernel in turn, and the count of products."""
    router = EarlyExitRouter.from_model(tiny_llama(0), tiny_tokenizer(), exit_layers=[1, 3])
    fp32_kernel.clear()  # the shape checks' own products
    return router, fp32_kernel


def test_float32_packs_serve_their_row_counts_to_float_rounding_and_others_take_the_modules_product(fp32_packed):
    router, calls = fp32_packed
    stack, model = router.stack, router.model
    packed = stack.packed_weights
    kernel = kernels_module.float32_kernel()
    assert len(packed) == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert packed.groups == 2 * stack.num_layers
    layers = sum(m.weight.nbytes for m in stack.layers.modules() if isinstance(m, nn.Linear))
    assert packed.nbytes == layers * len(kernel.layer_rows) + stack.lm_head.weight.nbytes * len(kernel.head_rows)
    assert packed.serves(1) == (kernel.any_rows and kernel.min_rows == 1)  # else plain steps stay bitwise HF
    spans = {("mkl", 2): "2-16 rows", ("onednn", 2): "2+ rows", ("onednn", 1): "1+ rows"}
    assert packed.served_rows == spans[kernel.name, kernel.min_rows]  # as the model's description says it
    assert f"products over {packed.served_rows}" in router.heads.describe("m", stack, router.config, 0.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for rows in (1, 5, 8, 16, 20):
        ids = torch.arange(3, 3 + rows).unsqueeze(0)
        with torch.no_grad():
            hidden = stack.embed(ids)
            positions = torch.arange(rows).unsqueeze(0)
            calls.clear()
            got = stack.logits(stack.run(hidden, 0, stack.num_layers, stack.new_cache(), positions))
            served = packed.serves(rows)
            assert bool(calls) == served, rows
            assert set(calls) <= {rows}  # each product is told the rows it multiplies, not the count packed for
            # one copy serves its kernel's span of row counts (MKL's: 2 to 16; a prefill past it takes F.linear)
            assert served == (kernel.min_rows <= rows <= (kernel.max_rows or rows))
            stack.use_packed_weights(False)
            want = stack.logits(stack.run(hidden, 0, stack.num_layers, stack.new_cache(), positions))
            stack.use_packed_weights(True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if not served:
            assert torch.equal(got, want)
    assert kernel.any_rows == packed.serves(5)  # oneDNN: one copy for every row count from its fewest up
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_the_float32_kernel_is_the_faster_one_measured_once_per_process(monkeypatch):
    probed = []
    speeds = {("mkl", r): 2.0 for r in (1, 2, 4, 8)} | {("onednn", r): 1.0 for r in (2, 4, 8)}
    speeds |= {("onednn", 1): 3.0} | {("F.linear", r): 2.0 for r in (1, 2, 4)}
    rounds = kernels_module.PROBE_ROUNDS
    compared = [(name, r) for name in ("mkl", "onednn") for r in kernels_module.CHOICE_ROWS]

    def probe(kernel, rows=8, weights=None, packs=None):
        probed.append((kernel.name if kernel else "F.linear", rows))
        return speeds[probed[-1]]

    def choose(available=lambda kernel: True):
        monkeypatch.setattr(kernels_module, "_available", available)
        monkeypatch.setattr(kernels_module, "_FLOAT32_CHOICE", [])
        probed.clear()
        return kernels_module.float32_kernel()

    monkeypatch.setattr(kernels_module, "_probe_ms", probe)
    monkeypatch.setattr(kernels_module, "_probe_weights", lambda: [])  # nothing to pack: the probe is stubbed
    # slower than F.linear at one row: a plain step keeps F.linear, 2 rows and more take oneDNN
    assert choose() == dataclasses.replace(kernels_module.FLOAT32_ONEDNN, min_rows=2)
    assert probed[: 6 * rounds] == compared * rounds  # both kernels at a pass's row counts, round after round
    assert kernels_module.kernel_for(torch.float32).min_rows == 2 and len(probed) == 12 * rounds
    speeds[("onednn", 1)] = 1.0
    assert choose().min_rows == 1  # faster: it serves one row
    speeds[("onednn", 1)] = 2.0
    assert choose().min_rows == 2  # a tie keeps F.linear: plain steps stay bitwise the model's own
    speeds[("onednn", 2)] = 3.0  # slower than F.linear at 2 rows: passes over 2-3 keep F.linear
    assert choose().min_rows == 4 and ("onednn", 1) not in probed  # one row is not probed past a loss above it
    speeds[("onednn", 4)] = 2.5
    assert choose().min_rows == 8  # a pass's row count, which it was chosen for, whatever F.linear does below
    # faster at 8 rows alone, slower over a pass's row counts (as oneDNN's 2 rows on an Intel Xeon host): MKL
    speeds |= {("mkl", 2): 1.0, ("mkl", 4): 1.0, ("mkl", 8): 1.2, ("onednn", 2): 3.0, ("onednn", 4): 1.0}
    assert choose() == dataclasses.replace(kernels_module.FLOAT32, min_rows=2)  # one copy from 2 rows to 16
    speeds[("onednn", 1)] = speeds[("onednn", 2)] = speeds[("onednn", 4)] = 1.0
    assert choose(lambda kernel: kernel.name == "onednn").min_rows == 1 and ("onednn", 8) not in probed  # one kernel


def test_a_burst_of_load_in_one_probe_round_does_not_decide_the_float32_kernel(monkeypatch):
    # mkl is the faster kernel, but the machine is busy during its first probe: the median over rounds that each
    # time both kernels still finds it.
    times = {"mkl": [9.0, 1.0, 1.0], "onednn": [2.0, 2.0, 2.0]}
    monkeypatch.setattr(kernels_module, "PROBE_ROUNDS", 3)
    monkeypatch.setattr(kernels_module, "_probe_ms", lambda kernel, rows, weights, packs: times[kernel.name].pop(0))
    kernels = [kernels_module.FLOAT32, kernels_module.FLOAT32_ONEDNN]
    assert kernels_module._faster(kernels, (8,), [], {"mkl": [], "onednn": []}) is kernels_module.FLOAT32
    monkeypatch.undo()
    for kernel in [None, *kernels_module.FLOAT32_KERNELS]:  # the real probe times a product from streamed weights
        if kernel is None or kernels_module._available(kernel):
            assert kernels_module._probe_ms(kernel) > 0 and kernels_module._probe_ms(kernel, 1) > 0


def test_float32_packed_verify_passes_keep_greedy_output_and_the_cache_exact(fp32_packed):
    router, calls = fp32_packed
    ids = torch.tensor([[3, 17, 5, 9, 40, 41, 42, 3, 17, 5, 9, 40]])
    with torch.no_grad():
        want = router.model.generate(ids, max_new_tokens=24, do_sample=False)
    out = router.generate(ids, 24, mode="verify", config={"max_pending": 7, "policy": "fixed"})
    assert 8 in calls  # passes of 8 positions ran from the packed weights
    assert torch.equal(out.sequences, want)
    assert_cache_matches_full_forward(router.model, out.sequences, out.cache, atol=1e-5)


def test_a_deep_copy_of_a_packed_model_packs_its_own_copied_weights(fp32_packed):
    """Packed weights are opaque tensors that cannot be copied: a copy of the model (the router with it) packs the
    copy's own weights again."""
    import copy

    router, calls = fp32_packed
    twin = copy.deepcopy(router.model)
    packed = twin._early_exit_router.stack.packed_weights
    assert packed is not None and len(packed) == len(router.stack.packed_weights)
    assert {id(e.module) for e in packed._entries.values()} <= {id(m) for m in twin.modules()}
    ids = torch.tensor([[3, 17, 5, 9, 40, 41, 42, 3, 17, 5, 9, 40]])
    config = {"max_pending": 7, "policy": "fixed"}
    calls.clear()
    out = twin._early_exit_router.generate(ids, 24, mode="verify", config=config)
    assert 8 in calls and torch.equal(out.sequences, router.generate(ids, 24, mode="verify", config=config).sequences)


@pytest.mark.parametrize("kind", ["block", "residual_block"])
def test_a_block_adapters_layer_runs_from_packed_copies_of_its_own_weights(fp32_kernel, kind):
    model, ids = tiny_llama(0), torch.tensor([[3, 17, 5, 9, 40, 41, 42, 3, 17, 5, 9, 40]])
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=20, do_sample=False)
    router = EarlyExitRouter.from_model(model, tiny_tokenizer(), exit_layers=[1, 3], adapter=kind)
    adapter, stack = router.heads.adapter(1), router.stack
    if adapter.mix is not None:
        with torch.no_grad():
            adapter.mix.add_(0.5)  # the scaling hooks must act on the packed products too
    states = torch.randn(1, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32_kernel.clear()
        got = adapter(states, stack)
        assert fp32_kernel  # the block's own linears, packed at its first run
        stack.use_packed_weights(False)
        want = adapter(states, stack)
        stack.use_packed_weights(True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert not any("forward" in m.__dict__ for m in router.heads.modules())
    out = router.generate(ids, 20, mode="verify", config={"max_pending": 7, "policy": "fixed"})
    assert torch.equal(out.sequences, greedy)
    assert_cache_matches_full_forward(model, out.sequences, out.cache, atol=1e-5)
    blocks = {id(router.heads.adapter(e).block) for e in (1, 3)}
    assert {id(layer) for layer in stack._module_packs} == blocks  # one copy per block run, none once it is gone
    stack._module_packs.clear()
    router.warm_up()  # a fresh router's first call packs nothing
    assert {id(layer) for layer in stack._module_packs} == blocks
    router.heads.adapters["1"] = router.heads.adapters["3"] = nn.Identity()
    del adapter
    gc.collect()
    assert len(stack._module_packs) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linears_that_read_one_input_run_one_product_and_each_gets_its_own_numbers(monkeypatch, dtype):
    if dtype == torch.bfloat16 and not SUPPORTED:
        pytest.skip("this CPU does not compute bfloat16 natively")
    base = kernels_module.kernel_for(dtype)
    if base is None:
        pytest.skip("this torch build has no packed float32 product")
    monkeypatch.setitem(packed_module.MIN_ELEMENTS, torch.float32, 0)
    calls = []

    def counted(x, packed, weight, bias, rows):
        calls.append(tuple(weight.shape))
        return base.product(x, packed, weight, bias, rows)

    kernel = dataclasses.replace(base, product=counted, min_rows=1)
    monkeypatch.setattr(kernels_module, "kernel_for", lambda dt: kernel if dt == dtype else None)
    torch.manual_seed(0)
    q, k, v = (nn.Linear(64, n, bias=True).to(dtype) for n in (64, 32, 32))
    other = nn.Linear(48, 16).to(dtype)  # another input width: never grouped with them
    packed = PackedLinears([q, k, v, other], groups=[[q, k, v], [q, other], [k, v]])  # k, v: in a group already
    calls.clear()  # the shape checks' own products
    assert len({id(packed._entries[id(m)].group) for m in (q, k, v)}) == 1 and packed.groups == 1
    assert packed._entries[id(other)].group is None
    assert packed.nbytes == sum(m.weight.nbytes for m in (q, k, v, other)) * len(kernel.layer_rows)
    rows = 8 if kernel.any_rows else kernel.layer_rows[0]
    x, y = (torch.randn(1, rows, 64).to(dtype) for _ in range(2))

    def check(module, inputs):
        got = module(inputs)
        want = nn.functional.linear(inputs, module.weight, module.bias)
        assert got.shape == want.shape
        assert torch.equal(got, want) if kernel.bitwise else torch.allclose(got, want, atol=1e-5, rtol=0)
        return got

    with torch.no_grad():
        with packed.active([q, k, v, other]):
            # any order: the first call with an input computes the stacked product, whose columns each one views
            outputs = [check(module, x) for module in (k, q, v)]
            assert calls == [(128, 64)]
            assert len({out.untyped_storage().data_ptr() for out in outputs}) == 1  # views of it, not copies
            check(q, y)  # another input: a product of its own over the stacked weight
            check(k, x)  # the latest product was y's now
            assert len(calls) == 3
            x.add_(1)  # changed in place since its product: computed again
            check(v, x)
            assert len(calls) == 4 and packed._latest[1] is x
        assert packed._latest == [None, None, -1, None]  # nothing kept once the scope ends
        k.weight.mul_(2)  # in place: the group is packed again, with k's new numbers
        with packed.active([q, k, v]):
            for module in (q, k, v):
                check(module, x)
        assert packed._entries[id(k)].group is packed._entries[id(q)].group is not None
    assert not any("forward" in m.__dict__ for m in (q, k, v, other))
    mixed = nn.Linear(64, 8, bias=False).to(dtype)  # a member without a bias: packed alone
    assert PackedLinears([q, mixed], groups=[[q, mixed]])._entries[id(q)].group is None


def test_another_thread_running_the_model_during_a_packed_call_takes_the_modules_own_forward(fp32_kernel):
    """The swap is on the model's own modules: a thread that runs the model while the router's thread is inside
    `active` (plain use beside a decoding server) gets the model's exact products and never the packed state."""
    import threading

    generator = torch.Generator().manual_seed(0)
    linears = [nn.Linear(32, 48, bias=False) for _ in range(2)]  # one input: packed as one stacked weight
    packed = PackedLinears(linears, groups=[linears])
    x = torch.randn(1, 8, 32, generator=generator)  # 8 rows: every kernel serves them
    seen = {}

    def other_thread() -> None:
        with torch.no_grad():  # grad mode is per thread
            seen["out"] = [linear(x.clone()) for linear in linears]  # an input of its own

    with torch.no_grad(), packed.active(linears):
        ours = linears[0](x)
        assert fp32_kernel  # this thread's product is the packed one
        fp32_kernel.clear()
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert fp32_kernel == []  # the other thread ran no packed product
        torch.testing.assert_close(linears[1](x), F.linear(x, linears[1].weight), atol=1e-5, rtol=0)
    with torch.no_grad():
        assert all(torch.equal(out, F.linear(x, lin.weight)) for out, lin in zip(seen["out"], linears))
        torch.testing.assert_close(ours, F.linear(x, linears[0].weight), atol=1e-5, rtol=0)


def test_costs_inside_a_packed_copys_span_are_fitted_never_to_fall_as_rows_rise():
    rows = [1, 2, 3, 4, 8, 24]
    costs = [1.0, 5.0, 3.0, 4.0, 2.0, 9.0]
    # 5, 3 pool to 4; then 4 holds; then 2 pulls all four down to their mean: the least-squares rising fit
    assert kernels_module.rising_within(costs, rows, (2, 16)) == [1.0, 3.5, 3.5, 3.5, 3.5, 9.0]
    assert kernels_module.rising_within(costs, rows, (2, 3)) == [1.0, 4.0, 4.0, 4.0, 2.0, 9.0]  # outside: as measured
    assert kernels_module.rising_within(costs, rows, None) == costs  # no packed copy (a GPU, F.linear)
    assert kernels_module.rising_within([1.0, 2.0, 2.0, 3.0], [1, 2, 3, 4], (1, float("inf"))) == [1.0, 2.0, 2.0, 3.0]


def test_a_measured_table_never_pads_a_pass_inside_the_packed_copys_span(fp32_packed):
    """Noise can time a longer chunk cheaper than a shorter one through the same packed copy; the table must not
    send passes to it (a table on the Intel Xeon host ran passes over 8 positions as 16)."""
    from early_exit_router.routing import costs

    router, _ = fp32_packed
    stack = router.stack
    low, high = stack.packed_weights.served_span
    assert stack.packed_weights.holds(stack.lm_head)  # the tiny model's head is packed too
    chunks = (1, 2, 3, 4, 5, 8, 16, 24)
    table = costs.measure(stack, router.heads, 0, chunks=chunks, reps=1, rounds=1)
    inside = [m for m in chunks if low <= m <= high]
    for measured in (table.layer_ms, table.head_ms):
        fitted = [measured[chunks.index(m)] for m in inside]
        assert fitted == sorted(fitted)
    for m in inside:
        assert table.layer_pad(m) == m or table.layer_pad(m) not in inside
        assert table.head_pad(m) == m or table.head_pad(m) not in inside
