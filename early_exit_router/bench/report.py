"""Rendering a bench run: the markdown tables and the speed/quality plot, from its `meta` and `summary` (plain dicts,
so a saved bench.json renders again).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from early_exit_router.decode.stats import exit_draft_cycles, exit_head_tokens


def format_value(value: Any, spec: str = ".2f") -> str:
    """`value` formatted with `spec`, or an en dash for a missing value (tables)."""
    return "–" if value is None else format(value, spec)


COPY_CEILING = (
    "the control's outputs with every copy the n-gram tier finds drafted exactly as far as it is right, each pass "
    "at the cost table's price, plain steps elsewhere: `bench/copy_ceiling.py`"
)


def format_markdown(meta: dict[str, Any], summary: list[dict[str, Any]]) -> str:
    """The summary as markdown: a header, then one table per category."""
    lines = [
        f"model: {meta['model']}",
        *(f"heads {label}: {heads}" for label, heads in meta.get("compared_heads", {}).items()),
        f"machine: {meta['machine']}; {meta['dtype']}, weights {'+'.join(meta.get('weights', ['dense']))}; "
        f"torch {meta['torch']}, transformers {meta['transformers']}",
        f"{meta['prompts']} prompts, {meta['bench_config']['max_new_tokens']} new tokens max, "
        f"{meta.get('decoding', 'greedy')}, "
        f"{meta['bench_config']['repeats']} repeat(s); speedup = tokens/s over the control's in the same run "
        "(vs HF compiled: over HF generate with a static cache and torch.compile); "
        "compute = decode multiply-adds per token over the full model's; exits = share of tokens per shallow "
        "depth; agreement = teacher-forced agreement with the full model; NLL = full-model NLL of the output over "
        "the control's; token match and 1st diff (median first differing position) compare with the control."
        + (
            f" {meta['reference_dtype']} agr. = teacher-forced agreement with the model in {meta['reference_dtype']}."
            if meta.get("reference_dtype")
            else ""
        )
        + (
            " correct = answers that pass their prompt's check (`bench/checks.py`), of the runs on prompts with one."
            if _checked(summary)
            else ""
        ),
    ]
    columns = [
        "arm", "tok/s", "speedup", "hit rate", "exits", "compute", "agreement", "NLL ratio", "ROUGE-L",
        "token match", "1st diff", "identical", "TTFT ms", "ITL p50/p99 ms", "routing", "plain", "cycles", "peak MB",
    ]  # fmt: skip
    reference = meta.get("reference_dtype")
    if reference:
        columns.insert(columns.index("agreement") + 1, f"{reference} agr.")
    compiled = any(row.get("speedup_compiled") is not None for row in summary)
    if compiled:  # runs that timed HF's own fast path: speedups over it beside those over plain HF
        columns.insert(columns.index("speedup") + 1, "vs HF compiled")
    checked = _checked(summary)
    if checked:
        columns.insert(columns.index("identical") + 1, "correct")
    num_layers = meta["num_layers"]
    packed = bool(meta.get("packed_weights"))  # plain steps from prepacked weights: the loop alone is faster than HF
    for category in dict.fromkeys(row["category"] for row in summary):
        rows = [row for row in summary if row["category"] == category]
        lines += ["", f"### {category}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in rows:
            cells = [
                row["arm"],
                f"{row['tokens_per_s']:.1f}",
                f"{format_value(row['speedup'])}x",
                *([f"{format_value(row.get('speedup_compiled'))}x"] if compiled else []),
                f"{row['hit_rate']:.2f}",
                _histogram(row["exit_histogram"], row["tokens"], num_layers),
                format_value(row["compute_ratio"]),
                f"{row['teacher_forced_agreement']:.3f}",
                *([format_value(row.get("reference_agreement"), ".3f")] if reference else []),
                format_value(row["nll_ratio"]),
                format_value(row["rouge_l"]),
                format_value(row["token_match"]),
                format_value(row["first_divergence_median"], ".0f"),
                f"{row['identical']}/{row['runs']}",
                *([_share(row.get("correct"), row.get("checked"))] if checked else []),
                format_value(row["ttft_ms"], ".0f"),
                f"{format_value(row['itl_p50_ms'], '.0f')}/{format_value(row['itl_p99_ms'], '.0f')}",
                format_value(row["routing_overhead"], ".1%"),
                format_value(row.get("plain_share"), ".2f") if row.get("policy_cycles") else "–",
                ", ".join(f"{k} {v}" for k, v in (row.get("policy_cycles") or {}).items()) or "–",
                format_value(row["peak_memory_mb"], ".0f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += _differing_outputs(rows)
        lines += _repairs(rows)
        lines += _noise_band(rows, packed)
        lines += _exits_added(rows, num_layers)
        lines += _heads_compared(rows, num_layers)
        ceiling = (meta.get("copy_ceiling") or {}).get(category)
        if ceiling is not None:
            lines += ["", _ceiling_line(ceiling, _engine_control(rows) if packed else None)]
    if meta.get("cost_model"):
        from early_exit_router.routing.costs import CostModel

        lines += ["", "### cost model the policy decided from", "", CostModel.from_dict(meta["cost_model"]).markdown()]
    return "\n".join(lines)


def _checked(summary: list[dict[str, Any]]) -> bool:
    """Whether any prompt of the run carried a check (the table then has a "correct" column)."""
    return any(row.get("checked") for row in summary)


def _share(count: int | None, total: int | None) -> str:
    """'9/14', or an en dash where nothing was counted."""
    return "–" if not total else f"{count}/{total}"


def _differing_outputs(rows: list[dict[str, Any]]) -> list[str]:
    """One line per arm whose outputs are not all identical to the control's: how many differ, where they first
    differ on average, their ROUGE-L against the control's, and (with checks) how many answers are correct beside
    the control's count; the free-running quality of a lossy arm that teacher-forced agreement does not show."""
    control = next((r for r in rows if r.get("family") == "control"), None)
    name = control["arm"] if control else "the control"
    lines = []
    for row in rows:
        if row is control or row["identical"] >= row["runs"]:
            continue
        line = f"- {row['arm']}: {row['runs'] - row['identical']}/{row['runs']} outputs differ"
        if row.get("first_divergence_mean") is not None:
            line += f", first at token {row['first_divergence_mean']:.1f} on average"
        line += f"; ROUGE-L {format_value(row['rouge_l'])}"
        if row.get("checked"):
            line += f"; correct {_share(row['correct'], row['checked'])}"
            if row.get("control_checked"):
                line += f" ({name}: {_share(row['control_correct'], row['control_checked'])})"
        lines.append(line + ".")
    if not lines:
        return []
    return ["", f"Outputs that differ from {name}'s (token positions count from the first new token):", "", *lines]


def _outputs(count: int) -> str:
    return f"{count} output" + ("" if count == 1 else "s")


def _repairs(rows: list[dict[str, Any]]) -> list[str]:
    """Exit mode's arms: the exited tokens the fill pass replaced before release, those released unchecked, the
    outputs the router itself found leaving the full model's (against bench's measurement) and the repeat guard."""
    lines = [
        f"- {row['arm']}: {row['repaired_tokens']} wrong exited tokens repaired before release, "
        f"{row.get('released_unchecked', 0)} released unchecked; {_outputs(row.get('divergences_found', 0))} left "
        f"the full model's by the router's own account (its first divergence is bench's in "
        f"{row.get('divergence_as_measured', 0)}/{row['runs']} runs); the repeat guard sent "
        f"{row.get('repeat_refusals', 0)} exits deeper."
        for row in rows
        if any(row.get(k) for k in ("repaired_tokens", "released_unchecked", "repeat_refusals", "divergences_found"))
    ]
    return ["", "Exit mode's repairs:", "", *lines] if lines else []


def _noise_band(rows: list[dict[str, Any]], packed: bool = False) -> list[str]:
    """The decode loop alone does what plain HF does: its distance from 1.00x is how far this run's ratios move.
    With prepacked weights it does the same products faster, so its ratio is that gain, not a noise band."""
    loop = _engine_control(rows)
    if loop is None:
        return []
    if packed:
        return ["", f"The decode loop alone, from prepacked weights, ran at {loop['speedup']:.2f}x of plain HF."]
    band = abs(loop["speedup"] - 1)
    return ["", f"Noise band: the decode loop alone ran at {loop['speedup']:.2f}x of plain HF (±{band:.0%})."]


def _exits_added(rows: list[dict[str, Any]], num_layers: int) -> list[str]:
    """Per mode, the loaded config against the same mode with the n-gram tier alone (exits off), from one run: what
    the exit heads added in speed, in tokens and in draft cycles."""
    lines = []
    for mode, compiled in ((m, c) for m in ("verify", "exit") for c in ("", ", compiled")):
        routed = next((r for r in rows if r.get("family") == f"router {mode}, loaded config{compiled}"), None)
        alone = next((r for r in rows if r.get("family") == f"router {mode}, n-gram only{compiled}"), None)
        if routed is None or alone is None or not routed["tokens_per_s"] or not alone["tokens_per_s"]:
            continue
        gain = routed["tokens_per_s"] / alone["tokens_per_s"] - 1
        saved_ms = 1000 / alone["tokens_per_s"] - 1000 / routed["tokens_per_s"]
        exited = exit_head_tokens(routed["exit_histogram"], num_layers) / max(1, routed["tokens"])
        cycles = exit_draft_cycles(routed.get("policy_cycles"))
        lines.append(
            f"Exits added in {mode} mode{compiled}: {routed['tokens_per_s']:.1f} against "
            f"{alone['tokens_per_s']:.1f} tok/s with the n-gram tier alone ({gain:+.1%}, {saved_ms:+.2f} ms saved per "
            f"token); tokens from exit heads {exited:.1%}"
            + (f", exit draft cycles {cycles}." if mode == "verify" else ".")
        )
    return ["", *lines] if lines else []


def _heads_compared(rows: list[dict[str, Any]], num_layers: int) -> list[str]:
    """Per mode, each other set of heads (`bench --compare-heads`) against the loaded ones, from one run."""
    lines = []
    for mode in ("verify", "exit"):
        loaded = next((r for r in rows if r.get("family") == f"router {mode}, loaded config"), None)
        prefix = f"router {mode}, loaded config, heads "
        for row in (r for r in rows if r.get("family", "").startswith(prefix)):
            if loaded is None or not loaded["tokens_per_s"]:
                continue
            gain = row["tokens_per_s"] / loaded["tokens_per_s"] - 1
            exited = [exit_head_tokens(r["exit_histogram"], num_layers) / max(1, r["tokens"]) for r in (row, loaded)]
            line = (
                f"Heads {row['family'][len(prefix) :]} in {mode} mode: {row['tokens_per_s']:.1f} against "
                f"{loaded['tokens_per_s']:.1f} tok/s with the loaded heads ({gain:+.1%}); tokens from exit heads "
                f"{exited[0]:.1%} against {exited[1]:.1%}"
            )
            if mode == "verify":
                cycles = [exit_draft_cycles(r.get("policy_cycles")) for r in (row, loaded)]
                line += f", exit draft cycles {cycles[0]} against {cycles[1]}"
            else:
                agreement = [r["teacher_forced_agreement"] for r in (row, loaded)]
                line += f", teacher-forced agreement {agreement[0]:.3f} against {agreement[1]:.3f}"
            lines.append(line + ".")
    return ["", *lines] if lines else []


def _engine_control(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The category's "router, exits off" row (None: not run, or no speedup measured)."""
    return next((row for row in rows if row.get("family") == "engine control" and row["speedup"] is not None), None)


def _ceiling_line(ceiling: float, loop: dict[str, Any] | None) -> str:
    """The copy ceiling is priced in the router's own plain steps; where those run from prepacked weights (`loop`: the
    decode loop alone, faster than plain HF), the same ceiling over plain HF is that ratio times the loop's."""
    line = f"Copy ceiling: {ceiling:.2f}x over the router's plain decoding"
    if loop is not None:
        line += f", {ceiling * loop['speedup']:.2f}x over plain HF with the decode loop alone at {loop['speedup']:.2f}x"
    return f"{line} ({COPY_CEILING})."


def _histogram(histogram: dict, tokens: int, num_layers: int) -> str:
    """Share of tokens per shallow depth, e.g. 'L12 .10, L24 .15, ngram .05' ('–' when nothing exited)."""
    parts = []
    for layer, count in sorted((int(k), v) for k, v in histogram.items()):
        if layer != num_layers - 1 and count:
            share = f"{count / max(1, tokens):.2f}".lstrip("0")
            parts.append(f"{'ngram' if layer < 0 else f'L{layer}'} {share}")
    return ", ".join(parts) or "–"


def plot_tradeoff(meta: dict[str, Any], summary: list[dict[str, Any]], path: str | Path) -> None:
    """PNG: per category, speedup (top) and compute saved (bottom) against teacher-forced agreement."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "The plot needs matplotlib: pip install 'early-exit-router[bench]' (or pip install matplotlib)."
        ) from None
    categories = list(dict.fromkeys(row["category"] for row in summary))
    fig, axes = plt.subplots(2, len(categories), figsize=(4.2 * len(categories), 7.5), squeeze=False)
    for col, category in enumerate(categories):
        rows = [row for row in summary if row["category"] == category]
        for ax, key, label in (
            (axes[0][col], "speedup", "speedup over plain HF (measured)"),
            (axes[1][col], "compute_ratio", "compute per token / full model"),
        ):
            families = dict.fromkeys(row["family"] for row in rows)
            for family in families:
                points = [r for r in rows if r["family"] == family and r[key] is not None]
                if not points:
                    continue
                if any(r["threshold"] is None for r in points):  # single configurations: one marker each
                    for r in points:
                        marker = "s" if family == "HF" else "^"
                        ax.scatter(r[key], r["teacher_forced_agreement"], marker=marker, label=r["arm"])
                    continue
                points.sort(key=lambda r: r["threshold"] or 0)
                xs = [r[key] for r in points]
                ys = [r["teacher_forced_agreement"] for r in points]
                ax.plot(xs, ys, marker="o", label=family)
                for r in points:
                    if r["threshold"] is not None:
                        ax.annotate(f"{r['threshold']:g}", (r[key], r["teacher_forced_agreement"]), fontsize=7)
            ax.set_xlabel(label)
            ax.set_ylabel("agreement with full model")
            ax.set_title(category)
            ax.grid(alpha=0.3)
        if col == 0:
            axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{meta['model'].split(':')[0]} on {meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
