"""The zero-layer draft tier: copy what followed the same tokens earlier, in this context or in earlier outputs.

`ngram_match` looks in the current context (prompt lookup) by scanning it; `ContextIndex` gives the same answer from
an index kept up to date as the context grows and is cut back, so that a step's lookup does not grow with the
context. `SuffixStore` keeps a bounded store of this router's earlier sequences across calls (as SuffixDecoding does
for agentic workloads, where the same structures recur from request to request). Each returns the proposal and the
length of the match behind it, and how far back the text before the current token agrees with the text before the
source (the run: at least the match, counted up to `RUN_LIMIT`). A longer run is a better predictor (a copy under way
tends to go on), so the router estimates acceptance per `match_class` and drafts further where runs are long.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from early_exit_router.routing.token_tree import TokenTree, build_tree

if TYPE_CHECKING:
    from early_exit_router.config import RouterConfig

RUN_LIMIT = 32  # a proposal's run is counted back at most this far
RUN_CLASSES = (8, 16, 32)  # runs from each of these lengths up share one acceptance estimate


class Proposal(NamedTuple):
    """What the n-gram tier proposes: the tokens, the length of the matched suffix behind them (0: no match), and
    the run: how many tokens before them agree with the text before their source (>= match, <= RUN_LIMIT)."""

    tokens: list[int]
    match: int
    run: int = 0

    @property
    def match_class(self) -> int:
        """The acceptance estimate's key: the run below 8 tokens, else the largest of RUN_CLASSES it reaches."""
        return match_class(max(self.match, self.run))


NO_PROPOSAL = Proposal([], 0)


def match_class(run: int) -> int:
    """`Proposal.match_class` of a run."""
    return max((c for c in RUN_CLASSES if run >= c), default=run)


def copy_from(tokens: Sequence[int], end: int, count: int) -> list[int]:
    """`count` tokens copied from `tokens[end:]` on, going on into the copy itself where it reaches the end of
    `tokens` (an overlapping copy, as LZ77 decodes one): text that repeats with a period proposes as many periods as
    asked, not just the one before the end."""
    out = list(tokens[end : end + count])
    period = len(tokens) - end
    while len(out) < count and period > 0:
        out.append(out[len(out) - period])
    return out


def agreement(context: Sequence[int], source: Sequence[int], end: int, matched: int) -> int:
    """How many tokens before `source[end]` agree with the end of `context`, knowing that the last `matched` do:
    the run of a proposal copied from `source[end:]`, at most RUN_LIMIT."""
    run = matched
    while run < RUN_LIMIT and run < end and run < len(context) and source[end - 1 - run] == context[-1 - run]:
        run += 1
    return run


def ngram_match(tokens: list[int], max_ngram: int, max_draft: int, min_ngram: int = 2) -> Proposal:
    """The tokens that followed the latest earlier occurrence of the longest matching suffix, its length and run.

    Tries suffixes of `max_ngram` down to `min_ngram` tokens; returns up to `max_draft` tokens, or ([], 0).
    """
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first, excluding the suffix itself
            if tokens[start : start + n] == suffix:
                end = start + n
                return Proposal(copy_from(tokens, end, max_draft), n, agreement(tokens, tokens, end, n))
    return NO_PROPOSAL


class ContextIndex:
    """`ngram_match` over one growing context, from an index: for every n-gram of `min_ngram` to `max_ngram` tokens,
    the end positions of its occurrences, in order. `lookup` costs O(max_ngram) dictionary reads whatever the length.

    The context is the caller's list, which only ever grows at its end or is cut back (rejected drafts): the index
    catches up with appended tokens at the next lookup, and `cut` must be called before tokens are removed (it reads
    them to find their entries)."""

    def __init__(self, max_ngram: int, min_ngram: int = 2) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions of its occurrences, increasing
        self.length = 0  # tokens of the context indexed so far

    def cut(self, tokens: list[int], length: int) -> None:
        """`tokens` is about to be cut back to `length`: forget the n-grams that end after it."""
        for end in range(self.length, length, -1):  # newest first: each is the last entry of its list
            for n in self.sizes:
                if end >= n:
                    key = tuple(tokens[end - n : end])
                    ends = self.ends[key]
                    ends.pop()
                    if not ends:
                        del self.ends[key]
        self.length = min(self.length, length)

    def _catch_up(self, tokens: list[int]) -> None:
        for end in range(self.length + 1, len(tokens) + 1):
            for n in self.sizes:
                if end >= n:
                    self.ends.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self.length = len(tokens)

    def lookup(self, tokens: list[int], max_draft: int) -> Proposal:
        """`ngram_match(tokens, max_ngram, max_draft, min_ngram)`: what followed the latest earlier occurrence of
        the longest matching suffix, its length and its run."""
        self._catch_up(tokens)
        for n in self.sizes:
            ends = self.ends.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if ends is not None and len(ends) > 1:  # the last entry is the suffix itself
                end = ends[-2]
                return Proposal(copy_from(tokens, end, max_draft), n, agreement(tokens, tokens, end, n))
        return NO_PROPOSAL

    def continuations(self, tokens: list[int], max_draft: int, limit: int) -> list[Proposal]:
        """What followed up to `limit` earlier occurrences of the context's suffixes, each with the length of the
        suffix that matched there and its run: the longest suffix's occurrences first, then shorter ones' at other
        positions, latest first at each length (the first is `lookup`'s proposal)."""
        self._catch_up(tokens)
        found: list[Proposal] = []
        seen: set[int] = set()
        for n in self.sizes:
            ends = self.ends.get(tuple(tokens[-n:])) if len(tokens) > n else None
            for j in range(len(ends) - 2 if ends else -1, -1, -1):  # the last entry is the suffix itself
                if len(found) == limit:
                    return found
                end = ends[j]
                if end not in seen:
                    seen.add(end)
                    found.append(Proposal(copy_from(tokens, end, max_draft), n, agreement(tokens, tokens, end, n)))
        return found


def prefer_stored(found: Proposal, store: SuffixStore | None, tokens: list[int], budget: int) -> Proposal:
    """The n-gram tier's proposal: the context's (`found`, from `ngram_match`) or the store's, whichever has the longer
    match, then the longer run (on a tie, the longer proposal; then the context's)."""
    if store is not None:
        stored = store.lookup(tokens, budget)
        if _rank(stored) > _rank(found):
            return stored
    return found


def _rank(proposal: Proposal) -> tuple[int, int, int]:
    return proposal.match, proposal.run, len(proposal.tokens)


def propose_tree(
    found: list[Proposal], store: SuffixStore | None, tokens: list[int], budget: int, limit: int, depth: int
) -> tuple[Proposal, TokenTree | None]:
    """The tier's proposal and its tree: what followed up to `limit` occurrences of the context's suffixes in the
    context (`found`: `ContextIndex.continuations(tokens, budget, limit)`) and as many in the store, the tree cut at
    `depth` tokens. The first path is `prefer_stored`'s proposal (the longest match, latest); an occurrence weighs
    half as much for each token its match is shorter than that one's."""
    stored = store.continuations(tokens, budget, limit) if store is not None else []
    if not found and not stored:
        return NO_PROPOSAL, None
    ordered = stored + found if stored and (not found or _rank(stored[0]) > _rank(found[0])) else found + stored
    first = ordered[0]
    weighted = [(c.tokens[:depth], 0.5 ** (first.match - c.match)) for c in ordered]
    return first, build_tree(weighted, first.match_class)


def ngram_lookup(tokens: list[int], max_ngram: int, max_draft: int, min_ngram: int = 2) -> list[int]:
    """Prompt lookup: `ngram_match`'s proposal alone."""
    return ngram_match(tokens, max_ngram, max_draft, min_ngram)[0]


class SuffixStore:
    """A bounded store of earlier token sequences, indexed by their n-grams for O(1) lookup.

    At most `max_tokens` tokens are kept (oldest sequences are dropped first, a too-long sequence keeps its end), and
    the index holds at most `(max_ngram - min_ngram + 1) * max_tokens` entries. One store belongs to one router and
    is never shared, so one user's text cannot leak into another router's drafts.
    """

    def __init__(self, max_tokens: int, max_ngram: int, min_ngram: int = 2) -> None:
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._sequences: OrderedDict[int, list[int]] = OrderedDict()
        # n-gram -> (sequence id, position after it) of each occurrence, oldest first
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self._next_id = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def index_size(self) -> int:
        """Entries in the index: one per indexed n-gram occurrence."""
        return sum(len(hits) for hits in self._index.values())

    def add(self, tokens: list[int]) -> None:
        """Remember a finished sequence (prompt and output)."""
        if self.max_tokens <= 0 or len(tokens) <= self.min_ngram:
            return
        tokens = list(tokens[-self.max_tokens :])
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._sequences[seq_id] = tokens
        self.num_tokens += len(tokens)
        evicted = False
        while self.num_tokens > self.max_tokens:
            _, old = self._sequences.popitem(last=False)
            self.num_tokens -= len(old)
            evicted = True
        if evicted:  # entries of dropped sequences would point nowhere: rebuild from what is left (rare)
            self._index.clear()
            for kept_id, kept in self._sequences.items():
                self._index_sequence(kept_id, kept)
        else:
            self._index_sequence(seq_id, tokens)

    def _index_sequence(self, seq_id: int, tokens: list[int]) -> None:
        for n in range(self.min_ngram, self.max_ngram + 1):
            for end in range(n, len(tokens)):  # a continuation must exist after the n-gram
                self._index.setdefault(tuple(tokens[end - n : end]), []).append((seq_id, end))

    def lookup(self, tokens: list[int], max_draft: int) -> Proposal:
        """What followed the longest suffix of `tokens` in a stored sequence (its latest occurrence), the match
        length and the run ([] , 0: none)."""
        found = self.continuations(tokens, max_draft, 1)
        return found[0] if found else NO_PROPOSAL

    def continuations(self, tokens: list[int], max_draft: int, limit: int) -> list[Proposal]:
        """`ContextIndex.continuations` over the stored sequences: what followed up to `limit` stored occurrences of
        the suffixes of `tokens`, longest suffix first, latest first at each length, with the match lengths and
        runs."""
        found: list[Proposal] = []
        seen: set[tuple[int, int]] = set()
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            hits = self._index.get(tuple(tokens[-n:])) if len(tokens) >= n else None
            for j in range(len(hits) - 1 if hits else -1, -1, -1):
                if len(found) == limit:
                    return found
                if hits[j] not in seen:
                    seen.add(hits[j])
                    seq_id, end = hits[j]
                    source = self._sequences[seq_id]
                    found.append(Proposal(source[end : end + max_draft], n, agreement(tokens, source, end, n)))
        return found


def store_for(store: SuffixStore | None, config: RouterConfig) -> SuffixStore | None:
    """The store of earlier sequences `config` keeps: `store` where it is sized as `config` sizes one, else a new
    one; None where `config` keeps none (`ngram_store_tokens` 0, or the tier off)."""
    if not config.ngram_tier or config.ngram_store_tokens <= 0:
        return None
    shape = (config.ngram_store_tokens, config.ngram_size, config.ngram_min_size)
    if store is None or (store.max_tokens, store.max_ngram, store.min_ngram) != shape:
        store = SuffixStore(*shape)
    return store
