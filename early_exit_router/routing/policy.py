"""Expected-gain routing: per draft cycle, draft from the tier with the most expected tokens per millisecond.

A cycle drafts `d` tokens from one tier (an exit, or the zero-layer n-gram tier), then one deep pass verifies them
and emits the full model's next token. With per-position acceptance `a`, the cycle yields on average
`E(a, d) = 1 + a + ... + a^d = (1 - a^(d+1)) / (1 - a)` tokens (DEL's tokens-per-layer idea, TPL(l, d), with the
layer counts replaced by measured milliseconds):

- n-gram tier: the proposal costs nothing; the verify pass runs every layer over d + 1 positions and the head
  over d + 1 rows.
- exit `e`: each draft runs layers 0..e for one position plus the trimmed draft head (and gate); the token that goes
  deep runs layers 0..e alone, then layers e+1.. over the d + 1 positions, then the head over d + 1 rows. The exit's
  gate decides per token: a chain asks it at every position and drafts while it fires, so a cycle drafts d < m tokens
  with probability f^d (1 - f) (f: the share of asks that fire; a refused ask costs only its head and gate, and the
  token goes deep at once), and its drafts are accepted at the acceptance `a` of fired tokens. Tracking f and a apart
  keeps a gate that fires seldom but is right when it does (a shallow exit's usual profile) from looking like an exit
  that is often wrong.
- plain decoding: one token per plain step (every layer, one head row), and no head or gate at any exit.

Exit mode, where exited tokens are final, asks an exit only while that pays (`worth_consulting`): asking costs the
draft head and gate (and a block adapter's layer) on every token asked, and an exit saves the rest of that token's
pass (the layers after the exit and a head row) less what the later fill pays for one more position. With the
exit's estimated exit rate r per asking, it is asked while r x saving >= asking cost; a skipped exit is still asked
every `probe_interval` tokens, so its estimate follows the text.

The option with the best tokens per millisecond wins; drafting must beat plain decoding by `margin`, so that a
near-tie decodes plainly. Acceptance is estimated online per tier (and per `Proposal.match_class` for the n-gram tier)
from the deep pass's verdict on every draft, and from "shadow" checks: on plain steps the n-gram proposal that was not
used is checked against the token the full model chose, and every `probe_interval` plain steps each exit's draft head
is scored on the hidden state the step computed anyway, so a tier that was switched off is noticed when the text
becomes predictable again. An exit whose chains do not pay at its estimates (`draft_pays`) is
probed at doubling gaps, up to `MAX_PROBE_BACKOFF` intervals apart (`ProbeSchedule`): where exits cannot pay, as on a
CPU whose plain steps are cheap, their probes cost little.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from early_exit_router.routing.costs import CostModel
from early_exit_router.routing.ngram import Proposal
from early_exit_router.routing.token_tree import TokenTree

# ("exit", exit index): a fired exit's drafts; ("fire", exit index): the share of a chain's asks whose gate let the
# token draft; ("agree", exit index): the exit head's top-1 agreement with the full model over every judged position
# (the gate's `recent_acceptance` feature, as training replays it); ("ngram", match class); ("branch", match class): a
# token tree's other continuations, once the first is refused; ("exit branch", exit index): an exit's next choices,
# once its first is refused; exit mode: ("ask", exit index)
TierKey = tuple[str, int]
MARGIN = 0.03  # drafting must beat plain decoding by this share, so that a near-tie decodes plainly
MAX_PROBE_BACKOFF = 8  # an exit that cannot pay is still probed at least every this-many probe intervals
ASK_RATE = 0.1  # weight of each timed ask in an exit's running ask cost


def expected_tokens(a: float, d: int) -> float:
    """Tokens one cycle of d drafts emits on average: the accepted prefix plus the deep pass's own token."""
    if a >= 1.0:
        return d + 1.0
    return (1.0 - a ** (d + 1)) / (1.0 - a)


@dataclass
class AcceptanceTracker:
    """Exponential moving averages of per-position acceptance, one per tier key, starting at `prior`."""

    prior: float = 0.5
    rate: float = 0.15  # weight of each new verdict
    estimates: dict[TierKey, float] = field(default_factory=dict)
    kind_priors: dict[str, float] = field(default_factory=dict)  # a tier kind's own prior ("exit": ...)

    def estimate(self, key: TierKey) -> float:
        return self.estimates.get(key, self.kind_priors.get(key[0], self.prior))

    def observe(self, key: TierKey, accepted: bool) -> None:
        a = self.estimate(key)
        self.estimates[key] = a + self.rate * (float(accepted) - a)

    def observe_draft(self, key: TierKey, accepted: bool) -> None:
        """A draft's verdict; an exit's is also a verdict on its head's top-1 (the gate's agreement feature)."""
        self.observe(key, accepted)
        if key[0] == "exit":
            self.observe(("agree", key[1]), accepted)


@dataclass
class ProbeSchedule:
    """Which exits a plain step scores (shadow probes). Each exit is probed every `interval` plain steps while its
    acceptance estimate pays, and at doubling gaps, up to `MAX_PROBE_BACKOFF` intervals, while it does not: a probe
    walks to the exit and runs its draft head (and a block adapter's layer) on a step that drafts nothing."""

    interval: int
    gaps: dict[int, int] = field(default_factory=dict)  # exit index -> plain steps from its last probe to its next
    next_due: dict[int, int] = field(default_factory=dict)  # exit index -> the plain step it is next probed at

    def due(self, step: int, exits: int) -> set[int]:
        """The exits (of `exits`) to probe at plain step `step` (none where `interval` is 0)."""
        return {i for i in range(exits) if self.interval > 0 and step >= self.next_due.get(i, 0)}

    def probed(self, i: int, step: int, pays: bool) -> None:
        """Exit `i` was probed at plain step `step`; `pays`: its estimate now reaches its break-even acceptance."""
        gap = self.interval if pays else min(2 * self.gaps.get(i, self.interval), MAX_PROBE_BACKOFF * self.interval)
        self.gaps[i], self.next_due[i] = gap, step + gap


@dataclass(frozen=True)
class Plan:
    """What one draft cycle does: 'plain' (no draft), 'ngram' (each row drafts its `proposals` entry), 'tree' (one
    row verifies the n-gram tier's `tree` of `max_draft` nodes) or 'exit' (exit index `tier`, up to `max_draft`
    tokens, each keeping its head's next `branches` choices as alternatives, verified as a tree where `exit_tree`)."""

    kind: str
    max_draft: int = 0
    tier: int = -1
    key: TierKey | None = None
    proposals: tuple[Proposal | None, ...] = ()  # n-gram plans: per row, its drafts and their match (None: no row)
    tree: TokenTree | None = None  # 'tree' plans (one row): the nodes to verify in one pass
    rate: float = 0.0  # expected tokens per ms
    branches: int = 0  # 'exit' plans: alternatives each draft keeps (a chain's are judged, to learn their estimate)
    exit_tree: bool = False  # 'exit' plans: the alternatives are verified with the chain, as a tree's leaves

    def label(self, exit_layers: Sequence[int]) -> str:
        """The plan's kind as statistics count it (`policy_cycles`): an exit's names its layer."""
        if self.kind != "exit":
            return self.kind
        return f"exit {'tree ' if self.exit_tree else ''}L{exit_layers[self.tier]}"


class DraftPolicy:
    """Chooses each cycle's plan from a cost model and acceptance estimates."""

    def __init__(
        self,
        costs: CostModel,
        exit_layers: list[int],
        uses_gate: list[bool],
        margin: float = MARGIN,
        has_block: list[bool] | None = None,
        check_share: float = 1.0,
        tree_nodes: int = 0,
        max_draft: int = 8,
        exit_branches: int = 0,
    ) -> None:
        self.costs = costs
        self.exit_layers = list(exit_layers)
        self.uses_gate = list(uses_gate)
        self.has_block = list(has_block) if has_block is not None else [False] * len(self.exit_layers)
        self.margin = margin
        self.check_share = check_share  # exit mode: the share of exited tokens the fill checks (one head row each)
        self.tree_nodes = tree_nodes  # most nodes a token tree may verify in one pass
        self.exit_branches = exit_branches  # alternatives per token an exit drafts into a tree
        self.max_draft = max_draft
        self.plain_rate = 1.0 / costs.plain_step()
        self._asks: dict[int, float] = {}  # exit index -> its asks' running ms, as the decoder timed them
        # Consulted on every token (exit mode) or every plan (verify); the table is fixed, so they are worked out once.
        self._break_even = [self.break_even_exit_rate(i) for i in range(len(self.exit_layers))]
        self._exit_cycles: dict[tuple[int, int, int], float] = {}  # (exit, drafts, leaves) -> ms, less the asks
        self._draft_break_even = [self._acceptance_to_pay(i, max_draft) for i in range(len(self.exit_layers))]

    @classmethod
    def for_config(cls, costs: CostModel, config: Any, heads: Any) -> DraftPolicy:
        """The policy over a router config's consulted exits (each with its gate's cost where it has one in use)."""
        from early_exit_router.heads.adapters import needs_context

        exits = config.consulted_exit_layers()
        gates = [config.use_gate and heads.gate(e) is not None for e in exits]
        check = config.check_fraction if config.check_agreement else 0.0
        blocks = [needs_context(heads.adapter(e)) for e in exits]
        return cls(
            costs,
            exits,
            gates,
            has_block=blocks,
            check_share=check,
            tree_nodes=config.ngram_tree_nodes,
            max_draft=config.max_pending,
            exit_branches=config.exit_branches,
        )

    def consult_ms(self, i: int) -> float:
        """Asking exit `i` about one token: its draft head and gate, and a block adapter's layer; as the decoder
        timed its asks where it has (`observe_ask`), else as the cost table prices the parts."""
        if i in self._asks:
            return self._asks[i]
        c = self.costs
        return (
            c.draft_head_ms + (c.gate_ms if self.uses_gate[i] else 0.0) + (c.layers(1, 1) if self.has_block[i] else 0.0)
        )

    def observe_ask(self, i: int, ms: float) -> None:
        """One ask of exit `i` as the decoder ran it (head, gate, their host sync and the bookkeeping around them):
        in situ an ask costs several times the parts the table times alone (on a 2-core CPU 1.8 ms against 0.57),
        and pricing it from the parts made drafting look cheaper than it was."""
        known = self._asks.get(i)
        self._asks[i] = ms if known is None else known + ASK_RATE * (ms - known)

    def exit_saving_ms(self, i: int) -> float:
        """What one token leaving at exit `i` saves in exit mode: the layers after the exit and the head row its own
        pass would have run, less the fill's extra position in those layers and its checked head row."""
        c = self.costs
        rest = c.num_layers - self.exit_layers[i] - 1
        fill = c.layers(rest, 2) - c.layers(rest, 1)
        check = self.check_share * (c.head(2) - c.head(1))
        return c.layers(rest, 1) + c.head(1) - fill - check

    def break_even_exit_rate(self, i: int) -> float:
        """Exit mode: the share of tokens asked that must leave at exit `i` for asking it to pay (inf: never)."""
        saving = self.exit_saving_ms(i)
        return self.consult_ms(i) / saving if saving > 0 else float("inf")

    def worth_consulting(self, i: int, exit_rate: float) -> bool:
        """Exit mode: whether asking exit `i` pays, at an estimated `exit_rate` of tokens asked that leave there."""
        return exit_rate >= self._break_even[i]

    def draft_threshold(self, i: int, pending: int, survival: float = 1.0) -> float:
        """Verify mode: the least P(agree) at which exit `i` drafts the next token, where `pending` positions wait
        for the deep pass besides the current one and `survival` is the chance that the cycle's drafts so far are all
        accepted (the product of their P(agree)).

        Drafting x after the current token t costs x's shallow layers and ask, and one more position (and head row)
        in the deep pass; if x is accepted (and t's prefix was), the deep pass yields x and the token after it, so x
        saves the plain step that token would have needed. It pays at P(agree) x survival x plain step > that cost:
        the decision is per token, from the gate's own probability, not from a running estimate or exit mode's
        confidence bar."""
        c, e = self.costs, self.exit_layers[i]
        rest, n = c.num_layers - e - 1, pending + 1
        extra = c.layers(e + 1, 1) + self.consult_ms(i) + c.layers(rest, n + 1) - c.layers(rest, n)
        extra += c.head(n + 1) - c.head(n)
        return extra / (max(survival, 1e-9) * c.plain_step())

    def draft_break_even(self, i: int) -> float:
        """Verify mode: the least per-position acceptance at which drafting from exit `i` beats plain decoding by
        the margin (inf: never)."""
        return self._draft_break_even[i]

    def draft_pays(self, i: int, tracker: AcceptanceTracker) -> bool:
        """Whether a gated chain from exit `i` (up to `max_pending` drafts), at its estimates of firing and
        acceptance, beats plain decoding by the margin."""
        return self._exit_plan(i, tracker, self.max_draft, False).rate > self.plain_rate * (1.0 + self.margin)

    def _acceptance_to_pay(self, i: int, max_draft: int) -> float:
        """`draft_break_even`, by bisection: the best draft's rate grows with the acceptance."""
        threshold = self.plain_rate * (1.0 + self.margin)

        def pays(a: float) -> bool:
            return self.best_draft(a, lambda d: self.exit_cycle_ms(i, d), max_draft)[1] > threshold

        if not pays(1.0):
            return float("inf")
        low, high = 0.0, 1.0
        for _ in range(20):
            mid = (low + high) / 2
            low, high = (low, mid) if pays(mid) else (mid, high)
        return high

    def ngram_cycle_ms(self, d: int) -> float:
        return self.costs.pass_ms(1, d + 1)

    def exit_cycle_ms(self, i: int, d: int, leaves: int = 0) -> float:
        """One cycle of `d` drafts from exit `i`: the drafts' shallow layers and heads, then the deep pass; with
        `leaves` alternatives (an exit tree), their own run through the shallow layers, and the deep pass over them
        too (unpadded, as a tree runs)."""
        return self._cycle_without_asks(i, d, leaves) + d * self.consult_ms(i)  # each draft's ask

    def _cycle_without_asks(self, i: int, d: int, leaves: int) -> float:
        """`exit_cycle_ms` less the drafts' asks: fixed by the table, so worked out once per (exit, drafts, leaves)."""
        key = (i, d, leaves)
        if key not in self._exit_cycles:
            self._exit_cycles[key] = self._exit_cycle_ms(i, d, leaves)
        return self._exit_cycles[key]

    def _exit_cycle_ms(self, i: int, d: int, leaves: int) -> float:
        c, e = self.costs, self.exit_layers[i]
        shallow = (d + 1) * c.layers(e + 1, 1)  # each draft's and the token that goes deep
        rest = c.num_layers - e - 1
        if not leaves:
            return shallow + c.layers(rest, d + 1) + c.head(d + 1)
        nodes = d + 1 + leaves
        return shallow + c.tree_layers(e + 1, leaves) + c.tree_layers(rest, nodes) + c.head(nodes)

    @staticmethod
    def best_length(
        gain: Callable[[int], float], cycle_ms: Callable[[int], float], max_length: int
    ) -> tuple[int, float]:
        """The draft length d in 1..max_length with the most expected tokens (`gain(d)`) per ms (`cycle_ms(d)`),
        and that rate (0, 0.0 when max_length < 1); the shortest wins a tie."""
        best_d, best_rate = 0, 0.0
        for d in range(1, max_length + 1):
            rate = gain(d) / cycle_ms(d)
            if rate > best_rate:
                best_d, best_rate = d, rate
        return best_d, best_rate

    @classmethod
    def best_draft(cls, a: float, cycle_ms: Callable[[int], float], max_draft: int) -> tuple[int, float]:
        """`best_length` for one tier at per-position acceptance `a`."""
        return cls.best_length(lambda d: expected_tokens(a, d), cycle_ms, max_draft)

    def _tree_plan(self, tree: TokenTree, ab: tuple[float, float], floor: float) -> Plan | None:
        """A tree plan where one beats `floor` tokens per ms: the k most likely nodes (k up to `tree_nodes`) whose
        expected tokens (1 + the sum of their paths' acceptance probabilities, at the first children's and the
        alternatives' acceptance `ab`) per ms of one unpadded pass over 1 + k positions is highest; only a tree that
        still branches (a chain is drafted as one)."""
        gain, top_k, top_rate = 1.0, 0, floor
        for k, p in enumerate(sorted(tree.path_probabilities(*ab), reverse=True)[: self.tree_nodes], 1):
            gain += p
            rate = gain / self.costs.tree_pass_ms(k + 1)
            if rate > top_rate:
                top_k, top_rate = k, rate
        if top_k:
            kept = tree.top(top_k, *ab)
            if kept.branches:
                return Plan("tree", top_k, tree=kept, rate=top_rate)
        return None

    def plan(
        self,
        tracker: AcceptanceTracker,
        budget: int,
        proposals: Sequence[Proposal | None],
        exits: bool = True,
        tree: TokenTree | None = None,
        branching: Collection[int] = (),
    ) -> Plan:
        """The best plan for a cycle whose exits may draft up to `budget` tokens (plain when nothing beats it).

        `proposals`: each row's n-gram proposal, as long as the tier may draft (a batch of one: one entry; None: a
        finished row, which drafts nothing and gains nothing), its acceptance estimated per match class. A pass over
        b rows and k + 1 slots yields each row its expected accepted drafts plus its own token; the exits draft only
        for a batch of one (`exits`), since on rectangular layers a row that leaves early saves nothing while another
        needs the deep layers. `tree` (a batch of one): the proposal's token tree, drafted instead of the chain where
        its likeliest nodes pay better (`_tree_plan`). `branching`: the exits whose drafts may bring alternatives
        (`exit_branches` each) into an exit tree, where that pays better than their chain (`_exit_plan`)."""
        rows = max(1, len(proposals))
        active = [p for p in proposals if p is not None] if proposals else [Proposal([], 0)]
        plain_rate = len(active) / self.costs.pass_ms(rows, 1)
        best = Plan("plain", rate=plain_rate)
        threshold = plain_rate * (1.0 + self.margin)
        if budget < 1:
            return best
        longest = max((len(p.tokens) for p in active), default=0)
        estimates = [tracker.estimate(("ngram", p.match_class)) for p in active]
        k, rate = self.best_length(
            lambda k: sum(expected_tokens(a, min(len(p.tokens), k)) for p, a in zip(active, estimates)),
            lambda k: self.costs.pass_ms(rows, k + 1),
            longest,
        )
        if rate > max(best.rate, threshold):
            cut = tuple(None if p is None else p._replace(tokens=p.tokens[:k]) for p in proposals)
            best = Plan("ngram", k, proposals=cut, rate=rate)
        if tree is not None and rows == 1 and tree.branches:
            ab = estimates[0], tracker.estimate(("branch", tree.match))
            best = self._tree_plan(tree, ab, max(best.rate, threshold)) or best
        for i in range(len(self.exit_layers) if exits and rows == 1 else 0):
            plan = self._exit_plan(i, tracker, budget, i in branching)
            if plan.rate > max(best.rate, threshold):
                best = plan
        return best

    def gated_chains(
        self, i: int, fire: float, a: float, budget: int, gain: Callable[[int], float] | None = None, leaves: int = 0
    ) -> list[tuple[float, float]]:
        """Gated chains from exit `i` capped at m = 1..budget drafts: for each, (expected tokens, expected ms). Each
        position asks the gate, which fires with probability `fire`; d < m drafts end at a refused ask (whose head
        and gate are paid too, and whose token goes deep at once), m drafts at the cap. `gain(d)`: the tokens d
        drafts yield (default `expected_tokens(a, d)`); `leaves`: the alternatives each draft brings into an exit
        tree."""
        gain = gain or (lambda d: expected_tokens(a, d))
        ask = self.consult_ms(i)  # asked once per plan: each cycle's asks are d of them, and one more if refused
        cycle = [self._cycle_without_asks(i, d, leaves * d) + d * ask for d in range(budget + 1)]
        chains, tokens, ms = [], 0.0, 0.0  # the sums over the chains a refusal ends (d < m)
        for m in range(1, budget + 1):
            d, p = m - 1, fire ** (m - 1) * (1.0 - fire)
            tokens += p * gain(d)
            ms += p * (cycle[d] + ask)
            capped = fire**m  # the chains that reach the cap
            chains.append((tokens + capped * gain(m), ms + capped * cycle[m]))
        return chains

    def _exit_plan(self, i: int, tracker: AcceptanceTracker, budget: int, branching: bool) -> Plan:
        """Exit `i`'s best cycle: a gated chain of at most m drafts (`gated_chains`, at the estimates of firing and
        acceptance), or, where `branching` and it pays better, an exit tree whose every draft brings k alternatives.
        With acceptance `a` and `b` the chance that one of a draft's alternatives is right once the draft is not,
        the k x d leaves of d drafts add b x (1 - a^d) expected tokens (the leaf, with the full model's token after
        it in place of the one it would have chosen there)."""
        key: TierKey = ("exit", i)
        a, fire = tracker.estimate(key), tracker.estimate(("fire", i))
        k = self.exit_branches if branching else 0
        chains = self.gated_chains(i, fire, a, budget)
        m, rate = self.best_length(lambda m: chains[m - 1][0], lambda m: chains[m - 1][1], budget)
        best = Plan("exit", m, tier=i, key=key, rate=rate, branches=k)  # a chain's alternatives are judged too
        if k > 0:
            b = tracker.estimate(("exit branch", i))
            reach = min(budget, self.tree_nodes // (k + 1))
            trees = self.gated_chains(i, fire, a, reach, lambda d: expected_tokens(a, d) + b * (1.0 - a**d), k)
            m, rate = self.best_length(lambda m: trees[m - 1][0], lambda m: trees[m - 1][1], reach)
            if rate > best.rate:
                best = Plan("exit", m, tier=i, key=key, rate=rate, branches=k, exit_tree=True)
        return best


def without_idle_blocks(config: Any, heads: Any, costs: CostModel) -> tuple[Any, list[int]]:
    """Verify mode under the cost policy: `config` less the consulted block exits whose drafts do not pay at the
    acceptance their estimates start from, and those exit layers.

    Another exit costs only where it is asked; a block adapter's exit costs every step, drafting or not: its layer
    runs over every position, and the layer range splits at its exit (compiled on a 2-core CPU, SmolLM2's L16 block
    made every step about 7% dearer). An exit whose drafts do not beat plain decoding at its starting estimate
    (`exit_acceptance_prior`, else `acceptance_prior`) would pay that for its probes alone, so it sits out, as block
    exits do in batches; a prior at or above its break-even keeps it."""
    consulted = config.consulted_exit_layers()
    blocks = [e for e in consulted if e in heads.context_exits()]
    if not blocks:
        return config, []
    # an exit's break-even depends on its own costs alone: a policy over the block exits prices them as the
    # decoder's policy over every exit would, for less than building that one twice
    policy = DraftPolicy.for_config(costs, config.replace(active_exit_layers=blocks), heads)
    prior = config.exit_acceptance_prior if config.exit_acceptance_prior is not None else config.acceptance_prior
    idle = [e for i, e in enumerate(policy.exit_layers) if policy.draft_break_even(i) > prior]
    if not idle:
        return config, []
    return config.replace(active_exit_layers=[e for e in consulted if e not in idle]), idle
