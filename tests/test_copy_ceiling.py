"""The copy ceiling (`bench/copy_ceiling.py`): a replay of the control's outputs with perfect copy drafts, costed from
a hand-made cost table whose values make every cycle's cost known."""

from __future__ import annotations

import torch

from early_exit_router.bench.copy_ceiling import copy_ceilings, replay_cost
from early_exit_router.bench.report import format_markdown
from early_exit_router.config import RouterConfig
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.ngram import SuffixStore

FLAT = CostModel.synthetic(2, [1.0] * 40, [1.0] * 40)  # a pass over any chunk costs one plain step
DEAR = CostModel.synthetic(2, [1.0] + [10.0] * 39, [1.0] * 40)  # a pass costs 7 plain steps
CONFIG = RouterConfig()


def test_a_copy_is_drafted_exactly_as_far_as_it_is_right_and_pays_one_pass():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    output = [20, 1, 2, 3, 4, 5, 99, 6, 7]
    # Plain steps make 20, 1 and 2; then "1 2" matches the prompt's start and its copy 3 4 5 6 ... is right for
    # three tokens: one pass makes 3 4 5 and the full model's 99; plain steps make 6 and 7 (nothing matches "5 99").
    assert replay_cost(prompt, output, FLAT, CONFIG, None) == 6.0
    # A pass never costs more than the plain steps it replaces.
    assert replay_cost(prompt, output, DEAR, CONFIG, None) == len(output)
    # No copy in sight: one plain step per token.
    assert replay_cost([1, 2, 3], [7, 8, 9, 10], FLAT, CONFIG, None) == 4.0
    # Where chunks cost less than one position (prepacked kernels serve chunks only), a wrong draft beats a plain
    # step: each token then costs one pass over two positions.
    cheap = CostModel.synthetic(2, [1.0] + [0.5] * 39, [1.0] + [0.5] * 39)
    assert replay_cost([1, 2, 3], [7, 8, 9, 10], cheap, CONFIG, None) == 4 * 0.5
    assert replay_cost(prompt, output, cheap, CONFIG, None) == 6 * 0.5


def test_later_calls_of_a_sequence_copy_what_the_earlier_ones_stored():
    prompts = [{"id": "a", "sequence": "s"}, {"id": "b", "sequence": "s"}]
    encoded = [torch.tensor([[1, 2, 3]]), torch.tensor([[5, 7, 8]])]
    control = {"a": ("repeated, first call", [7, 8, 9, 10, 11]), "b": ("repeated", [9, 10, 11])}
    ceilings = copy_ceilings(prompts, encoded, control, [[0, 1]], FLAT, CONFIG)
    # "7 8" ends the second prompt and occurs in the first call's output: one pass makes 9 10 11.
    assert ceilings == {"repeated, first call": 1.0, "repeated": 3.0, "all": 8 / 6}
    store = SuffixStore(CONFIG.ngram_store_tokens, CONFIG.ngram_size, CONFIG.ngram_min_size)
    store.add([1, 2, 3, 7, 8, 9, 10, 11])
    assert replay_cost([5, 7, 8], [9, 10, 11], FLAT, CONFIG, store) == 1.0
    assert replay_cost([5, 7, 8], [9, 10, 11], FLAT, CONFIG, None) == 3.0
    # Without a store, and each prompt in its own unit, nothing is copied across calls.
    no_store = CONFIG.replace(ngram_store_tokens=0)
    assert copy_ceilings(prompts, encoded, control, [[0, 1]], FLAT, no_store)["repeated"] == 1.0
    assert copy_ceilings(prompts, encoded, control, [[0], [1]], FLAT, CONFIG)["repeated"] == 1.0


def test_the_report_prints_each_categorys_ceiling():
    meta = {"model": "m", "machine": "x", "dtype": "float32", "torch": "t", "transformers": "v", "prompts": 1,
            "bench_config": {"max_new_tokens": 4, "repeats": 1}, "num_layers": 2,
            "copy_ceiling": {"grounded": 2.5, "all": 2.5}}  # fmt: skip
    row = {"arm": "plain HF generate", "tokens_per_s": 1.0, "speedup": 1.0, "hit_rate": 0.0, "exit_histogram": {},
           "tokens": 4, "compute_ratio": 1.0, "teacher_forced_agreement": 1.0, "nll_ratio": 1.0, "rouge_l": 1.0,
           "token_match": 1.0, "first_divergence_median": None, "identical": 1, "runs": 1, "ttft_ms": 1.0,
           "itl_p50_ms": 1.0, "itl_p99_ms": 1.0, "routing_overhead": None, "peak_memory_mb": None}  # fmt: skip
    text = format_markdown(meta, [{**row, "category": "grounded"}, {**row, "category": "all"}])
    assert text.count("Copy ceiling: 2.50x") == 2
    assert "Copy ceiling" not in format_markdown({**meta, "copy_ceiling": None}, [{**row, "category": "all"}])
    # Plain steps from prepacked weights: the ceiling, priced in the router's own plain steps, also over plain HF.
    loop = {**row, "arm": "router, exits off", "family": "engine control", "speedup": 1.6, "category": "all"}
    text = format_markdown({**meta, "packed_weights": 151}, [{**row, "category": "all"}, loop])
    assert "Copy ceiling: 2.50x over the router's plain decoding, 4.00x over plain HF" in text
    assert "4.00x" not in format_markdown(meta, [{**row, "category": "all"}, loop])  # no packing: the loop is noise
