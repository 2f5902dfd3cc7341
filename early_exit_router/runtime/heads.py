"""Exit heads: a small residual adapter per exit layer, around the model's own final norm and LM head.

Adapters are zero-initialised residual maps, so an untrained head is exactly the logit lens
(`lm_head(final_norm(h_e))`). Only the adapters (and optional learned gates) are parameters of their own: the final
norm and LM head are the base model's, shared and never copied.

The `block` adapter is one decoder block at the exit (Kangaroo's adapter): a copy of the model's own layer after
the exit, trained to stand in for all the layers after it. Its attention needs the context, so it keeps a small KV
cache of its own per sequence (`BlockContext`) and is run over whole chunks in training. The `residual_block`
scales that block's residual writes per channel from zero and adds a post-norm map, so it starts as exactly a
`postnorm` head. Each exit has its own kind (`RouterConfig.exit_adapters`): the shipped heads spend a block where
it buys the most.

Most adapters sit before the final norm (`lm_head(final_norm(A h))`, tuned-lens style). The `postnorm` adapter sits
after it (`lm_head(M final_norm(h))`, no bias), which is what lets `export-draft` fold it exactly into a standalone
checkpoint's LM head (`lm_head.weight @ M`); a map before a normalisation cannot be folded into stock modules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from early_exit_router.models import _compat
from early_exit_router.models.architecture import dense

DRAFT_RANKING = "draft_ranking"  # state_dict key of ExitHeads' token ranking for the trimmed draft head
BLOCK_KINDS = ("block", "residual_block")  # adapter kinds built from a copy of the model's own layer


class IdentityAdapter(nn.Module):
    """No parameters: the logit lens."""

    post_norm = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class LinearAdapter(nn.Module):
    """`h + W h + b`, zero-initialised (tuned-lens style translator)."""

    post_norm = False

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(hidden)


class LowRankAdapter(nn.Module):
    """`h + B A h + b` with rank r; `B` and `b` start at zero so the untrained head is the logit lens."""

    post_norm = False

    def __init__(self, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=True)
        nn.init.normal_(self.down.weight, std=hidden_size**-0.5)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.up(self.down(hidden))


class PostNormAdapter(nn.Module):
    """`x + W x` on the final norm's output, zero-initialised and without bias, so that it folds into the LM head."""

    post_norm = True

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return normed + self.proj(normed)

    def folded_matrix(self) -> torch.Tensor:
        """M = I + W, so that `lm_head(M x) = (lm_head.weight @ M) x`."""
        eye = torch.eye(self.proj.weight.shape[0], dtype=self.proj.weight.dtype, device=self.proj.weight.device)
        return eye + self.proj.weight


class BlockAdapter(nn.Module):
    """One decoder block of the model's own class at the exit, with the model's final norm and LM head after it.

    Built as a copy of the layer after the exit (so that it starts as "one more layer" rather than as the logit
    lens) and trained by self-distillation to predict the full model's next token. Its attention reads its own KV
    cache (layer 0 of a cache of its own), never the model's.

    With `writers` (a `residual_block`), the outputs of the block's projections that write into the residual stream
    (attention's output projection, the MLP's down projection: `residual_writers`) are scaled per channel by `mix`,
    zero at the start, and a post-norm map (`post`) follows the final norm. The adapter then starts as exactly a
    `postnorm` head (which it can be warm-started from), training only adds what the block contributes, and both
    scales fold into the layer's own weights (`folded_block_state`), so export-draft writes a stock layer.
    """

    post_norm = False
    needs_context = True

    def __init__(self, block: nn.Module, mask_kind: str, writers: list[str] | None = None, width: int = 0) -> None:
        super().__init__()
        self.block = block
        self.mask_kind = mask_kind
        self.writers = list(writers or [])
        self.mix = nn.Parameter(torch.zeros(len(self.writers), width)) if self.writers else None
        self.post = PostNormAdapter(width) if self.writers else None
        for module in block.modules():  # the block's keys and values go to layer 0 of its own cache
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0

    def forward(
        self, hidden: torch.Tensor, stack: Any, cache: Any = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(b, m, hidden) exit states -> (b, m, hidden). `cache` holds the block's keys and values of the positions
        before these (None: the chunk is the whole context); `positions` (b, m) default to the ones after them."""
        if positions is None:
            first = 0 if cache is None else cache.get_seq_length(0)
            positions = torch.arange(first, first + hidden.shape[1], device=hidden.device).unsqueeze(0)
        # The scales act through hooks that live only for this call, so the block stays a stock module otherwise
        # (its state_dict, deep copies and export see plain weights and `mix` beside them).
        handles = [
            self.block.get_submodule(name).register_forward_hook(_ScaleOutput(self.mix[i]))
            for i, name in enumerate(self.writers)
        ]
        try:
            return stack.run_module(self.block, self.mask_kind, hidden, cache, positions)
        finally:
            for handle in handles:
                handle.remove()

    def folded_block_state(self) -> dict[str, torch.Tensor]:
        """The block's state_dict with `mix` folded into its residual writers' weights (and biases): a stock layer
        that computes exactly what this adapter's block does."""
        state = dict(self.block.state_dict())
        with torch.no_grad():
            for i, name in enumerate(self.writers):
                module = self.block.get_submodule(name)
                scale = self.mix[i].to(module.weight.dtype)
                axis = _output_axis(module, scale.numel())
                state[f"{name}.weight"] = module.weight * (scale[:, None] if axis == 0 else scale[None, :])
                if getattr(module, "bias", None) is not None:
                    state[f"{name}.bias"] = module.bias * scale
        return state


class _ScaleOutput:
    """Forward hook: the module's output times a per-channel scale."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * self.scale.to(output.dtype)


def _projections(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, leaf module) of every leaf inside `module` with a 2-D weight, in registration order."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if not any(True for _ in m.children()) and getattr(getattr(m, "weight", None), "ndim", 0) == 2
    ]


def _output_axis(module: nn.Module, width: int) -> int:
    """Which axis of a projection's 2-D weight indexes its `width` outputs (0 for nn.Linear, 1 for GPT-2's Conv1D),
    found by probing: scaling the weight along that axis (and the bias) must scale the output per channel."""
    weight, bias = module.weight.detach(), getattr(module, "bias", None)
    scale = _probe((width,), weight.dtype, weight.device) + 0.5
    for axis in (0, 1):
        if weight.shape[axis] != width:
            continue
        x = _probe((3, weight.shape[1 - axis]), weight.dtype, weight.device)
        params = {"weight": weight * (scale[:, None] if axis == 0 else scale[None, :])}
        if bias is not None:
            params["bias"] = bias.detach() * scale
        try:
            with torch.no_grad():
                scaled = torch.func.functional_call(module, params, (x,))
                expected = module(x) * scale
        except RuntimeError:  # the input width of the other axis: not this one
            continue
        if torch.allclose(scaled, expected, rtol=1e-3, atol=1e-4):
            return axis
    raise ValueError(f"Cannot tell which axis of {type(module).__name__}'s weight holds its {width} outputs.")


def _probe(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Seeded random values in [0, 1) for a numerical check, drawn without touching the global RNG (a user's seeds
    stay theirs)."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(shape, generator=g).to(dtype=dtype, device=device)


def residual_writers(block: nn.Module, width: int) -> list[str]:
    """Names of the block's projections that write into the residual stream: the last projection (leaf with a 2-D
    weight) of each direct child that has any, with `width` outputs (`self_attn.o_proj`, `mlp.down_proj` on
    Llama-like layers). `block_source` checks numerically that zeroing their outputs makes the block the identity."""
    writers = []
    for child_name, child in block.named_children():
        found = _projections(child)
        if found:
            name, module = found[-1]
            if width in module.weight.shape:
                writers.append(f"{child_name}.{name}" if name else child_name)
    return writers


def block_source(stack: Any) -> Callable[..., BlockAdapter]:
    """Makes the block adapter of exit `e`: a copy of layer e + 1 (the last layer for an exit at the last one)."""

    def make(exit_layer: int, residual: bool = False) -> BlockAdapter:
        idx = min(exit_layer + 1, stack.num_layers - 1)
        block = copy.deepcopy(stack.layers[idx])
        if not residual:
            return BlockAdapter(block, stack.mask_kinds[idx])
        writers = residual_writers(block, stack.hidden_size)
        adapter = BlockAdapter(block, stack.mask_kinds[idx], writers, stack.hidden_size)
        _check_starts_as_identity(adapter, stack)
        return adapter

    return make


def _check_starts_as_identity(adapter: BlockAdapter, stack: Any) -> None:
    """A fresh `residual_block` must pass its input through unchanged (every residual write scaled to zero); a layer
    that writes into the residual stream some other way cannot host one."""
    hidden = _probe((1, 4, stack.hidden_size), stack.dtype, stack.device) * 2 - 1
    with torch.no_grad():
        out = adapter(hidden, stack)
    if len(adapter.writers) < 2 or not torch.allclose(out.float(), hidden.float(), atol=1e-5):
        raise ValueError(
            f"A 'residual_block' adapter needs a layer whose attention and MLP each write into the residual stream "
            f"through one projection; {type(adapter.block).__name__} does not (found {adapter.writers}). Use the "
            "'block' or 'postnorm' adapter for this model."
        )


def needs_context(adapter: nn.Module | None) -> bool:
    """Whether an adapter reads the context (a block adapter), so that it runs over chunks with a cache."""
    return bool(getattr(adapter, "needs_context", False))


class BlockContext:
    """A block adapter's own KV cache for one sequence, and the exit states queued for it.

    Every position passes the exit once, in order: `push` queues its state, and `run` feeds the queue through the
    block (one batched call) when a draft needs the block's output. `rollback(keep)` forgets every position from
    `keep` on, in the cache and the queue alike, so the cache always holds exactly the block's keys and values of
    the sequence's accepted positions, as a full pass over them would.
    """

    MAX_QUEUE = 256  # queued positions kept before they are run anyway (bounded memory when nothing drafts)

    def __init__(self) -> None:
        self.cache = _compat.new_block_cache()
        self.seen = 0  # positions in the cache
        self.queue: torch.Tensor | None = None  # (1, m, hidden): positions seen..seen+m-1

    @property
    def end(self) -> int:
        return self.seen + (0 if self.queue is None else self.queue.shape[1])

    def push(self, hidden: torch.Tensor, start: int, stack: Any, adapter: nn.Module) -> None:
        """Queue exit states (1, m, hidden) of positions start..start+m-1 (which must follow the queued ones)."""
        if start != self.end:
            raise RuntimeError(f"Block adapter context out of step: got position {start}, expected {self.end}.")
        self.queue = hidden if self.queue is None else torch.cat([self.queue, hidden], dim=1)
        if self.queue.shape[1] > self.MAX_QUEUE:  # run all but the newest, which a draft may still ask about
            newest = self.queue[:, -1:]
            self.queue = self.queue[:, :-1]
            self.run(stack, adapter)
            self.queue = newest

    def run(self, stack: Any, adapter: nn.Module) -> torch.Tensor | None:
        """The block's outputs (1, m, hidden) for the queued positions, whose keys and values it now holds."""
        if self.queue is None:
            return None
        positions = torch.arange(self.seen, self.end, device=self.queue.device).unsqueeze(0)
        out = adapter(self.queue, stack, self.cache, positions)
        self.seen, self.queue = self.end, None
        return out

    def rollback(self, keep: int) -> None:
        if keep <= self.seen:
            _compat.crop_cache_layer(self.cache, 0, keep)
            self.seen, self.queue = keep, None
        elif self.queue is not None:
            self.queue = self.queue[:, : keep - self.seen] if keep < self.end else self.queue


def exit_normed(stack: Any, adapter: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """What an exit feeds its LM head: the adapter (before or after the final norm) and the final norm.

    A block adapter needs the context: `hidden` is then (b, m, hidden), one chunk of consecutive positions from the
    start of the text (as in training); the engine runs blocks through their `BlockContext` instead."""
    if adapter is None:
        return stack.final_norm(hidden)
    if getattr(adapter, "post_norm", False):
        return adapter(stack.final_norm(hidden))
    if needs_context(adapter):
        return after_block(adapter, stack.final_norm(adapter(hidden, stack)))
    return stack.final_norm(adapter(hidden))


def after_block(adapter: nn.Module, normed: torch.Tensor) -> torch.Tensor:
    """A block adapter's post-norm map (a `residual_block`'s), applied to the final norm of the block's output."""
    post = getattr(adapter, "post", None)
    return normed if post is None else post(normed)


def exit_logits(stack: Any, adapter: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    """Exit-head logits `(..., vocab)` for hidden states `(..., hidden)`; adapter None is the logit lens."""
    return stack.unembed(exit_normed(stack, adapter, hidden))


class DraftHead(nn.Module):
    """The model's LM head restricted to a fixed set of token ids (a vocabulary-trimmed draft head, as in FR-Spec).

    A draft only has to propose tokens the deep pass will check with the full head, so a head over the K most
    frequent ids proposes nearly every token the full one would, at K / vocab of its cost (and its slice of the
    weight stays in cache). The weight slice is a copy: K x hidden values beside the base model.
    """

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor) -> None:
        super().__init__()
        # dense(): a quantized LM head gives dense rows, so the draft head stays in the compute dtype.
        token_ids = token_ids.to(lm_head.weight.device)
        self.register_buffer("token_ids", token_ids, persistent=False)
        self.register_buffer("weight", dense(lm_head.weight.detach())[token_ids].clone(), persistent=False)
        bias = getattr(lm_head, "bias", None)
        rows = None if bias is None else dense(bias.detach())[token_ids].clone()
        self.register_buffer("bias", rows, persistent=False)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., K) logits over `token_ids`."""
        return torch.nn.functional.linear(normed, self.weight, self.bias)


def draft_logits(stack: Any, adapter: nn.Module | None, draft: DraftHead | None, hidden: torch.Tensor) -> torch.Tensor:
    """An exit's draft logits `(..., vocab)`: the trimmed head's logits, -inf outside its token set (the full
    exit head when `draft` is None). Full-width rows keep logits processors, sampling and the speculative-sampling
    rule unchanged: a draft distribution that is zero outside the set is still a valid q."""
    return logits_from_normed(stack, draft, exit_normed(stack, adapter, hidden))


def logits_from_normed(stack: Any, draft: DraftHead | None, normed: torch.Tensor) -> torch.Tensor:
    """The head's logits `(..., vocab)` for normed states: the trimmed head's (-inf outside its ids), or the full
    LM head's when `draft` is None."""
    if draft is None:
        return stack.unembed(normed)
    sub = stack.finish_logits(draft(normed))  # (..., K)
    full = torch.full((*sub.shape[:-1], stack.vocab_size), float("-inf"), dtype=sub.dtype, device=sub.device)
    return full.index_copy_(-1, draft.token_ids, sub)


GATE_CONTEXT = ("ngram_match", "recent_acceptance")  # what the engine tells a gate beyond the hidden state
# What a head gate reads off the draft head's output: its five largest log probabilities, the largest probability,
# the entropy (nats), and whether its top-1 is the token the n-gram tier would copy here (two weak predictors that
# agree are right far more often than either).
HEAD_FEATURES = ("log_p1", "log_p2", "log_p3", "log_p4", "log_p5", "confidence", "entropy", "ngram_agrees")


def head_features(
    logits: torch.Tensor, ngram_token: torch.Tensor | None = None, draft_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """(..., vocab) head logits [and (...) the n-gram tier's proposed token, -1 for none] -> (...,
    len(HEAD_FEATURES)) float32 features for a head gate.

    With `draft_ids` (a trimmed head's token ids, the only finite logits), the features are computed on those K
    columns alone: the same values (the -inf columns have probability 0) at K / vocab of the cost."""
    if draft_ids is not None:
        logits = logits.index_select(-1, draft_ids)  # (..., K)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top, top_ids = log_probs.topk(5, dim=-1)
    if draft_ids is not None:
        top_ids = draft_ids[top_ids]  # back to token ids
    top = top.clamp(min=-30.0)  # a trimmed head's -inf tail stays finite
    entropy = torch.special.entr(log_probs.exp()).sum(dim=-1, keepdim=True)
    if ngram_token is None:
        agrees = torch.zeros_like(entropy)
    else:
        agrees = (top_ids[..., :1] == ngram_token.to(top_ids.device).reshape(*top_ids.shape[:-1], 1)).float()
    return torch.cat([top, top[..., :1].exp(), entropy, agrees], dim=-1)


class LearnedGate(nn.Module):
    """A logistic gate: P(this exit's top-1 equals the final top-1).

    The hidden state is RMS normalised first, so the gate is insensitive to the residual stream's growing scale with
    depth. With `context=True` it also weighs cheap signals the head does not see: the state's log RMS, whether the
    n-gram tier matched the text just before (`GATE_CONTEXT[0]`), and this exit's recent acceptance
    (`GATE_CONTEXT[1]`, the policy's running estimate).

    Without `head`, the gate runs before the head, so a confident "no" skips the draft head. With `head=True` it
    runs after the head and also weighs the head's output (`HEAD_FEATURES`, standardised with the training set's
    statistics): a learned confidence, which the router's confidence thresholds then compare instead of the head's
    maximum probability.
    """

    def __init__(self, hidden_size: int, context: bool = False, head: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.context = nn.Linear(1 + len(GATE_CONTEXT), 1, bias=False) if context else None
        if self.context is not None:
            nn.init.zeros_(self.context.weight)
        self.head = nn.Linear(len(HEAD_FEATURES), 1, bias=False) if head else None
        if self.head is not None:
            nn.init.zeros_(self.head.weight)
            self.register_buffer("head_mean", torch.zeros(len(HEAD_FEATURES)))
            self.register_buffer("head_scale", torch.ones(len(HEAD_FEATURES)))

    @property
    def uses_context(self) -> bool:
        return self.context is not None

    @property
    def uses_head(self) -> bool:
        return self.head is not None

    def forward(
        self, hidden: torch.Tensor, context: torch.Tensor | None = None, head: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(..., hidden) [and (..., len(GATE_CONTEXT)) context, (..., len(HEAD_FEATURES)) head features] -> (...)
        probabilities."""
        h = hidden.float()
        ms = h.pow(2).mean(-1, keepdim=True) + 1e-6
        h = h * torch.rsqrt(ms)
        logit = self.linear(h.to(self.linear.weight.dtype)).float()
        if self.context is not None:
            if context is None:  # no context known: the neutral values (no match, acceptance 0.5)
                context = torch.tensor([0.0, 0.5], device=h.device).expand(*h.shape[:-1], len(GATE_CONTEXT))
            features = torch.cat([0.5 * ms.log(), context.float()], dim=-1)  # log RMS, then the context
            logit = logit + self.context(features.to(self.context.weight.dtype)).float()
        if self.head is not None:
            if head is None:
                raise ValueError("This gate weighs the head's output: pass head_features(logits).")
            scaled = (head.float() - self.head_mean.float()) / self.head_scale.float()
            logit = logit + self.head(scaled.to(self.head.weight.dtype)).float()
        return torch.sigmoid(logit).squeeze(-1)


def uses_head(gate: nn.Module | None) -> bool:
    """True for a gate that runs after the head and weighs its output (a learned confidence)."""
    return bool(getattr(gate, "uses_head", False))


def gate_probability(
    gate: nn.Module,
    hidden: torch.Tensor,
    context: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
    ngram_token: torch.Tensor | None = None,
    draft: DraftHead | None = None,
) -> torch.Tensor:
    """A gate's probability for `hidden`: context features go only to gates that use them, head features (from
    `logits`, drawn from `draft` when trimmed, and the n-gram tier's `ngram_token`) only to head gates (custom gates
    take the hidden state alone)."""
    if uses_head(gate):
        if logits is None:
            raise ValueError("A head gate runs after the head: pass the head's logits.")
        features = head_features(logits, ngram_token, None if draft is None else draft.token_ids)
        return gate(hidden, context if gate.uses_context else None, features)
    if getattr(gate, "uses_context", False):
        return gate(hidden, context)
    return gate(hidden)


def make_adapter(kind: str, hidden_size: int, rank: int, block: Callable[..., BlockAdapter] | None = None) -> nn.Module:
    """A fresh adapter of `kind`; "block" and "residual_block" need `block`, which builds them from the base
    model's layers."""
    if kind in BLOCK_KINDS:
        if block is None:
            raise ValueError(f"A {kind!r} adapter is built from the base model's layers: pass block_source(stack).")
        return block(residual=kind == "residual_block")
    if kind == "identity":
        return IdentityAdapter()
    if kind == "linear":
        return LinearAdapter(hidden_size)
    if kind == "lowrank":
        return LowRankAdapter(hidden_size, rank)
    if kind == "postnorm":
        return PostNormAdapter(hidden_size)
    raise ValueError(f"Unknown adapter kind {kind!r}")


class ExitHeads(nn.Module):
    """The adapters (and optional gates) of every exit layer, keyed by the layer index as a string."""

    def __init__(
        self,
        exit_layers: list[int],
        hidden_size: int,
        adapter: str | dict[int, str],
        rank: int,
        blocks: Callable[..., BlockAdapter] | None = None,
    ) -> None:
        """`adapter`: one kind for every exit, or the kind of each exit ({layer: kind})."""
        super().__init__()
        self.exit_layers = list(exit_layers)
        self.kinds = {e: adapter if isinstance(adapter, str) else adapter[e] for e in self.exit_layers}

        def block(e: int) -> Callable[..., BlockAdapter] | None:
            return None if blocks is None else lambda **kw: blocks(e, **kw)

        self.adapters = nn.ModuleDict(
            {str(e): make_adapter(self.kinds[e], hidden_size, rank, block(e)) for e in exit_layers}
        )
        self.gates = nn.ModuleDict()

    def adapter(self, layer: int) -> nn.Module:
        return self.adapters[str(layer)]

    def context_exits(self) -> list[int]:
        """Exit layers whose adapter reads the context (block adapters)."""
        return [e for e in self.exit_layers if needs_context(self.adapter(e))]

    def gate(self, layer: int) -> nn.Module | None:
        key = str(layer)
        return self.gates[key] if key in self.gates else None

    def draft_head(self, stack: Any, size: int) -> DraftHead | None:
        """The trimmed draft head over `size` token ids (None when `size` covers the vocabulary).

        The ids are the first `size` of `draft_ranking` (the model's own most frequent next tokens, measured when
        the heads were trained), or else the first `size` ids, whose BPE merge order follows frequency roughly.
        Built once per size, device, dtype and head weight, and kept outside the module tree (a plain attribute),
        so that it never enters a state_dict."""
        if size <= 0 or size >= stack.vocab_size:
            return None
        weight = stack.lm_head.weight
        key = (size, weight.device, weight.dtype, weight.data_ptr())
        cached = self.__dict__.setdefault("_draft_heads", {})
        if key not in cached:
            cached.clear()  # one size at a time: a stale slice is memory for nothing
            ranking = self.draft_token_ranking()
            ids = torch.arange(size) if ranking is None else ranking[:size].sort().values.cpu()
            cached[key] = DraftHead(stack.lm_head, ids)
        return cached[key]

    def draft_token_ranking(self) -> torch.Tensor | None:
        """(vocab,) every token id, most frequent model prediction first; None when none was measured."""
        return self._buffers.get(DRAFT_RANKING)

    def set_draft_token_ranking(self, ranking: torch.Tensor, vocab_size: int) -> None:
        """Store the token ranking the trimmed draft head takes its ids from (saved with the heads)."""
        ranking = torch.as_tensor(ranking).detach().to(torch.long).flatten().cpu()
        if ranking.numel() != vocab_size or not torch.equal(ranking.sort().values, torch.arange(vocab_size)):
            raise ValueError(f"A draft token ranking must order every one of the {vocab_size} token ids exactly once.")
        device = next((p.device for p in self.parameters()), ranking.device)
        self.register_buffer(DRAFT_RANKING, ranking.to(device))
        self.__dict__.pop("_draft_heads", None)

    def add_gates(self, hidden_size: int, context: bool = False, head: bool = False) -> None:
        """Give every exit a (zero-initialised) learned gate, with context and head features or not; training fills
        them."""
        for e in self.exit_layers:
            self.gates[str(e)] = LearnedGate(hidden_size, context, head)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def draft_token_ranking(top1: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab,) token ids ordered by how often they are the model's top-1 prediction in `top1` (ties: lower id
    first, so that ids never predicted keep their BPE order behind the predicted ones). FR-Spec's frequency-ranked
    vocabulary, from the model's own predictions."""
    counts = torch.bincount(top1.flatten().cpu(), minlength=vocab_size)[:vocab_size]
    # Stable descending sort: equal counts keep ascending id order.
    return torch.sort(-counts, stable=True).indices
