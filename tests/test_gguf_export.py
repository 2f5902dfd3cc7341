"""`export-draft --gguf`: the GGUF draft reads back as the exported weights (in llama.cpp's layout), carries the
base's tokenizer metadata key for key, refuses what it cannot write exactly, and, where llama-cpp-python is
installed, runs in llama.cpp: its logits are the exit's, its greedy tokens the exit's, and as the SmolLM2 GGUF's
draft it leaves the greedy output unchanged."""

from __future__ import annotations

import itertools
import json
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from early_exit_router import EarlyExitRouter
from early_exit_router.cli import main
from early_exit_router.integrations.export import build_draft
from early_exit_router.integrations.gguf_export import (
    GGUF_FAMILIES,
    copy_tokenizer,
    export_gguf_draft,
    read_tensors,
    rotate_halves_to_pairs,
)
from early_exit_router.models.loading import alias_gguf_path

from .test_export import randomize_adapters

SMOL_VOCAB = 49152


@pytest.fixture(scope="module")
def smol_gguf():
    try:
        return alias_gguf_path("smollm2-135m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def vocab_only_gguf(smol_gguf, tmp_path_factory):
    """SmolLM2's tokenizer metadata alone (no tensors, no dimensions), as llama.cpp's own ggml-vocab-*.gguf files
    are: the vocabulary for tiny test models of SmolLM2's vocabulary size."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    copy_tokenizer(gguf.GGUFReader(smol_gguf), writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def vocab_fields(vocab_only_gguf):
    """The tokenizer keys of the vocabulary file and their values."""
    reader = gguf.GGUFReader(vocab_only_gguf)
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def tiny(family: str, seed: int = 0, tied: bool = False):
    """A 4-layer model of SmolLM2's vocabulary, GQA (4 query heads over 2), random weights."""
    torch.manual_seed(seed)
    shared = dict(
        vocab_size=SMOL_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shared, rope_parameters={"rope_type": "default", "rope_theta": 5e4}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shared, rope_parameters={"rope_type": "default", "rope_theta": 5e4}))
    with torch.no_grad():  # Qwen2's q/k/v biases are zero at init: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval()


def tiny_router(family: str, adapter: str = "postnorm", tied: bool = False) -> EarlyExitRouter:
    router = EarlyExitRouter.from_model(tiny(family, tied=tied), exit_layers=[1, 2], adapter=adapter)
    randomize_adapters(router)
    return router


def hf_order(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """A GGUF q/k tensor back in HF's row order (undoing the converter's permutation)."""
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    rows = tensor.shape[0]
    inverse = tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:]).swapaxes(1, 2)
    return inverse.reshape(tensor.shape)


@pytest.mark.parametrize("family, adapter", [("llama", "postnorm"), ("qwen2", "residual_block")])
def test_gguf_draft_reads_back_as_the_exported_weights(tmp_path, vocab_only_gguf, vocab_fields, family, adapter):
    router = tiny_router(family, adapter)
    info = export_gguf_draft(router, 1, tmp_path / "draft.gguf", vocab_gguf=vocab_only_gguf, tensor_type="f32")
    draft, _, _ = build_draft(router, 1)
    assert (info.arch, info.num_layers, info.adapter) == (family, 3 if adapter == "residual_block" else 2, adapter)
    reader = gguf.GGUFReader(info.path)
    tensors = read_tensors(reader)
    names = gguf.get_tensor_name_map(GGUF_FAMILIES[family].arch, draft.config.num_hidden_layers)
    state = draft.state_dict()
    assert len(tensors) == len(state)  # untied: lm_head is output.weight
    for key, expected in state.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        ours = tensors[name]
        if family == "llama" and (".attn_q." in name or ".attn_k." in name):
            assert not torch.equal(ours, expected)  # the permutation is really applied ...
            ours = hf_order(name, ours, draft.config)  # ... and undoes exactly
        assert torch.equal(ours, expected), key
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields[f"{family}.block_count"] == info.num_layers
    assert fields[f"{family}.attention.head_count_kv"] == 2 and fields[f"{family}.rope.freq_base"] == 5e4
    assert vocab_fields and all(fields[key] == value for key, value in vocab_fields.items())  # key for key
    notes = json.loads((tmp_path / "draft.gguf.json").read_text())
    assert "-md" in notes["llama_cpp"]["llama_server"] and "--spec-draft-n-max 4" in notes["llama_cpp"]["llama_server"]


def test_rotation_matches_llama_cpp_converter_layout():
    """Within a head, rows (0..d/2-1 | d/2..d-1) become interleaved pairs (0, d/2, 1, d/2+1, ...)."""
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)  # 2 heads of dimension 4
    assert rotate_halves_to_pairs(rows, 2).ravel().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("tensor_type, atol", [("bf16", 2e-2), ("q8_0", 3e-2)])
def test_tied_drafts_and_smaller_types(tmp_path, vocab_only_gguf, tensor_type, atol):
    router = tiny_router("llama", adapter="identity", tied=True)
    info = export_gguf_draft(router, 2, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf, tensor_type=tensor_type)
    reader = gguf.GGUFReader(info.path)
    assert "output.weight" not in {t.name for t in reader.tensors}  # llama.cpp reads token_embd for a tied head
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_norm.weight"] == "F32" and kinds["blk.0.ffn_up.weight"] == tensor_type.upper()
    up = read_tensors(reader)["blk.0.ffn_up.weight"]
    torch.testing.assert_close(up, router.model.model.layers[0].mlp.up_proj.weight, atol=atol, rtol=0)


def test_what_cannot_be_written_exactly_is_refused_with_the_fix(tmp_path, vocab_only_gguf):
    from .test_architectures import build

    gpt2 = EarlyExitRouter.from_model(build("gpt2", seed=1), exit_layers=[1, 3], adapter="postnorm")
    with pytest.raises(ValueError, match="known: llama, mistral, qwen2"):
        export_gguf_draft(gpt2, 1, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf)
    router = tiny_router("llama")
    with pytest.raises(ValueError, match="--vocab-gguf"):  # an HF base: no GGUF to copy the tokenizer from
        export_gguf_draft(router, 1, tmp_path / "d.gguf")
    with pytest.raises(ValueError, match="ending in .gguf"):
        export_gguf_draft(router, 1, tmp_path / "d", vocab_gguf=vocab_only_gguf)
    with pytest.raises(ValueError, match="Unknown GGUF tensor type"):
        export_gguf_draft(router, 1, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf, tensor_type="q4_k")
    small = EarlyExitRouter.from_model(
        LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_hidden_layers=3)),
        exit_layers=[1],
        adapter="postnorm",
    )
    with pytest.raises(ValueError, match="49152 tokens and the model 96"):
        export_gguf_draft(small, 1, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf)
    scaled = tiny_router("llama")
    scaled.model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(ValueError, match="'llama3' scaling"):
        export_gguf_draft(scaled, 1, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf)
    assert not (tmp_path / "d.gguf").exists()
    with mock.patch("early_exit_router.integrations.gguf_export._add_tensor", side_effect=OSError("disk full")):
        with pytest.raises(OSError, match="disk full"):
            export_gguf_draft(router, 1, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf)
    assert not (tmp_path / "d.gguf").exists()  # no half-written file left behind


def test_cli_refuses_gguf_options_before_loading(tmp_path, capsys):
    assert main(["export-draft", "--exit-layer", "4", "--out", str(tmp_path / "d"), "--gguf"]) == 2
    assert "ending in .gguf" in capsys.readouterr().err
    assert main(["export-draft", "--exit-layer", "4", "--out", str(tmp_path / "d"), "--gguf-type", "q8_0"]) == 2
    assert "add --gguf" in capsys.readouterr().err
    args = ["export-draft", "--exit-layer", "4", "--out", str(tmp_path / "d.gguf"), "--gguf", "--vocab-gguf", "nope"]
    assert main(args) == 2
    assert "no such file" in capsys.readouterr().err


# --- llama.cpp itself (llama-cpp-python), where installed -------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp():
    """llama-cpp-python, with llama.cpp's weight repacking off (its `--no-repack`): on some virtual machines with
    AMX the repacked kernels stop with an illegal instruction, and repacking changes no result."""
    module = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: ./quickstart.sh test-llama-cpp"
    )
    defaults = module.llama_model_default_params

    def no_repack():
        params = defaults()
        params.use_extra_bufts = False
        return params

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.llama.llama_cpp, "llama_model_default_params", no_repack)
        yield module


def llama(llama_cpp, path, **kwargs):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, seed=0, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_computes_the_exit_heads_logits(tmp_path, vocab_only_gguf, llama_cpp, family):
    """The per-architecture data (names, permutation, hyperparameters) checked numerically by llama.cpp."""
    router = tiny_router(family, adapter="residual_block")
    info = export_gguf_draft(router, 1, tmp_path / "d.gguf", vocab_gguf=vocab_only_gguf, tensor_type="f32")
    draft, _, _ = build_draft(router, 1)
    ids = torch.randint(3, SMOL_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = draft(ids).logits[0]
    model = llama(llama_cpp, info.path, logits_all=True)
    model.eval(ids[0].tolist())
    theirs = torch.from_numpy(np.array(model.scores[: ids.shape[1]], dtype=np.float32))
    torch.testing.assert_close(theirs, ours, atol=2e-3, rtol=1e-3)


@pytest.mark.real_model
def test_smollm2_exit_as_a_llama_cpp_draft(tmp_path, smol_gguf, llama_cpp):
    """The shipped L4 exit as a GGUF: its tensors in the layout of the SmolLM2 GGUF's own, its greedy tokens in
    llama.cpp the exit's, and as the SmolLM2 GGUF's draft in llama.cpp the greedy output is unchanged."""
    router = EarlyExitRouter.from_pretrained("smollm2-135m", warm_up=False)
    info = export_gguf_draft(router, 4, tmp_path / "draft-l4.gguf", tensor_type="f32")
    assert info.vocab_from == str(smol_gguf) and info.num_layers == 5
    ours, source = read_tensors(info.path), read_tensors(smol_gguf)
    for name in ("blk.0.attn_q.weight", "blk.3.attn_k.weight"):  # the converter's layout, tensor for tensor
        torch.testing.assert_close(ours[name], source[name], atol=1e-6, rtol=0)

    prompt_ids = router.encode("List three colours.", chat=True)[0].tolist()
    draft, _, _ = build_draft(router, 4)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        exit_tokens = draft.generate(ids, max_new_tokens=16, do_sample=False)[0, len(prompt_ids) :].tolist()
    small = llama(llama_cpp, info.path)
    ours = list(itertools.islice(small.generate(prompt_ids, temp=0.0, top_k=1), 16))
    assert ours == exit_tokens

    # As the SmolLM2 GGUF's draft (the file the router's base came from): the greedy output is the target's own.
    # llama.cpp checks a draft with its batched kernels and plain decoding runs one token at a time, which round a
    # near-tie apart now and then (measured: 29.424 against 29.396 one by one, 29.386 against 29.261 batched, on
    # "List three colours."; on an AVX2 host the batched run left a top-2 gap of 0.095 behind), so the outputs must
    # agree up to the first such near-tie of the plain run (a gap below 0.25).
    drafter = GGUFDrafter(llama(llama_cpp, info.path), tokens=4)
    plain = llama(llama_cpp, smol_gguf, logits_all=True)
    drafted = llama(llama_cpp, smol_gguf, draft_model=drafter)
    judged = accepted = 0
    for text in ("Write the numbers from one to ten.", "List three colours."):
        ids = router.encode(text, chat=True)[0].tolist()
        expected = list(itertools.islice(plain.generate(ids, temp=0.0, top_k=1), 64))
        scores = np.array(plain.scores[len(ids) - 1 : len(ids) - 1 + len(expected)])
        margins = np.sort(scores, axis=-1)[:, -1] - np.sort(scores, axis=-1)[:, -2]  # the target's top-2 gap
        drafter.proposals.clear()
        ours = list(itertools.islice(drafted.generate(ids, temp=0.0, top_k=1), 64))
        same = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), len(expected))
        assert same == len(expected) or margins[same] < 0.25, (text, same, margins[same])
        assert same >= 16, text
        for start, proposal in drafter.proposals:  # a draft token counts until the first that the output rejects
            if start - len(ids) + len(proposal) > same:
                continue  # past the compared span
            output = expected[start - len(ids) :]
            agreed = sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1], zip(proposal, output)))
            accepted, judged = accepted + agreed, judged + min(len(proposal), agreed + 1)
    assert 0 < accepted < judged  # drafts were proposed, some accepted, some not


class GGUFDrafter:
    """llama-cpp-python's draft-model interface (`LlamaDraftModel`) over a second `Llama`: `tokens` greedy tokens
    from the draft GGUF, its KV cache reused over the common prefix (`generate(reset=True)` keeps it); each
    proposal is kept with the prefix length it continues."""

    def __init__(self, model, tokens: int) -> None:
        self.model, self.tokens, self.proposals = model, tokens, []

    def __call__(self, input_ids, **_):
        draft = list(itertools.islice(self.model.generate(input_ids.tolist(), temp=0.0, top_k=1), self.tokens))
        self.proposals.append((len(input_ids), draft))
        return np.array(draft, dtype=np.intc)
