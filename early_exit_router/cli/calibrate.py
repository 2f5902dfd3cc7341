"""`early-exit-router calibrate`: its subparser and its run function."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from early_exit_router.cli.options import (
    add_load_options,
    add_router_options,
    check_out_folder,
    float_list,
    load_options,
    read_prompts,
    router_overrides,
)
from early_exit_router.models.loading import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    calib = sub.add_parser(
        "calibrate",
        help="Choose the exit threshold that is fastest while meeting a quality target; save it with the heads.",
        description="Sweep a confidence threshold (high = low, no entropy band) on a calibration half of the "
        "prompts against plain HF greedy, keep the thresholds that meet the target (Learn-then-Test binomial bound "
        "for agreement and consistency targets, empirical for NLL), pick the fastest, check it on the held-out half, "
        "and save the router with it.",
    )
    calib.add_argument("--model", default=DEFAULT_MODEL, help="Alias, saved router folder, HF folder or .gguf.")
    calib.add_argument("--out", required=True, help="Folder to save the calibrated router into.")
    calib.add_argument("--prompts", default=None, help="JSONL prompts, split in halves (default: the shipped set).")
    target = calib.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--target-agreement",
        type=float,
        help="Teacher-forced agreement to reach, e.g. 0.95; in exit mode also saved as the router's target_agreement.",
    )
    target.add_argument("--max-nll-increase", type=float, help="Largest relative NLL increase, e.g. 0.02 for 2%%.")
    target.add_argument(
        "--min-consistency",
        type=float,
        help="Smallest share of outputs identical to the full model's greedy output, e.g. 0.9 (per sequence, as "
        "CALM's textual consistency); exit mode runs under the router's holdback (with repairs every output is).",
    )
    calib.add_argument("--method", choices=["ltt", "empirical"], default="ltt", help="Default: %(default)s.")
    calib.add_argument("--delta", type=float, default=0.1, help="LTT risk level (default: %(default)s).")
    calib.add_argument("--objective", choices=["speed", "compute"], default="speed", help="Default: %(default)s.")
    calib.add_argument(
        "--speed-tie-z",
        type=float,
        default=2.0,
        help="Speed objective: a candidate within this many standard errors of the fastest (paired over the "
        "prompts) ties with it, and the tie goes to the candidate that exits most tokens; 0 takes the fastest "
        "(default: %(default)s).",
    )
    calib.add_argument(
        "--candidates", type=float_list, default=None, metavar="T1,T2", help="Thresholds to try (default: 0.3-0.99)."
    )
    calib.add_argument("--max-new-tokens", type=int, default=64, help="New tokens per prompt (default: %(default)s).")
    calib.add_argument("--quiet", action="store_true", help="No progress bar.")
    add_load_options(calib)
    add_router_options(calib)


def run(args: argparse.Namespace) -> int:
    from early_exit_router.api import EarlyExitRouter
    from early_exit_router.training.calibrate import (
        DEFAULT_CANDIDATES,
        CalibrationConfig,
        QualityTarget,
        calibrate,
        split_prompts,
    )
    from early_exit_router.training.corpus import CALIBRATION_PROMPTS

    target = QualityTarget(args.target_agreement, args.max_nll_increase, args.min_consistency)
    cfg = CalibrationConfig(
        target=target,
        candidates=tuple(args.candidates or DEFAULT_CANDIDATES),
        method=args.method,
        delta=args.delta,
        objective=args.objective,
        speed_tie_z=args.speed_tie_z,
        max_new_tokens=args.max_new_tokens,
    )
    # The files first: a mistake in them is reported before the model loads and the sweep runs, not after.
    prompts = read_prompts(args.prompts, CALIBRATION_PROMPTS, ("id", "category", "kind", "prompt"))
    check_out_folder(args.out)
    router = EarlyExitRouter.from_pretrained(args.model, **load_options(args), **router_overrides(args))
    print(router.describe(), file=sys.stderr)
    calibration, heldout = split_prompts(prompts)
    result = calibrate(router, calibration, heldout, cfg, progress=not args.quiet)
    print(result.table())
    if result.chosen_threshold is None:
        print("nothing saved: no threshold met the target", file=sys.stderr)
        return 1
    router.save_pretrained(args.out)
    (Path(args.out) / "calibration_report.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(f"saved to {args.out} with high_conf_threshold={router.config.high_conf_threshold:g}")
    return 0
