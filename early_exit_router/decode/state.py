"""What a decode carries between steps, as a few small records.

- `Row`: one sequence of the batch: its request, its tokens on the host, its record (depths, logits), the drafts it
  has in flight, its stop and streaming frontier, its counters and, when sampling, its noise (`noise.py`).
- `Draft`: one drafted token the deep pass has yet to judge: the tier that proposed it (and an exit tree's
  alternatives).
- `VerifyCycle`: drafts in flight that the next deep pass verifies, from one slot on (verify mode: every draft; exit
  mode: the n-gram tier's, and whatever follows them until that pass).
- `DecodeState`: everything one decode shares between the phases of a step (`drafting.py`, `deep.py`, `emit.py`):
  the rows, the slots they share (`batch.Slots`), the KV fill (`segments.LayerwiseFill`), the cycle in flight, the
  policy's memory (acceptance estimates, the current plan) and the batch's counters. `loop.Decoder` builds it and
  runs the steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from early_exit_router.config import RouterConfig
from early_exit_router.decode.adapted_draft import AdaptedDrafter
from early_exit_router.decode.batch import Slots
from early_exit_router.decode.drafters import ExitDrafter, SuffixDrafter
from early_exit_router.decode.noise import SamplingNoise
from early_exit_router.decode.sampling import TokenSelector
from early_exit_router.decode.segments import LayerwiseFill
from early_exit_router.decode.stats import AgreementMonitor, PassCounters, RowCounters
from early_exit_router.decode.stopping import DecodeRequest, StreamFrontier
from early_exit_router.heads.draft_path import DraftPath
from early_exit_router.heads.exit_heads import ExitHeads
from early_exit_router.models.architecture import LayerStack
from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.exit_rule import ExitRule, RoutingState
from early_exit_router.routing.ngram import ContextIndex, Proposal
from early_exit_router.routing.policy import AcceptanceTracker, DraftPolicy, Plan, TierKey


@dataclass
class Draft:
    """A drafted token in flight, keyed in `Row.drafts` by the slot it was predicted from."""

    tier: int  # the exit's index, or the n-gram tier's (after the exits)
    key: TierKey  # the acceptance estimate its verdict updates
    alternatives: tuple[int, ...] = ()  # an exit tree's: the exit head's next choices after this draft
    noise: torch.Tensor | None = None  # a sampled exit's: its position's noise, which exit mode's check draws with


@dataclass
class VerifyCycle:
    """Drafts predicted from slot `start` on are verified by the next deep pass; waiting tokens before it exited and
    are final (exit mode)."""

    start: int


@dataclass(eq=False)  # identity: rows hold tensors
class Row:
    """One sequence in the batch."""

    request: DecodeRequest
    selector: TokenSelector
    tokens: list[int]  # prompt + generated, real tokens only
    prompt_len: int
    start: int  # slot of its first generated token (its prompt ends just before)
    prompt_ids: torch.Tensor  # (1, n): the prompt as its first batch padded it (what HF's processors see)
    counters: RowCounters
    frontier: StreamFrontier
    depth: list[int] = field(default_factory=list)  # per new token: the layer it left at (-1: the n-gram tier)
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, when requested
    drafts: dict[int, Draft] = field(default_factory=dict)
    proposal: Proposal | None = None  # this cycle's n-gram proposal (judged after the deep pass, drafted or not)
    drafted: int = 0  # of it, the tokens drafted
    final: int = 0  # tokens (prompt included) that are final: no deep pass can replace them
    stop_at: int | None = None  # new tokens up to the one that ends generation (tentative until final)
    done: bool = False
    started: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    compiling_from: float = 0.0  # the stack's compile seconds when the row started (`compiled_seconds`)
    ended: float | None = None
    # The suffix drafter's view of this context for the gates: (context length, the token it would copy or -1).
    ngram_memo: tuple[int, int] = (-1, -1)
    index: ContextIndex | None = None  # the n-gram tier's index of `tokens` (built at the first lookup)
    noise: SamplingNoise | None = None  # sampling: the noise of its positions (`decode/noise.py`) ...
    noise_row: int = 0  # ... its row in it
    passes_from: PassCounters = field(default_factory=PassCounters)  # the batch's tallies when it joined ...
    passes_to: PassCounters | None = None  # ... and when it left (None: it is still in it)

    def noise_at(self, position: int, vocab: int) -> torch.Tensor:
        """(vocab,) the sampling noise of new token `position`; the draws of its final tokens go."""
        self.noise.release(self.noise_row, self.final - self.prompt_len)
        return self.noise.at(position, self.noise_row, vocab)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def output(self) -> list[int]:
        """The generated tokens, up to and including the one that stopped it."""
        new = self.new_tokens
        return new[: self.stop_at] if self.stop_at is not None else new[: self.request.max_new_tokens]

    def drop(self, count: int) -> None:
        """Forget the newest `count` tokens (rejected drafts): tokens, record, and a stop among them."""
        if count <= 0:
            return
        if self.index is not None:
            self.index.cut(self.tokens, len(self.tokens) - count)
        del self.tokens[-count:]
        keep = len(self.tokens) - self.prompt_len
        del self.depth[keep:]
        del self.logits[keep:]
        self.final = min(self.final, len(self.tokens))
        if self.stop_at is not None and self.stop_at > keep:
            self.stop_at = None
        self.ngram_memo = (-1, -1)  # the context may regrow to the same length with other tokens


class DecodeState:
    """What the phases of a step share (see the module docstring); `loop.Decoder` sets every attribute."""

    stack: LayerStack
    heads: ExitHeads
    rule: ExitRule
    config: RouterConfig
    mode: str  # "exit" or "verify": this decode's, for good
    costs: CostModel | None
    per_row: bool  # the per-row batch design (else synchronous)
    pad_token_id: int
    exits: list[int]  # the consulted exit layers, in depth order
    full_layer: int
    block_exits: list[int]  # indices into `exits` whose adapter is a block with a context of its own
    policy: DraftPolicy | None  # the cost policy (None: the fixed cascade, or plain decoding under `fallback`)
    fallback: str | None  # why this decode runs plainly (a cost table that looks wrong), else None
    exits_left_out: list[int]  # verify mode: block exits whose drafts cannot pay from the start (not consulted)
    suffix: SuffixDrafter
    exit_drafter: ExitDrafter
    adapted: AdaptedDrafter | None  # verify mode's adapted draft path (`adapted_draft.py`), when the router has one
    draft_path: DraftPath | None
    chained: bool  # a draft path's chain waits for the pass that verifies it
    tracker: AcceptanceTracker  # acceptance estimates per tier
    routing: RoutingState  # the exit rule's memory: blocks, recent confidences, the controller's shift
    monitor: AgreementMonitor
    passes: PassCounters
    rows: list[Row]
    slots: Slots | None
    fill: LayerwiseFill | None
    cycle: VerifyCycle | None  # drafts in flight that the next deep pass verifies
    plan: Plan | None  # the cost policy's current draft cycle
    cycle_drafts: int  # drafts that cycle has made so far
    survival: float  # verify mode: the chance that the cycle's exit drafts so far are all accepted
    refusals: list[tuple[Row, int, int, int]]  # this step's refused asks: (row, its length, the head's top-1, exit)
