"""Check the router's contract on a CUDA GPU, in fp16 and bf16: run it on a machine with a GPU.

    python examples/gpu_check.py            # tiny random Llama + SmolLM2-135M (when its package is installed)

Checks, per dtype: never-exit output identical to `model.generate`; verify mode identical to greedy; every
layer's cache equal to a full forward pass after mixed exits (within a few units in the last place); host-device
syncs in the decode loop counted with `torch.cuda.set_sync_debug_mode("warn")` against routing decisions and deep
passes; the patched `model.generate` given ids on the CPU returns them there, as HF does. Then, on SmolLM2, it
measures the cost model on the GPU (`early-exit-router profile` prints the same table), and times plain HF generate
and HF's static cache + torch.compile against the default config (verify mode under the cost policy), the fixed
cascade and exit mode, each mode also with its exits off (the n-gram tier alone), and the default and the decode
loop alone with compiled passes (`compile=True`), printing which plans the policy chose and what the exits added;
and it compares the `memory` budget with what a generation at 4096 positions holds (the allocator's peak printed
beside it). Last, quantized bases (torchao int8, bitsandbytes 8/4-bit where installed): verify mode against the same
quantized model's greedy. Exit code 0 when every check passes.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from early_exit_router import EarlyExitRouter
from early_exit_router.bench.memory import generation_bytes, memory_budget  # noqa: E402
from early_exit_router.decode.stats import exit_draft_cycles, exit_head_tokens  # noqa: E402
from early_exit_router.models import _compat
from tests.conftest import ALWAYS_EXIT, MIXED, NEVER_EXIT, tiny_llama  # noqa: E402

FAILURES: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")
    if not ok:
        FAILURES.append(name)


def cache_error(model, out) -> float:
    """The largest difference between the routed cache and a full forward pass's, per layer relative to the layer's
    largest entry: the fill computes exited positions in other chunk shapes, so low precision rounds them apart."""
    with torch.no_grad():
        full = _compat.forward_cache(model(out.sequences[:, :-1], use_cache=True))
    return max(
        max(
            (a.keys - b.keys).abs().max().item() / b.keys.abs().max().item(),
            (a.values - b.values).abs().max().item() / b.values.abs().max().item(),
        )  # fmt: skip
        for a, b in zip(out.cache.layers, full.layers)
    )


def count_syncs(fn) -> tuple[int, object]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught), result


def contract(label: str, model, ids: torch.Tensor, exit_layers: list[int], mixed: dict) -> None:
    n = 24
    ref = model.generate(ids, max_new_tokens=n, do_sample=False)
    router = EarlyExitRouter.from_model(model, exit_layers=exit_layers, **NEVER_EXIT)
    out = router.generate(ids, max_new_tokens=n)
    check(f"{label} never-exit == generate", torch.equal(out.sequences, ref))
    router.config = router.config.replace(**mixed)
    out = router.generate(ids, max_new_tokens=n, mode="verify")
    check(f"{label} verify == greedy", torch.equal(out.sequences, ref), f"hit rate {out.stats.hit_rate:.2f}")
    syncs, out = count_syncs(lambda: router.generate(ids, max_new_tokens=n, mode="exit"))
    err = cache_error(model, out)
    rtol = 4 * torch.finfo(model.dtype).eps  # a few units in the last place of the layer's largest entry
    check(f"{label} cache == full forward after mixed exits", err <= rtol, f"max relative diff {err:.2e}")
    s = out.stats
    # One per routing decision (flag, confidence and token read together); per deep pass up to four (its draft ids
    # and positions uploaded from lists, the finite-logits check, its tokens read back); prefill, setup and cache
    # growth. The first GPU run counted 43-125 for 24 tokens: none scales with the number of layers.
    budget = s.new_tokens * (len(exit_layers) + 1) + 4 * s.deep_passes + 24
    check(f"{label} host syncs within budget", syncs <= budget, f"{syncs} syncs for {s.new_tokens} tokens")
    router.config = router.config.replace(mode="verify")
    routed = model.generate(ids.cpu(), max_new_tokens=n, do_sample=False)
    check(f"{label} model.generate from CPU ids returns CPU ids", routed.device.type == "cpu", str(routed.device))
    check(f"{label} model.generate from CPU ids == greedy", torch.equal(routed, ref.cpu()))
    router.unpatch()


def timing(router: EarlyExitRouter) -> None:
    print(router.costs(refresh=True).markdown())  # measured on this GPU, in this dtype
    ids = router.encode("List the seven days of the week as a numbered list, one per line.", chat=True)
    exits_off = {"active_exit_layers": [], "ngram_tier": True}  # the n-gram tier alone: what the exits must beat
    arms_config = {
        "verify, default config (cost policy)": ("verify", {}),
        "verify, exits off (n-gram tier only)": ("verify", exits_off),
        "verify, fixed cascade, no n-gram": ("verify", {"policy": "fixed", "ngram_tier": False}),
        "exit, loaded config": ("exit", {}),
        "exit, exits off (n-gram tier only)": ("exit", exits_off),
        "verify, default config, compiled": ("verify", {"compile": True}),
        "exits off, compiled (the decode loop alone)": (
            "verify",
            {"active_exit_layers": [], "ngram_tier": False, "compile": True},
        ),  # fmt: skip
    }
    for _ in range(2):  # warm-up (and the compiled arms' graphs)
        router.generate(ids, max_new_tokens=8)
        router.generate(ids, max_new_tokens=64, config={"compile": True})
    arms = {}
    fast_path = _compat.compiled_generate_kwargs(ids.shape[1] + 64, ids.device)  # HF's static cache + torch.compile
    with router.disabled() as model, torch.no_grad():
        torch.cuda.synchronize()
        t = time.perf_counter()
        plain = router.generate(ids, max_new_tokens=64)
        torch.cuda.synchronize()
        arms["plain"] = (plain.stats.new_tokens / (time.perf_counter() - t), plain)
        for _ in range(2):  # compiles, then runs compiled
            torch.cuda.synchronize()
            t = time.perf_counter()
            mask = torch.ones_like(ids)
            hf = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False, **fast_path)
            torch.cuda.synchronize()
        hf_tps = (hf.shape[1] - ids.shape[1]) / (time.perf_counter() - t)
        print(f"  HF static cache + torch.compile: {hf_tps:.1f} tok/s ({hf_tps / arms['plain'][0]:.2f}x plain)")
    configured = router.config
    for name, (mode, overrides) in arms_config.items():
        router.config = configured.replace(**overrides)
        # Every arm starts from an empty n-gram store: one that kept an earlier arm's answer would copy it whole.
        router.clear_ngram_store()
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = router.generate(ids, max_new_tokens=64, mode=mode)
            torch.cuda.synchronize()
        finally:
            router.config = configured
        arms[name] = (out.stats.new_tokens / (time.perf_counter() - t), out)
    base = arms["plain"][0]
    for name, (tps, out) in arms.items():
        print(
            f"  {name}: {tps:.1f} tok/s ({tps / base:.2f}x plain, {tps / hf_tps:.2f}x HF compiled), hit rate "
            f"{out.stats.hit_rate:.2f}, cycles {out.stats.policy_cycles}"
        )
    for routed, alone in (("verify, default config (cost policy)", "verify, exits off (n-gram tier only)"),
                          ("exit, loaded config", "exit, exits off (n-gram tier only)")):  # fmt: skip
        (tps, out), (tps_off, _) = arms[routed], arms[alone]
        exited = exit_head_tokens(out.stats.exit_histogram, router.stack.num_layers)
        cycles = exit_draft_cycles(out.stats.policy_cycles)
        print(
            f"  exits added ({routed}): {tps / tps_off - 1:+.1%} tok/s, {1000 / tps_off - 1000 / tps:+.2f} ms saved "
            f"per token, {exited} of {out.stats.new_tokens} tokens from exit heads, {cycles} exit draft cycles"
        )
    for name, (_, out) in arms.items():
        if name.startswith("verify") or "compiled" in name:
            check(f"smollm2 {name} == plain", torch.equal(out.sequences, arms["plain"][1].sequences))


def memory(label: str, router: EarlyExitRouter) -> None:
    """The `memory` command's budget against what one generation at 4096 positions holds; the allocator's peak,
    which the prefill's activations set, is printed beside it."""
    budget = memory_budget(router, 4096)
    held, peak = generation_bytes(router, 4096)
    detail = f"budget {budget.total / 2**20:.1f} MiB, held {held / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB"
    check(f"{label} memory budget", abs(held / budget.total - 1) <= 0.1, detail)


def quantized_bases() -> None:
    """bitsandbytes 8/4-bit (CUDA only) and torchao int8: verify mode equals the same quantized model's greedy."""
    import importlib.util

    kinds = ["int8"] if importlib.util.find_spec("torchao") else []
    kinds += ["bnb-8bit", "bnb-4bit"] if importlib.util.find_spec("bitsandbytes") else []
    for kind in kinds:
        try:
            router = EarlyExitRouter.from_pretrained("smollm2-135m", device="cuda", quantize=kind)
        except (FileNotFoundError, ImportError) as exc:
            print(f"skip {kind}: {exc}")
            continue
        ids = router.encode("Write a short poem about the sea.", chat=True)
        with router.disabled():
            ref = router.generate(ids, max_new_tokens=24)
        out = router.generate(ids, max_new_tokens=24, mode="verify")
        check(f"smollm2 {kind} verify == the quantized model's greedy", torch.equal(out.sequences, ref.sequences))
        memory(f"smollm2 {kind}", router)


def main() -> int:
    if not torch.cuda.is_available():
        print("No CUDA device: this script checks the GPU path. The CPU path is covered by the test suite.")
        return 1
    print(torch.cuda.get_device_name(0), torch.__version__)
    warnings.filterwarnings("ignore", message="Exit mode with UNTRAINED")
    for dtype in (torch.float16, torch.bfloat16):
        model = tiny_llama(0).to("cuda", dtype)
        ids = torch.randint(1, 96, (1, 6), device="cuda")
        contract(f"tiny {dtype}", model, ids, [1, 3], MIXED)
        contract(f"tiny {dtype} always-exit", tiny_llama(0).to("cuda", dtype), ids, [2], ALWAYS_EXIT)
        try:
            router = EarlyExitRouter.from_pretrained("smollm2-135m", dtype=dtype, device="cuda")
        except FileNotFoundError as exc:
            print(f"skip SmolLM2: {exc}")
            continue
        ids = router.encode("Write a short poem about the sea.", chat=True)
        model = router.unpatch()
        contract(f"smollm2 {dtype}", model, ids, [10, 20], {})
        router = EarlyExitRouter.from_pretrained("smollm2-135m", dtype=dtype, device="cuda")
        timing(router)
        memory(f"smollm2 {dtype}", router)
    quantized_bases()
    print("ALL PASS" if not FAILURES else f"FAILED: {FAILURES}")
    return 0 if not FAILURES else 1


if __name__ == "__main__":
    sys.exit(main())
