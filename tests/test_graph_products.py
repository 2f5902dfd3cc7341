"""Compiled passes (a plain step's graph, one graph of 2 to 8 positions), their products from the stack's packed
copies (`graph_products.py`): the same states and cache as an eager pass, one product per stacked group, and the
model left exactly as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from early_exit_router.models import _compat, graph_products, kernels
from early_exit_router.models import packed as packed_module
from early_exit_router.models.compiled import MAX_WIDTH, SPAN, graph_shape

from .conftest import assert_cache_matches_full_forward, assert_same_model, model_fingerprint, tiny_llama
from .test_compiled import compiled_router
from .test_token_trees import repetitive_prompt

pytestmark = pytest.mark.skipif(not graph_products.available(), reason="this torch runs no packed products in graphs")


@pytest.fixture
def counted_products(monkeypatch):
    """The float32 kernel packing even tiny weights, and a list counting its products (the rows of each): graphs call
    them through the operator's Python body (`call=None`), as where a kernel names no operator of its own."""
    kernel = kernels.float32_kernel()
    if kernel is None:
        pytest.skip("this torch build has no float32 packed product")
    monkeypatch.setitem(packed_module.MIN_ELEMENTS, torch.float32, 0)
    calls = []

    def counted(x, packed, weight, bias, rows):
        calls.append(rows)
        return kernel.product(x, packed, weight, bias, rows)

    monkeypatch.setattr(
        kernels, "float32_kernel", lambda: dataclasses.replace(kernel, product=counted, min_rows=1, call=None)
    )
    return calls


def test_a_step_has_its_own_graph_and_every_chunk_of_2_to_8_positions_shares_one():
    assert [graph_shape(q) for q in range(1, 10)] == [1] + [SPAN] * 7 + [None]
    assert MAX_WIDTH == 8


def test_a_compiled_pass_takes_one_product_per_stacked_group_from_the_packed_copies(counted_products):
    model = tiny_llama(0)
    before = model_fingerprint(model)
    router = compiled_router(model)
    stack = router.stack
    assert stack.packed_weights is not None and stack.packed_weights.groups > 0
    context, q = 10, 3  # the graph of 2 to 8 positions, at its own width
    states = torch.randn(1, context + q, stack.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(context + q).unsqueeze(0)
    static, dynamic = stack.new_cache(context + q), stack.new_cache()
    with torch.inference_mode():
        for cache in (static, dynamic):
            stack._run(states[:, :context], 0, stack.num_layers, cache, positions[:, :context])
        want = stack._run(states[:, context:], 0, stack.num_layers, dynamic, positions[:, context:])
        counted_products.clear()
        got = stack.run(states[:, context:], 0, stack.num_layers, static, positions[:, context:])
        # query+key+value and gate+up are stacked: 4 products a layer, not 7, each over the chunk's own rows
        assert counted_products == [q] * (4 * stack.num_layers)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        assert all(_compat.static_held(static, j) == context + q for j in range(stack.num_layers))
        for j in range(stack.num_layers):
            for mine, theirs in zip(static.layers[j].keys[:, :, : context + q], dynamic.layers[j].keys):
                assert torch.allclose(mine, theirs, atol=1e-5, rtol=1e-5)
        counted_products.clear()
        logits = stack.logits(got, compiled=True)
        assert counted_products == [q]  # the LM head runs eagerly from its packed copy: a graph only wraps it
        assert torch.allclose(logits, stack.logits(want), atol=1e-5, rtol=1e-5)
    for module in model.modules():  # nothing of the graphs' scope stays on the model
        assert "forward" not in module.__dict__ and "_eer_packed" not in module._buffers
    assert router.unpatch() is model
    assert_same_model(before, model_fingerprint(model))


def test_one_graph_serves_every_chunk_of_2_to_8_positions_with_an_eager_passs_states_and_cache():
    from torch._dynamo.utils import counters

    model = tiny_llama(4)
    router = compiled_router(model)
    stack = router.stack
    total = 8 + sum(range(2, MAX_WIDTH + 1))
    states = torch.randn(1, total, stack.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(total).unsqueeze(0)
    static, dynamic = stack.new_cache(total), stack.new_cache()
    graphs = None
    with torch.inference_mode():
        for cache in (static, dynamic):
            stack._run(states[:, :8], 0, stack.num_layers, cache, positions[:, :8])
        done = 8
        for q in range(2, MAX_WIDTH + 1):  # chunk after chunk, each at its own width: no throw-away positions
            chunk, at = states[:, done : done + q], positions[:, done : done + q]
            want = stack._run(chunk, 0, stack.num_layers, dynamic, at)
            got = stack.run(chunk, 0, stack.num_layers, static, at)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            done += q
            assert _compat.static_held(static, 0) == done
            if graphs is None:  # the first chunk compiled the graphs; every later width reuses them
                graphs = counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs
        for j in range(stack.num_layers):
            assert torch.allclose(static.layers[j].keys[:, :, :done], dynamic.layers[j].keys, atol=1e-5, rtol=1e-5)
    assert all(SPAN in key for key in stack.compiled_layers()._seen)  # no graph of one position either


def test_verify_mode_through_packed_graph_products_keeps_the_contract(counted_products):
    model = tiny_llama(1)
    ids = repetitive_prompt(1)
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    router = compiled_router(model, ngram_draft=6, ngram_tree_nodes=6, max_pending=6)  # passes up to 8 positions
    counted_products.clear()
    out = router.generate(ids, max_new_tokens=32, mode="verify")
    assert torch.equal(out.sequences, ref)
    widths = set(counted_products)  # the prompt's eager pass aside, products over each chunk's own rows
    assert 1 in widths and widths & {3, 5, 6, 7}  # passes at their own widths, not padded to 4 or 8
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


@pytest.fixture(params=["onednn", "mkl"])
def own_operators(monkeypatch, request):
    """Each float32 kernel in turn, packing even tiny weights, with graphs calling its own operator (`call`), and a
    list counting the products its Python body makes (the rows of each)."""
    kernel = next(k for k in kernels.FLOAT32_KERNELS if k.name == request.param)
    if not kernels._available(kernel):
        pytest.skip(f"this torch build has no {request.param} packed product")
    monkeypatch.setitem(packed_module.MIN_ELEMENTS, torch.float32, 0)
    python_rows = []

    def counted(x, packed, weight, bias, rows):  # the Python body's product
        python_rows.append(rows)
        return kernel.product(x, packed, weight, bias, rows)

    chosen = dataclasses.replace(kernel, product=counted, min_rows=1)
    monkeypatch.setattr(kernels, "float32_kernel", lambda: chosen)
    return chosen, python_rows


def test_verify_mode_through_the_kernels_own_operators_keeps_the_contract(own_operators):
    model = tiny_llama(5)
    ids = repetitive_prompt(5)
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    router = compiled_router(model, ngram_draft=6, ngram_tree_nodes=6, max_pending=6)  # passes up to 8 positions
    assert router.stack.packed_weights is not None and router.stack.packed_weights.groups > 0
    out = router.generate(ids, max_new_tokens=32, mode="verify")
    assert torch.equal(out.sequences, ref)
    assert_cache_matches_full_forward(model, out.sequences, out.cache)


def test_graphs_call_the_kernels_own_operator_once_per_stacked_group_with_an_eager_passs_states(own_operators):
    from torch.profiler import profile

    chosen, python_rows = own_operators
    operator = chosen.call(None, None, None, None, 1)[0]
    router = compiled_router(tiny_llama(3))
    stack = router.stack
    context, widths = 6, (1, 3)
    total = context + sum(widths)
    states = torch.randn(1, total, stack.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(total).unsqueeze(0)
    static, dynamic = stack.new_cache(total), stack.new_cache()
    with torch.inference_mode():
        for cache in (static, dynamic):
            stack._run(states[:, :context], 0, stack.num_layers, cache, positions[:, :context])
        done = context
        for q in widths:
            chunk, at = states[:, done : done + q], positions[:, done : done + q]
            want = stack._run(chunk, 0, stack.num_layers, dynamic, at)
            stack.run(chunk, 0, stack.num_layers, static, at)  # compiles
            for j in range(stack.num_layers):
                _compat.drop_static_slots(static.layers[j], q)
            python_rows.clear()
            with profile() as calls:
                got = stack.run(chunk, 0, stack.num_layers, static, at)
            library_calls = sum(e.count for e in calls.key_averages() if e.key == operator.name())
            if chosen.static_rows and q > 1:  # the graph of 2 to 8 positions: its width is a symbol, not an int
                assert (python_rows, library_calls) == ([q] * (4 * stack.num_layers), 4 * stack.num_layers)
            else:  # straight from the graph: no Python product, one library call per stacked group
                assert (python_rows, library_calls) == ([], 4 * stack.num_layers)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            done += q
        for j in range(stack.num_layers):
            assert torch.allclose(static.layers[j].keys[:, :, :done], dynamic.layers[j].keys, atol=1e-5, rtol=1e-5)


def test_a_module_called_eagerly_while_a_graph_holds_its_copy_runs_its_own_forward(counted_products):
    model = tiny_llama(0)
    router = compiled_router(model)
    linear = router.stack._layer_linears[0][0]
    x = torch.randn(1, 2, linear.in_features)
    with graph_products.products_from_packed(router.stack.packed_weights, [linear], 2):
        assert "_eer_packed" in linear._buffers and "_eer_packed" not in linear.state_dict()
        counted_products.clear()
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))  # another thread's eager call
        assert counted_products == []
    assert "forward" not in linear.__dict__ and "_eer_packed" not in linear._buffers


@pytest.mark.slow  # compiles both graph shapes: about a minute on 2 cores with a cold inductor cache
def test_warmed_passes_leave_a_decode_nothing_to_compile_and_stats_say_what_one_compiled():
    from early_exit_router.models.compiled import warm_passes

    model = tiny_llama(2)
    router = compiled_router(model)
    first = router.generate(repetitive_prompt(2), max_new_tokens=16, mode="verify")
    assert first.stats.compile_s > 0 and "compiling graphs" in first.stats.summary()
    compiled = router.stack.compiled_layers()
    warm_passes(router.stack, range(1, 17))
    shapes = set(compiled._seen)
    assert {key[-1] for key in shapes if key[0] == "head"} == {1, SPAN}
    assert {key[3] for key in shapes if key[0] == "range" and key[-1]} == {1, SPAN}  # tree passes' mask graphs
    ids = repetitive_prompt(3)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    later = router.generate(ids, max_new_tokens=24, mode="verify")
    assert torch.equal(later.sequences, ref)
    assert later.stats.compile_s == 0 and compiled._seen == shapes
    assert "compiling graphs" not in later.stats.summary()


def test_the_compiled_decodes_cost_table_is_measured_on_the_compiled_passes(monkeypatch):
    from early_exit_router import api
    from early_exit_router.routing import costs

    router = compiled_router(tiny_llama(0))
    eager_key, compiled_key = costs.cost_key(router.stack, 0), costs.cost_key(router.stack, 0, compile=True)
    assert not eager_key["compiled"] and compiled_key["compiled"]
    # a table priced graphs that call the kernels' operators, or their Python body: each its own entry
    assert compiled_key["graph_products"] == graph_products.how() and eager_key["graph_products"] is None
    assert costs.cache_path(eager_key) != costs.cache_path(compiled_key)
    table = costs.measure(router.stack, router.heads, 0, chunks=(1, 2, 3, 8, 16), reps=1, rounds=1, compile=True)
    assert table.key == compiled_key and len(table.layer_ms) == 5
    seen = router.stack.compiled_layers()._seen
    assert {key[-1] for key in seen if key[0] == "layers"} == {1, SPAN}  # 16 positions run eagerly
    assert {key[-1] for key in seen if key[0] == "head"} == {1, SPAN}  # no packed copy: the head as a graph
    # a call whose config compiles decides from that table, another from the eager passes'
    asked = []
    monkeypatch.setattr(api, "config_costs", lambda stack, heads, cfg, refresh: asked.append(cfg.compile) or table)
    router.cost_model = None
    for compile in (True, False):
        router.costs(config=router.config.replace(compile=compile))
    assert asked == [True, False]
