"""`export-draft`: one exit as a standalone HF checkpoint, for serving engines that take a separate draft model.

No serving engine runs per-token exits; vLLM (`speculative_config={"method": "draft_model", ...}`) and SGLang
(`--speculative-algorithm STANDALONE`) accept a separate draft model. The draft is the first `E + 1` layers of the
base model (exit layer `E`), its embeddings, final norm and LM head, in the base model's own architecture and
dtype, so any engine that serves the base model also loads the draft.

The exit's adapter must fold into stock modules exactly: the logit lens (`identity`) needs nothing, the
`postnorm` adapter `M` becomes the LM head `lm_head.weight @ M` (the head is then untied from the embeddings), and
a `block` adapter is a decoder layer of the model's own class, so it becomes the draft's last layer (`E + 2` layers),
and a `residual_block` is both: its per-channel scales fold into the layer's residual projections and its post-norm
map into the LM head. Adapters before the final norm (`linear`, `lowrank`) cannot be folded through the
normalisation, so they are refused rather than exported approximately.

The folder is what those engines read: `config.json` in the base's architecture class with the base's vocabulary
(vLLM refuses a draft whose vocabulary size differs), the safetensors weights, `generation_config.json`, and the
base's tokenizer files, so that the folder also loads on its own (transformers' `assistant_model`, which
`tests/test_export.py` runs against the base). Both engines tokenize with the target's tokenizer. transformers 5
writes RoPE settings only as `rope_parameters`, which transformers 4 does not read (a 4.x config falls back to its
default `rope_theta`, silently giving a draft that disagrees more); the export adds the 4.x fields beside them, and
names the tokenizer class by a name both versions know.
"""

from __future__ import annotations

import copy
import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from early_exit_router.heads.block import BLOCK_KINDS
from early_exit_router.models import _compat
from early_exit_router.models.sizes import kv_bytes_per_position

FOLDABLE_ADAPTERS = ("identity", "postnorm", "block", "residual_block")
# SGLang's server_args.py: `if self.speculative_algorithm == "STANDALONE": reserved_mem += 6 * 1024` (MiB; EAGLE
# drafts add 2 * 1024), applied when --mem-fraction-static is left to SGLang.
SGLANG_STANDALONE_RESERVE_MIB = 6 * 1024


@dataclass
class DraftExport:
    """What `export_draft` wrote."""

    path: str
    exit_layer: int
    num_layers: int  # layers kept (exit_layer + 1), and the block adapter's (exit_layer + 2)
    base_layers: int
    adapter: str
    parameters: int  # of the draft (tied embeddings counted once)
    bytes: int  # parameter memory of the draft in its dtype
    dtype: str
    base: str = "BASE"  # the model the draft serves beside (the folder its layers came from), when known
    kv_bytes_per_token: int = 0  # the draft's own KV cache per position, allocated beside the target's
    router_bytes: int = 0  # what the one-model router adds instead: exit heads, gates and the trimmed draft head

    def engine_memory(self) -> dict[str, str]:
        """What each engine sets aside for this draft, beside what the router itself needs (`memory`)."""
        mib = 2**20
        own = f"{self.bytes / mib:.0f} MiB of draft weights + {self.kv_bytes_per_token / 1024:.1f} KiB of KV per token"
        return {
            "vllm": f"{own}, inside --gpu-memory-utilization: no fixed reserve, the target's KV pool shrinks by them",
            "sglang": f"{own}; STANDALONE adds {SGLANG_STANDALONE_RESERVE_MIB} MiB to the reserve it keeps outside "
            "--mem-fraction-static (when that is not set) for the draft's weights, its KV pool (as many tokens as "
            "the target's) and its CUDA graphs",
            "llama.cpp": f"{own}, for the draft's own context beside the target's",
            "router": f"{self.router_bytes / mib:.1f} MiB (exit heads, gates, trimmed draft head), no second KV cache",
        }

    def serving_snippets(self, draft_tokens: int = 4) -> dict[str, str]:
        """How to run the draft beside its base model: vLLM (Python and `vllm serve`), SGLang, transformers.

        `draft_tokens` is how many tokens the draft proposes per verification (vLLM's `num_speculative_tokens`,
        SGLang's `--speculative-num-steps`, with `--speculative-num-draft-tokens` one more for a chain of topk 1).
        """
        check_draft_tokens(draft_tokens)
        spec = {"method": "draft_model", "model": self.path, "num_speculative_tokens": draft_tokens}
        return {
            "vllm": f"LLM(model={self.base!r}, speculative_config={spec!r})",
            "vllm_serve": f"vllm serve {shlex.quote(self.base)} --speculative-config {shlex.quote(json.dumps(spec))}",
            "sglang": (
                f"python -m sglang.launch_server --model-path {shlex.quote(self.base)} "
                f"--speculative-algorithm STANDALONE --speculative-draft-model-path {shlex.quote(self.path)} "
                f"--speculative-num-steps {draft_tokens} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {draft_tokens + 1}"
            ),
            "transformers": (
                f"AutoModelForCausalLM.from_pretrained({self.base!r}).generate(input_ids, do_sample=False, "
                f"assistant_model=AutoModelForCausalLM.from_pretrained({self.path!r}))"
            ),
        }


def check_draft_tokens(draft_tokens: int) -> None:
    """Refuse a draft length under 1 for the serving commands."""
    if draft_tokens < 1:
        raise ValueError(f"draft_tokens must be at least 1, got {draft_tokens}.")


def build_draft(router: Any, exit_layer: int) -> tuple[torch.nn.Module, str, int]:
    """Exit `exit_layer` of `router` as a model of the base's own class (its adapter folded in), with the adapter
    kind and the base's depth: what `export_draft` saves as an HF folder and `export_gguf_draft` as a GGUF file."""
    if exit_layer not in router.exit_layers:
        raise ValueError(f"Layer {exit_layer} has no exit head; exit layers are {router.exit_layers}.")
    if router.stack.quantized:
        raise ValueError(
            "export-draft writes a dense HF checkpoint and the base model has quantized weights: export from the "
            "unquantized model (the heads load onto it unchanged), then quantize the draft model if you wish."
        )
    adapter_kind = router.heads.kinds[exit_layer]
    if adapter_kind not in FOLDABLE_ADAPTERS:
        raise ValueError(
            f"The {adapter_kind!r} adapter sits before the final norm and cannot be folded into a standard "
            f"checkpoint exactly. Export heads trained with --adapter postnorm (or the logit lens, "
            f"--adapter identity); adapters that fold: {', '.join(FOLDABLE_ADAPTERS)}."
        )
    model, stack, spec = router.model, router.stack, router.stack.spec
    block = adapter_kind in BLOCK_KINDS
    keep = exit_layer + 1
    config = copy.deepcopy(model.config)
    base_layers = config.num_hidden_layers
    if block:
        if exit_layer + 1 >= base_layers:
            raise ValueError("A block exit at the last layer has no layer slot to export into; export another exit.")
        keep += 1  # the block (a copy of layer exit_layer + 1, trained) takes that layer's place
    for name, value in list(vars(config).items()):  # per-layer lists (layer_types, ...) follow the depth
        if isinstance(value, list) and len(value) == base_layers:
            setattr(config, name, value[:keep])
    config.num_hidden_layers = keep
    adapter = router.heads.adapter(exit_layer)
    post = adapter if adapter_kind == "postnorm" else getattr(adapter, "post", None)
    folded = post is not None
    if folded:
        config.tie_word_embeddings = False

    state = {}
    layer_prefix = spec.layers + "."
    for key, tensor in model.state_dict().items():
        if key.startswith(layer_prefix) and int(key[len(layer_prefix) :].split(".", 1)[0]) >= keep:
            continue
        state[key] = tensor
    if block:
        prefix = f"{layer_prefix}{exit_layer + 1}."
        for key, tensor in adapter.folded_block_state().items():  # a plain block has no scales to fold
            state[prefix + key] = tensor
    if folded:
        matrix = post.folded_matrix()
        with torch.no_grad():  # (vocab, hidden) @ (hidden, hidden): lm_head(M x) == (W M) x
            state[f"{spec.lm_head}.weight"] = (stack.lm_head.weight.float() @ matrix.float()).to(stack.dtype)

    draft = type(model)(config).to(dtype=stack.dtype)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == f"{spec.lm_head}.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"Draft checkpoint does not fit its config: missing {missing}, unexpected {unexpected}.")
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval(), adapter_kind, base_layers


def export_draft(router: Any, exit_layer: int, out: str | Path) -> DraftExport:
    """Write exit `exit_layer` of `router` as a standalone HF model folder at `out` (model, tokenizer, notes)."""
    draft, adapter_kind, base_layers = build_draft(router, exit_layer)
    out = Path(out)
    draft.save_pretrained(out)
    _compat.add_legacy_config_fields(out / "config.json")
    if router.tokenizer is not None:
        router.tokenizer.save_pretrained(out)
        _compat.portable_tokenizer_class(out)
    params = {id(p): p for p in draft.parameters()}.values()
    result = DraftExport(
        path=str(out.resolve()),
        exit_layer=exit_layer,
        num_layers=draft.config.num_hidden_layers,
        base_layers=base_layers,
        adapter=adapter_kind,
        parameters=sum(p.numel() for p in params),
        bytes=sum(p.numel() * p.element_size() for p in params),
        dtype=str(router.stack.dtype).replace("torch.", ""),
        base=_base_path(router.model),
        kv_bytes_per_token=sum(kv_bytes_per_position(router.stack)[: draft.config.num_hidden_layers]),
        router_bytes=sum(
            router.heads.nbytes(router.stack, router.config.draft_vocab_size, router.config.half_draft_head)
        ),
    )
    info = {
        **asdict(result),
        "source": router.name_or_path,
        "serving": result.serving_snippets(),
        "memory": result.engine_memory(),
    }
    (out / "draft_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return result


def _base_path(model: Any) -> str:
    """Where the base model's weights were loaded from (a local folder or a Hub id), for the serving commands: the
    draft's layers are that checkpoint's, so the engine should serve that one beside it."""
    return str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "BASE")
