"""Where decode time goes: time per decoder layer by chunk size, and per LM-head call, during one generation.

    python examples/profile_costs.py [--mode exit] [--max-new-tokens 64] [--router-option value ...]

Wraps the layer stack's `run` and `unembed` with timers (CPU: no asynchrony to account for) and prints, per
chunk size, milliseconds per layer, and milliseconds per LM-head call. Router options as `key=value` pairs, e.g.
`block_size=4 check_agreement=false`.
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

from early_exit_router import EarlyExitRouter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--mode", default="exit", choices=["exit", "verify"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="List the seven days of the week as a numbered list, one per line.")
    parser.add_argument("options", nargs="*", help="RouterConfig overrides as key=value")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    overrides = {}
    for item in args.options:
        key, _, value = item.partition("=")
        overrides[key] = {"true": True, "false": False}.get(value.lower(), value)
        for cast in (int, float):
            try:
                overrides[key] = cast(value)
                break
            except ValueError:
                pass
    router = EarlyExitRouter.from_pretrained(args.model, **overrides)
    stack = router.stack
    seconds: dict[str, float] = collections.defaultdict(float)
    units: collections.Counter = collections.Counter()
    run, unembed = stack.run, stack.unembed

    def timed_run(hidden, start, stop, cache, positions):
        t = time.perf_counter()
        out = run(hidden, start, stop, cache, positions)
        key = f"layers, chunk of {hidden.shape[1]:>2}" if hidden.shape[1] <= 16 else "layers, prompt prefill"
        seconds[key] += time.perf_counter() - t
        units[key] += stop - start
        return out

    def timed_unembed(normed):
        t = time.perf_counter()
        out = unembed(normed)
        rows = normed.reshape(-1, normed.shape[-1]).shape[0]
        key = f"LM head, {rows:>2} row{'s' if rows > 1 else ''}"
        seconds[key] += time.perf_counter() - t
        units[key] += 1
        return out

    stack.run, stack.unembed = timed_run, timed_unembed
    try:
        ids = router.encode(args.prompt, chat=True)
        router.generate(ids, max_new_tokens=8, mode=args.mode)  # warm-up
        seconds.clear()
        units.clear()
        out = router.generate(ids, max_new_tokens=args.max_new_tokens, mode=args.mode)
    finally:
        del stack.run, stack.unembed  # back to the class methods
    print(out.stats.summary())
    print("\n| what | calls or layer passes | total ms | ms each |\n|---|---|---|---|")
    for key in sorted(seconds):
        print(f"| {key} | {units[key]} | {seconds[key] * 1000:.1f} | {seconds[key] * 1000 / units[key]:.2f} |")
    print(f"\nwall {out.stats.wall_time_s * 1000:.0f} ms, of which timed {sum(seconds.values()) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
