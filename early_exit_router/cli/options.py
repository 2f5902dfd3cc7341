"""Options and argument types that several commands share. Router options are generated from `RouterConfig`'s fields."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from early_exit_router.config import ADAPTER_KINDS, BATCH_DESIGNS, MODES, POLICIES, RouterConfig
from early_exit_router.models.loading import DEFAULT_MODEL

CHOICES = {"mode": MODES, "adapter": ADAPTER_KINDS, "policy": POLICIES, "batch_design": BATCH_DESIGNS}
DEFAULT_PROMPT = "List the seven days of the week as a numbered list, one per line, nothing else."


ROUTER_GROUP_TITLES = {
    "HeadLayout": "router options: head layout (saved with the heads; a saved router refuses another)",
    "CascadeOptions": "router options: exit rule",
    "DraftingOptions": "router options: drafting",
    "MonitoringOptions": "router options: monitoring",
}
INTERNAL_FIELDS = {"heads_trained"}  # set by training, not by hand


def add_router_options(parser: argparse.ArgumentParser) -> None:
    """One --option per RouterConfig field, grouped as the config groups them, with the field's own help text.
    Unset options keep the saved (or built-in) values. A command's own option of the same name (calibrate's and
    train-heads' --target-agreement) keeps its meaning there and is not read as a router override: add the
    command's options first."""
    fields = {f.name: f for f in dataclasses.fields(RouterConfig)}
    added = []
    for group_name, names in RouterConfig.groups().items():
        group = parser.add_argument_group(f"{ROUTER_GROUP_TITLES[group_name]} (default: the saved or built-in value)")
        for name in names:
            if name not in INTERNAL_FIELDS and _flag(name) not in parser._option_string_actions:
                _add_field(group, fields[name])
                added.append(name)
    parser.set_defaults(router_fields=tuple(added))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    flag = _flag(f.name)
    help_text = f"{f.metadata['help']} ({_default_note(f)})".replace("%", "%%")  # argparse formats help with %
    if f.name in ("exit_layers", "active_exit_layers"):
        group.add_argument(flag, type=int_list, default=None, metavar="E1,E2", help=help_text)
    elif f.name == "exit_adapters":
        group.add_argument(flag, type=kind_map, default=None, metavar="E1:KIND,E2:KIND", help=help_text)
    elif f.name == "holdback":  # None by default (nothing unchecked reaches the caller): a count when given
        group.add_argument(flag, type=int, default=None, metavar="K", help=help_text)
    elif f.type in ("bool", bool):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif f.name in CHOICES:
        group.add_argument(flag, choices=CHOICES[f.name], default=None, help=help_text)
    else:
        kind = int if isinstance(f.default, int) and not isinstance(f.default, bool) else float
        kind = str if isinstance(f.default, str) else kind
        group.add_argument(flag, type=kind, default=None, help=help_text)


def _default_note(f: dataclasses.Field) -> str:
    """What applies when the option is not given. A saved router's value does: say so where the default model's
    shipped heads differ from the built-in value (they run in verify mode, the built-in default is exit)."""
    shipped = shipped_router_config()
    if f.name in shipped and shipped[f.name] != f.default:
        return (
            f"default: the loaded router's saved value, {shipped[f.name]!r} with the shipped {DEFAULT_MODEL} heads; "
            f"{f.default!r} for fresh heads"
        )
    return f"built-in default: {f.default!r}"


@functools.lru_cache(maxsize=1)
def shipped_router_config() -> dict[str, Any]:
    """The routing config saved with the default model's shipped heads (its JSON only: cheap), or {} without them."""
    from early_exit_router.heads.checkpoint import CONFIG_NAME, shipped_checkpoint

    folder = shipped_checkpoint(DEFAULT_MODEL)
    if folder is None:
        return {}
    try:
        return dict(json.loads((folder / CONFIG_NAME).read_text()).get("router_config") or {})
    except (OSError, ValueError, AttributeError):
        return {}


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """--dtype, --device, --quantize and --no-pack-weights, for commands whose speed or numbers depend on where and
    how the model runs (`load_options` reads them back)."""
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="Model dtype (default: float32)."
    )
    parser.add_argument("--device", default=None, help="Device, e.g. cpu or cuda (default: cpu).")
    parser.add_argument(
        "--quantize",
        default=None,
        choices=["int8", "int4", "bnb-8bit", "bnb-4bit"],
        help="Load the base quantized: torchao weight-only int8/int4 (any device) or bitsandbytes (CUDA). In bench "
        "every arm, the plain HF control included, runs the same quantized model.",
    )
    parser.add_argument(
        "--no-pack-weights",
        dest="pack_weights",
        action="store_false",
        help="Keep the router's passes on the model's own matrix products where they would run from prepacked "
        "weights (on a CPU: float32, and bfloat16 where the CPU computes it natively; faster verify passes at about "
        "one more copy of the weights' memory).",
    )


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """The from_pretrained arguments add_load_options added: dtype, device, quantize, pack_weights."""
    check_device(args.device)
    return {"dtype": args.dtype, "device": args.device, "quantize": args.quantize, "pack_weights": args.pack_weights}


def check_device(device: str | None) -> None:
    """Refuse a --device that is no device, or one this machine lacks, before any weight loads: torch would
    otherwise fail deep inside `model.to` (an AssertionError on a build without CUDA)."""
    if device is None:
        return
    import torch

    advice = "pass cpu, or cuda (cuda:N) on a machine with a CUDA GPU and a CUDA build of torch"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device name: {advice}.") from None
    try:
        torch.empty(0, device=parsed)  # initialises the backend, as `model.to` would
    except (RuntimeError, AssertionError) as exc:
        reason = (str(exc).strip().splitlines() or ["unavailable"])[0]
        raise ValueError(f"--device {device!r} cannot be used on this machine ({reason}): {advice}.") from None


def read_prompts(path: str | None, shipped: str, fields: tuple[str, ...] = ("prompt",)) -> list[dict[str, Any]]:
    """The records of a --prompts JSONL file (or the set shipped as `shipped` without one), read before any model loads
    (`load_prompts`: a bad line is refused with its file and line); a file that cannot be read says what to give."""
    from early_exit_router.training.corpus import load_prompts

    try:
        return load_prompts(path, shipped, fields)
    except OSError as exc:
        raise ValueError(
            f"--prompts {path}: cannot read it ({exc.strerror or exc}): give a JSONL file, one JSON object per line."
        ) from None


def add_corpus_options(parser: argparse.ArgumentParser, max_tokens: int, self_gen_tokens: int) -> None:
    """The training text's options (`training/sequences.py`), shared by train-heads and adapt-base."""
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="Corpus size in tokens (default: %(default)s)."
    )
    parser.add_argument(
        "--self-gen-tokens",
        type=int,
        default=self_gen_tokens,
        help="Answer length per training prompt; 0 skips self-generation (default: %(default)s).",
    )
    parser.add_argument("--prompts", default=None, help="JSONL of training prompts (default: the shipped set).")
    parser.add_argument(
        "--generated-prompts",
        type=int,
        default=0,
        help="Also answer this many prompts built offline (templates, package summaries, text to continue).",
    )
    parser.add_argument("--sampled", action="store_true", help="Also add one sampled answer to every prompt.")
    parser.add_argument("--no-docs", action="store_true", help="Do not train on installed packages' READMEs.")
    parser.add_argument("--seed", type=int, default=0, help="Seed (default: %(default)s).")


def corpus_from_args(router: Any, args: argparse.Namespace) -> tuple[list[list[int]], dict[str, Any]]:
    """The training text `add_corpus_options` describes, and its manifest."""
    from early_exit_router.training.sequences import corpus_sequences

    return corpus_sequences(
        router,
        args.max_tokens,
        args.self_gen_tokens,
        args.prompts,
        use_docs=not args.no_docs,
        progress=not args.quiet,
        extra_prompts=args.generated_prompts,
        sampled=args.sampled,
        seed=args.seed,
    )


def check_out_folder(path: str, option: str = "--out") -> None:
    """Refuse, before any model loads or any work is done, an output folder that cannot be created: an existing
    file at `path` or where one of its parent folders would be (the results would otherwise be lost at the end)."""
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(
                    f"{option} {path}: {folder} is a file, not a folder: give a folder (created if missing)."
                )
            return


def check_out_file(path: str, option: str = "--json") -> None:
    """Refuse, before the run, an output file that cannot be written: a folder, or one whose folder is missing."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path} is a folder: give a file name (written at the end of the run).")
    if not target.parent.is_dir():
        raise ValueError(f"{option} {path}: the folder {target.parent} does not exist: create it first.")


def router_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The router options given on the command line (those add_router_options added), by config field."""
    names = getattr(args, "router_fields", [f.name for f in dataclasses.fields(RouterConfig)])
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 10,20, got {text!r}") from None


def kind_map(text: str) -> dict[int, str]:
    """'16:residual_block,24:postnorm' -> {16: 'residual_block', 24: 'postnorm'}."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(layer): kind.strip() for layer, kind in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer:kind pairs like 16:residual_block, got {text!r}"
        ) from None


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 0.5,0.9, got {text!r}") from None
