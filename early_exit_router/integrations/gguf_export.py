"""`export-draft --gguf`: one exit as a GGUF file, the draft model llama.cpp loads beside the full model's GGUF.

llama.cpp runs no per-token exits either, but its speculative decoding takes a second, smaller model
(`--spec-draft-model` / `-md`). The draft is the model `export.build_draft` builds (the first `E + 1` layers, the
adapter folded into stock modules), written with the `gguf` package's own writer and tensor-name tables, the ones
llama.cpp's converter uses, so no GGUF byte is written by hand here.

What llama.cpp needs beyond the weights:
- **The same vocabulary as the target.** llama.cpp refuses a draft whose token texts, vocabulary type or BOS/EOS
  settings differ from the target's. The tokenizer metadata is therefore copied, key for key, from a GGUF of the
  base model (`vocab_gguf`; by default the file the router's base was loaded from), and the copied file's
  dimensions are checked against the draft's: a vocabulary taken from another model is refused.
- **llama.cpp's layout of the query and key rows.** Its `llama` graph rotates interleaved pairs where HF Llama rotates
  halves, so llama.cpp's converter permutes the rows of `q_proj` and `k_proj`; the same permutation is applied
  here (`GGUFFamily.rotate_halves_to_pairs`). Qwen2's graph rotates halves as HF does.
- **Norms in float32**, as llama.cpp's converter writes them; matrices in the chosen `tensor_type`.

Families are data (`GGUF_FAMILIES`); one that is not listed is refused with the list, and so is RoPE scaling, which
llama.cpp's converter writes as extra tensors this module does not produce.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from early_exit_router.integrations.export import build_draft, check_draft_tokens
from early_exit_router.models.loading import source_gguf


@dataclass(frozen=True)
class GGUFFamily:
    """How one HF `model_type` is written for llama.cpp."""

    arch: gguf.MODEL_ARCH
    rotate_halves_to_pairs: bool  # permute q/k rows as llama.cpp's converter does for its interleaved RoPE


GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily(gguf.MODEL_ARCH.LLAMA, rotate_halves_to_pairs=True),
    "mistral": GGUFFamily(gguf.MODEL_ARCH.LLAMA, rotate_halves_to_pairs=True),  # llama.cpp runs it as llama
    "qwen2": GGUFFamily(gguf.MODEL_ARCH.QWEN2, rotate_halves_to_pairs=False),
}

# tensor_type -> (GGML type of the matrices, llama.cpp's file type). 1-D tensors (norms, biases) stay float32.
TENSOR_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Dimensions the copied vocabulary's file must share with the draft (key suffix after "<arch>.", config field).
_SHARED_DIMENSIONS = (("embedding_length", "hidden_size"), ("attention.head_count", "num_attention_heads"))


@dataclass
class GGUFDraftExport:
    """What `export_gguf_draft` wrote."""

    path: str
    exit_layer: int
    num_layers: int
    base_layers: int
    adapter: str
    arch: str
    tensor_type: str
    parameters: int
    bytes: int  # the file's size
    vocab_from: str  # the GGUF whose tokenizer metadata was copied

    def llama_cpp_commands(self, target: str = "BASE.gguf", draft_tokens: int = 4) -> dict[str, str]:
        """llama.cpp commands that serve `target` with this file as its draft. Today's builds name the draft type
        (`--spec-type draft-simple`; `-md` alone no longer enables it) and its length (`--spec-draft-n-max`); the
        older flags (`--draft-max`, `--draft-min`) now fail with "the argument has been removed"."""
        check_draft_tokens(draft_tokens)
        spec = f"-md {shlex.quote(self.path)} --spec-type draft-simple --spec-draft-n-max {draft_tokens}"
        return {
            "llama_server": f"llama-server -m {shlex.quote(target)} {spec}",
            "llama_cli": f"llama-cli -m {shlex.quote(target)} {spec}",
            "llama_server_older": f"llama-server -m {shlex.quote(target)} -md {shlex.quote(self.path)} "
            f"--draft-max {draft_tokens}",
        }


def export_gguf_draft(
    router: Any,
    exit_layer: int,
    out: str | Path,
    *,
    vocab_gguf: str | Path | None = None,
    tensor_type: str = "f16",
) -> GGUFDraftExport:
    """Write exit `exit_layer` of `router` as a GGUF draft model at `out` (a `.gguf` file).

    `vocab_gguf`: a GGUF of the base model (the one llama.cpp serves as the target) to copy the tokenizer from;
    by default the file the router's base was loaded from. `tensor_type`: one of `TENSOR_TYPES`.
    """
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"Unknown GGUF tensor type {tensor_type!r}: use one of {', '.join(TENSOR_TYPES)}.")
    model_type = router.model.config.model_type
    family = GGUF_FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"GGUF export knows no layout for model type {model_type!r} (known: {', '.join(GGUF_FAMILIES)}). "
            "Export an HF folder instead (without --gguf) and convert it with llama.cpp's convert_hf_to_gguf.py."
        )
    rope = dict(router.model.config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"GGUF export writes plain RoPE; this model uses {rope['rope_type']!r} scaling. Export an HF folder "
            "instead (without --gguf) and convert it with llama.cpp's convert_hf_to_gguf.py."
        )
    out = Path(out)
    if out.suffix != ".gguf":
        raise ValueError(f"A GGUF draft is one file: give --out a name ending in .gguf, not {str(out)!r}.")
    vocab_path = _vocab_source(router, vocab_gguf)
    reader = gguf.GGUFReader(vocab_path)
    _check_vocab_matches(reader, vocab_path, router.model.config)
    draft, adapter_kind, base_layers = build_draft(router, exit_layer)
    config = draft.config
    arch_name = gguf.MODEL_ARCH_NAMES[family.arch]

    matrix_type, file_type = TENSOR_TYPES[tensor_type]
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch_name)
    try:  # the writer opens `out` at its first write
        _write_hyperparameters(writer, config, rope, file_type, exit_layer)
        copy_tokenizer(reader, writer)
        names = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
        parameters = 0
        for key, tensor in draft.state_dict().items():
            if key == "lm_head.weight" and config.tie_word_embeddings:
                continue  # llama.cpp falls back to token_embd for a missing output.weight
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"No GGUF name for tensor {key!r} of a {model_type} model.")
            data = tensor.detach().float().cpu().numpy()
            if family.rotate_halves_to_pairs and key.endswith(("q_proj.weight", "q_proj.bias")):
                data = rotate_halves_to_pairs(data, config.num_attention_heads)
            elif family.rotate_halves_to_pairs and key.endswith(("k_proj.weight", "k_proj.bias")):
                data = rotate_halves_to_pairs(data, config.num_key_value_heads)
            parameters += data.size
            _add_tensor(writer, name, data, matrix_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)  # no half-written draft left where llama.cpp would load it
        raise
    writer.close()
    result = GGUFDraftExport(
        path=str(out.resolve()),
        exit_layer=exit_layer,
        num_layers=config.num_hidden_layers,
        base_layers=base_layers,
        adapter=adapter_kind,
        arch=arch_name,
        tensor_type=tensor_type,
        parameters=parameters,
        bytes=out.stat().st_size,
        vocab_from=str(vocab_path),
    )
    info = {**asdict(result), "llama_cpp": result.llama_cpp_commands(str(vocab_path))}
    out.with_name(out.name + ".json").write_text(json.dumps(info, indent=2) + "\n")
    return result


def rotate_halves_to_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows: within each head, HF's rotate-half order (first half, second
    half) becomes interleaved pairs. Shape (heads * head_dim, ...) in and out."""
    shape = weight.shape
    # (heads, 2, head_dim / 2, ...) -> (heads, head_dim / 2, 2, ...) -> back to (heads * head_dim, ...)
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _vocab_source(router: Any, vocab_gguf: str | Path | None) -> Path:
    if vocab_gguf is not None:
        path = Path(vocab_gguf).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--vocab-gguf {path}: no such file. Give the GGUF llama.cpp serves as the target.")
        return path
    path = source_gguf(router.name_or_path)
    if path is None:
        raise ValueError(
            f"The base {router.name_or_path!r} was not loaded from a GGUF file, so there is no tokenizer to copy: "
            "pass --vocab-gguf with the base model's GGUF (the file llama.cpp serves as the target), since "
            "llama.cpp accepts a draft only with the target's exact vocabulary."
        )
    return path


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _check_vocab_matches(reader: gguf.GGUFReader, path: Path, config: Any) -> None:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path} has no tokenizer metadata (tokenizer.ggml.tokens) to copy.")
    if len(tokens) != config.vocab_size:
        raise ValueError(
            f"{path} has {len(tokens)} tokens and the model {config.vocab_size}: it is not a GGUF of this base "
            "model. Pass --vocab-gguf with the base's own GGUF."
        )
    arch = _field(reader, "general.architecture")
    for suffix, attribute in _SHARED_DIMENSIONS:
        theirs = _field(reader, f"{arch}.{suffix}")
        if theirs is not None and theirs != getattr(config, attribute):
            raise ValueError(
                f"{path} has {arch}.{suffix} = {theirs} and the model {attribute} = {getattr(config, attribute)}: "
                "it is not a GGUF of this base model. Pass --vocab-gguf with the base's own GGUF."
            )


def _write_hyperparameters(
    writer: gguf.GGUFWriter, config: Any, rope: dict[str, Any], file_type: gguf.LlamaFileType, exit_layer: int
) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"{config._name_or_path or config.model_type} early exit {exit_layer} draft")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    if head_dim * config.num_attention_heads != config.hidden_size:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every `tokenizer.*` key of `reader`, with its GGUF value type (arrays keep their element type)."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)


def _add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, matrix_type: gguf.GGMLQuantizationType) -> None:
    kind = matrix_type if data.ndim > 1 else gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if data.shape[-1] % block:  # rows a block does not divide stay in f16, as llama.cpp's converter leaves them
        kind = gguf.GGMLQuantizationType.F16
    if kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data.astype(np.float32))
    elif kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)


def read_tensors(source: str | Path | gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file (a path, or a reader of one) as float32, dequantized, in HF's (rows, columns)
    order, by GGUF name."""
    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)
    out = {}
    for tensor in reader.tensors:
        data = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        out[tensor.name] = torch.from_numpy(data).reshape(tuple(reversed(tensor.shape.tolist())))
    return out
