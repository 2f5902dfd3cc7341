"""The saved-router format: `early_exit_config.json` + `early_exit_heads.safetensors`, heads only.

The JSON records the format version, the router config, the exit heads' layout, and the base model's identity:
its name, depth, widths, a SHA-256 of its LM head and final norm, and samples of the same tensors' values at fixed
positions. Loading onto another base model is refused; the samples let the same weights in another dtype (fp16 vs
fp32) or quantized through, and nothing else: other, permuted or re-scaled weights differ there.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from early_exit_router._version import __version__
from early_exit_router.config import RouterConfig
from early_exit_router.heads.adapted_base import ADAPTED_KEY, adapted_files, check_adapted
from early_exit_router.heads.exit_heads import DRAFT_RANKING, ExitHeads, build_heads
from early_exit_router.models.architecture import LayerStack
from early_exit_router.models.loading import ALIASES, resolve_alias

FORMAT_VERSION = 1
CONFIG_NAME = "early_exit_config.json"
WEIGHTS_NAME = "early_exit_heads.safetensors"
FINGERPRINT_CHUNKS = 32  # routers saved before the samples below were recorded are checked with these chunk means
SAMPLE_SIZE = 512  # values of each shared tensor recorded, at SAMPLE_STRIDE-spread positions
SAMPLE_STRIDE = 2654435761  # a prime near 2**32 / golden ratio: positions spread over rows and columns alike
SAMPLE_TOLERANCE = 0.25  # the largest relative L2 difference accepted (int4 rounding: 0.09; other weights: 1.3)
# Files a router folder may hold beside the two above (reports written by train-heads and calibrate, a README).
KNOWN_EXTRA_FILES = {"calibration_report.json", "training_report.json", "README.md"}


class BaseModelMismatchError(ValueError):
    """The saved heads were trained for another base model."""


def is_router_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def head_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the shared head tensors, rounded to bf16 so fp32 and bf16 copies of one model hash alike."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.bfloat16).contiguous()
        digest.update(name.encode())
        digest.update(t.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def head_fingerprint(tensors: dict[str, torch.Tensor]) -> list[float]:
    """Mean absolute value of FINGERPRINT_CHUNKS slices of each shared tensor: equal up to dtype rounding."""
    values: list[float] = []
    for name in sorted(tensors):
        flat = tensors[name].detach().float().flatten().cpu()
        values.extend(chunk.abs().mean().item() for chunk in flat.chunk(FINGERPRINT_CHUNKS))
    return values


def head_sample(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """SAMPLE_SIZE values of each shared tensor (all of a smaller one) at positions fixed by arithmetic alone, so
    that every release and every torch samples the same ones."""
    sample = {}
    for name in sorted(tensors):
        flat = tensors[name].detach().float().flatten().cpu()
        index = (torch.arange(min(SAMPLE_SIZE, flat.numel()), dtype=torch.long) * SAMPLE_STRIDE) % flat.numel()
        sample[name] = [float(f"{v:.5g}") for v in flat[index].tolist()]
    return sample


def samples_differ(mine: dict[str, list[float]], theirs: dict[str, list[float]]) -> list[str]:
    """The tensors whose samples differ by more than SAMPLE_TOLERANCE (relative L2), or that only one side has."""
    differ = []
    for name in sorted(set(mine) | set(theirs)):
        a, b = torch.tensor(mine.get(name, [])), torch.tensor(theirs.get(name, []))
        if a.shape != b.shape or (a - b).norm() > SAMPLE_TOLERANCE * max(float(a.norm()), 1e-12):
            differ.append(name)
    return differ


@dataclass
class BaseModelIdentity:
    """What a saved router records of the model it was built on."""

    name_or_path: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    head_hash: str
    head_fingerprint: list[float]
    head_sample: dict[str, list[float]] | None = None  # None in routers saved before it was recorded

    def check_matches(self, other: BaseModelIdentity) -> None:
        """Raise BaseModelMismatchError, saying what differs, unless `other` is the same base model."""
        for name in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise BaseModelMismatchError(
                    f"These exit heads were trained for {self.name_or_path!r} ({name} {mine}), but the model has "
                    f"{name} {theirs}. Load them with the base model they were trained for, or train new heads."
                )
        if self.head_hash == other.head_hash:
            return
        if self.head_sample is not None and other.head_sample is not None:
            close = not samples_differ(self.head_sample, other.head_sample)
        else:
            close = len(self.head_fingerprint) == len(other.head_fingerprint) and torch.allclose(
                torch.tensor(self.head_fingerprint), torch.tensor(other.head_fingerprint), rtol=2e-2, atol=1e-5
            )
        if not close:
            raise BaseModelMismatchError(
                f"These exit heads were trained for {self.name_or_path!r}, whose LM head and final norm differ from "
                f"the model's ({other.name_or_path!r}): hash {self.head_hash[:12]} vs {other.head_hash[:12]}. "
                "Load them with the base model they were trained for, or train new heads."
            )


def save_router(
    path: str | Path,
    config: RouterConfig,
    heads: ExitHeads,
    stack: LayerStack,
    name: str,
    adapted: dict[str, Any] | None = None,
) -> None:
    """Write the two files of a saved router into `path` (created if needed; an existing folder may hold only a
    saved router, which is replaced): `heads` (never base weights), `config`, and the identity of `stack`'s base
    model, recorded as `name`. `adapted`: the folder also holds an adapted base (`adapted_base.py`), written first."""
    path = Path(path)
    if path.is_dir() and (unexpected := unexpected_files(path, adapted)):  # e.g. the base model's own folder
        raise ValueError(
            f"{path} holds other files ({', '.join(unexpected[:4])}{', ...' if len(unexpected) > 4 else ''}), "
            "and loading refuses a router folder with files of its own beside it: save to an empty or new folder."
        )
    path.mkdir(parents=True, exist_ok=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "heads": {"exit_layers": list(heads.exit_layers), "gates": len(heads.gates) > 0},
        "router_config": config.to_dict(),
        **({ADAPTED_KEY: adapted} if adapted else {}),
        "base_model": base_identity(stack, name).__dict__,  # last: its value samples run to a thousand lines
    }
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in heads.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt", "format_version": str(FORMAT_VERSION)})
    (path / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def unexpected_files(path: Path, adapted: dict[str, Any] | None = None) -> list[str]:
    """Names in folder `path` that a saved router does not hold (hidden ones, such as a hub's .gitattributes, are
    let be: nothing in the folder but the router's own files is ever read); `adapted`: those of its adapted base
    belong."""
    known = {CONFIG_NAME, WEIGHTS_NAME, *KNOWN_EXTRA_FILES, *adapted_files(path, adapted)}
    return sorted(p.name for p in path.iterdir() if p.name not in known and not p.name.startswith("."))


@dataclass
class SavedRouter:
    config: RouterConfig
    identity: BaseModelIdentity
    exit_layers: list[int]
    has_gates: bool
    tensors: dict[str, torch.Tensor]
    adapted: dict[str, Any] | None = None  # the folder holds an adapted base (`adapted_base.py`)
    path: Path | None = None  # the folder it was read from

    def check_layout(self, config: RouterConfig, overrides: dict[str, Any]) -> None:
        """Refuse a config (and field overrides) whose head layout is not these heads' own: they would not exist."""
        fixed = {"exit_layers": self.exit_layers, "adapter": self.config.adapter}
        fixed.update(adapter_rank=self.config.adapter_rank, exit_adapters=self.config.exit_adapters)
        for key, value in fixed.items():
            if overrides.get(key, value) != value or getattr(config, key) != value:
                raise ValueError(
                    f"The saved heads have {key}={value!r}; they cannot be loaded with another {key}. To change "
                    "routing settings only, pass them as keywords (from_pretrained(path, mode='exit')), which keep "
                    "the heads' layout; for another layout, train new heads."
                )

    def config_for(self, config: RouterConfig | None, overrides: dict[str, Any]) -> RouterConfig:
        """The config these heads route under: `config` (default: their own) with `overrides`, its head layout
        theirs (`check_layout`), and `heads_trained` as they were saved, whatever config routes them."""
        base = config or self.config
        self.check_layout(base, overrides)
        routed = base.replace(**overrides) if overrides else base
        return routed.replace(heads_trained=self.config.heads_trained)


def load_router(path: str | Path) -> SavedRouter:
    """Read a saved router folder, with a clear error for every way it can be broken.

    Missing files, unreadable JSON, a format version from another release, unexpected files (a pickle beside the
    heads is refused, never opened), a truncated or garbled safetensors file, and tensors that are not floating
    point all raise before any model is touched. Weights are read with safetensors only: nothing is unpickled.
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: a saved router folder holds {CONFIG_NAME} and {WEIGHTS_NAME}.")
    try:
        meta: dict[str, Any] = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_file} is not valid JSON ({exc}): re-save the router with save_pretrained.") from None
    adapted = check_adapted(meta.get(ADAPTED_KEY), path) if isinstance(meta, dict) else None
    if unexpected := unexpected_files(path, adapted):
        raise ValueError(
            f"{path} holds unexpected files {unexpected}: a saved router folder holds only {CONFIG_NAME}, "
            f"{WEIGHTS_NAME} and the reports {sorted(KNOWN_EXTRA_FILES)} (and an adapted base's own files). Move "
            "the other files elsewhere (nothing else is ever loaded from it, and pickles are never opened)."
        )
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{config_file} has format_version {version!r}; this early-exit-router reads version {FORMAT_VERSION}. "
            "Upgrade the package (or re-save the router with this version)."
        )
    try:
        config = RouterConfig.from_dict(meta["router_config"])
        identity = BaseModelIdentity(**meta["base_model"])
        exit_layers = [int(e) for e in meta["heads"]["exit_layers"]]
        has_gates = bool(meta["heads"]["gates"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{config_file} lacks or garbles a required entry ({exc!r}): re-save the router.") from None
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own error types for truncated and garbled files
        raise ValueError(
            f"{weights_file} could not be read as safetensors ({type(exc).__name__}: {exc}); the file is truncated "
            "or corrupt: copy it again or re-save the router."
        ) from None
    bad = sorted(k for k, v in tensors.items() if not v.is_floating_point() and k != DRAFT_RANKING)
    if bad:
        raise ValueError(f"{weights_file} holds non-float tensors {bad}: exit heads are floating-point weights.")
    ranking = tensors.get(DRAFT_RANKING)
    if ranking is not None and (ranking.is_floating_point() or ranking.dim() != 1):
        raise ValueError(f"{weights_file}: {DRAFT_RANKING} must be a 1-D integer tensor of token ids; re-save it.")
    return SavedRouter(config, identity, exit_layers, has_gates, tensors, adapted, path)


def shipped_checkpoint(alias: str) -> Path | None:
    """The folder of trained heads shipped for `alias`, from an installed wheel or a checkout, if any."""
    entry = ALIASES.get(alias)
    if entry is None or entry.checkpoint is None:
        return None
    candidates: list[Path] = []
    try:
        candidates.append(Path(str(resources.files("early_exit_router.checkpoints"))) / entry.checkpoint)
    except ModuleNotFoundError:
        pass
    candidates.append(Path(__file__).resolve().parents[2] / "checkpoints" / entry.checkpoint)
    return next((c for c in candidates if is_router_dir(c)), None)


def saved_router(name_or_path: str) -> SavedRouter | None:
    """The saved router at `name_or_path`: a folder written by `save_pretrained`, or an alias's shipped heads;
    None when there is none (a plain base model)."""
    if is_router_dir(name_or_path):
        return load_router(name_or_path)
    alias = resolve_alias(name_or_path)
    shipped = shipped_checkpoint(alias) if alias is not None else None
    return load_router(shipped) if shipped is not None else None


def saved_base(path: str, saved: SavedRouter) -> str:
    """Where the base model of the router saved at `path` loads from: the name it recorded, a local path or an alias
    here (a hub id, or a folder elsewhere, is refused with what to do); a merged adapted base, the folder itself."""
    if saved.adapted and saved.adapted["format"] == "merged":
        return path
    source = saved.identity.name_or_path
    if Path(source).exists() or resolve_alias(source) is not None:
        return source
    if saved.adapted:
        raise FileNotFoundError(
            f"The adapted base saved at {path} is a LoRA on {source!r}, which is neither a local path nor an alias "
            "here (models are never downloaded). Put that base model at the path it was recorded under, or run "
            "adapt-base again with --merge where the base is, which writes a folder that loads on its own."
        )
    raise FileNotFoundError(
        f"The router saved at {path} was trained on {source!r}, which is neither a local path nor an alias here "
        "(models are never downloaded). Load that model yourself and put the heads on it: "
        f"EarlyExitRouter.from_model(model, tokenizer, heads={str(path)!r})."
    )


def heads_from_saved(saved: SavedRouter, stack: LayerStack, config: RouterConfig, name: str) -> ExitHeads:
    """`saved`'s trained heads (adapters, gates, draft ranking) built on `stack`'s base model, which must be the
    one they were trained for; on its device and in its dtype."""
    saved.identity.check_matches(base_identity(stack, name))
    heads = build_heads(stack, config, saved.exit_layers)
    if saved.has_gates:  # the saved weights say which features the gates were trained with
        heads.add_gates(
            stack.hidden_size,
            context=any(k.endswith(".context.weight") for k in saved.tensors),
            head=any(k.endswith(".head.weight") for k in saved.tensors),
        )
    if DRAFT_RANKING in saved.tensors:
        try:
            heads.set_draft_token_ranking(saved.tensors[DRAFT_RANKING], stack.vocab_size)
        except ValueError as exc:
            raise ValueError(
                f"The saved heads' draft token ranking is broken: {exc} Re-save or retrain them."
            ) from None
    expected = heads.state_dict()
    wrong = {
        k: (tuple(v.shape), tuple(expected[k].shape))
        for k, v in saved.tensors.items()
        if k in expected and v.shape != expected[k].shape
    }
    if wrong:
        raise ValueError(
            f"Saved head tensors have the wrong shapes (saved, expected): {wrong}. The heads file does not belong "
            "to this config or base model: re-save or retrain the heads."
        )
    missing, unexpected = heads.load_state_dict(saved.tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"Saved heads do not fit their config: missing {missing}, unexpected {unexpected}.")
    heads.to(device=stack.device, dtype=stack.dtype).eval()
    return heads


def saved_heads(name_or_path: str | Path, stack: LayerStack, name: str) -> ExitHeads:
    """The trained heads saved at `name_or_path` (a `save_pretrained` folder, or an alias with shipped heads) under
    their own config, built on `stack`'s base model (recorded as `name`), which must be theirs."""
    saved = saved_router(str(name_or_path))
    if saved is None:
        raise ValueError(
            f"{str(name_or_path)!r} holds no saved exit heads: pass a folder written by save_pretrained "
            "(or train-heads), or an alias with shipped heads."
        )
    if saved.adapted:
        raise ValueError(
            f"{name_or_path} holds an adapted base (adapt-base): its exits are the adapted model's own head, not "
            "heads for this base. Load it with EarlyExitRouter.from_pretrained; warm-start from a train-heads folder."
        )
    return heads_from_saved(saved, stack, saved.config, name)


def base_identity(stack: LayerStack, name: str) -> BaseModelIdentity:
    """What a saved router records of `stack`'s model (and checks again on load)."""
    tensors = stack.shared_head_tensors()
    return BaseModelIdentity(
        name_or_path=name,
        model_type=str(stack.config.model_type),
        num_hidden_layers=stack.num_layers,
        hidden_size=stack.hidden_size,
        vocab_size=stack.vocab_size,
        head_hash=head_hash(tensors),
        head_fingerprint=head_fingerprint(tensors),
        head_sample=head_sample(tensors),
    )
