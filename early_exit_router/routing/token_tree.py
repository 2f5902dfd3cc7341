"""Token trees: several continuations of the same context, merged where they agree, verified in one pass.

Where the text before the current token occurred several times, what followed it need not be the same each time
(the rows of a table, the cases of a test file, the earlier answers to similar requests). A chain drafts one of those
continuations and loses the whole draft where it turns out to be the wrong one; a tree drafts them all, sharing
their common prefixes (SpecInfer, Medusa, EAGLE-2, SuffixDecoding do the same).

Each node's first child continues the latest occurrence behind it: the chain the tier would draft. Given its parent,
that child is accepted with the tier's per-position acceptance `a` at this match class (so a tree's first path is
costed exactly as a chain), and the other children share what is left: each is accepted with probability
`(1 - a) x b x` its part of the alternatives' weight (how many occurrences continued with it), where `b` is the
estimated chance that an alternative is right once the first child is not (learned from the trees' own verdicts).
A path's probability is the product along it, so a node is never more likely than its parent, and
`TokenTree.top(k)` keeps the k most likely nodes with their parents; the cost policy picks k (`DraftPolicy.plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenTree:
    """Drafted nodes in an order where a parent comes before its children; the root (-1) is the current token."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]  # the parent's node index, -1: the root
    weights: tuple[float, ...]  # the continuations' weight through the node
    match: int  # the first continuation's match class (`Proposal.match_class`: the acceptance estimate's key)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> list[int]:
        """Each node's depth: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def first_children(self) -> list[bool]:
        """Per node, whether it is its parent's first child (the latest occurrence's continuation)."""
        seen: set[int] = set()
        first = []
        for parent in self.parents:
            first.append(parent not in seen)
            seen.add(parent)
        return first

    @property
    def branches(self) -> bool:
        """Whether some node has more than one child (else the tree is a chain)."""
        return len(set(self.parents)) < len(self.parents)

    def chain(self) -> list[int]:
        """The tokens of the first continuation (the first child at every node): the chain a tree replaces."""
        out, node = [], -1
        for i, parent in enumerate(self.parents):
            if parent == node:
                out.append(self.tokens[i])
                node = i
        return out

    def path_probabilities(self, a: float, b: float) -> list[float]:
        """Per node, the estimated probability that the path to it is accepted (see the module docstring): `a` for
        a first child given its parent, (1 - a) x b x its part of the alternatives' weight for another."""
        alternatives: dict[int, float] = {}
        first = self.first_children()
        for parent, weight, is_first in zip(self.parents, self.weights, first):
            if not is_first:
                alternatives[parent] = alternatives.get(parent, 0.0) + weight
        out: list[float] = []
        for parent, weight, is_first in zip(self.parents, self.weights, first):
            given = a if is_first else (1.0 - a) * b * weight / alternatives[parent]
            out.append(given * (1.0 if parent < 0 else out[parent]))
        return out

    def top(self, k: int, a: float, b: float) -> TokenTree:
        """The k nodes most likely accepted (their parents are always among them: a child is never more likely than
        its parent, and a tie keeps the earlier node), in the original order."""
        probs = self.path_probabilities(a, b)
        kept = sorted(sorted(range(len(self)), key=lambda i: (-probs[i], i))[:k])
        new = {old: j for j, old in enumerate(kept)}
        return TokenTree(
            tuple(self.tokens[i] for i in kept),
            tuple(-1 if self.parents[i] < 0 else new[self.parents[i]] for i in kept),
            tuple(self.weights[i] for i in kept),
            self.match,
        )

    def ancestors(self) -> list[list[int]]:
        """Per node, the nodes on its path from the root, itself included (what its attention may see)."""
        out: list[list[int]] = []
        for i, parent in enumerate(self.parents):
            out.append(([] if parent < 0 else out[parent]) + [i])
        return out

    def walk(self, choose: Callable[[int, list[int]], int]) -> tuple[list[int], int]:
        """Follow the full model from the root: `choose(node, path)` is its token after `node` (-1: the root), reached
        by `path`; while that token is one of the node's children, go on from that child. Returns the path kept (its
        nodes, root excluded) and the token chosen after it."""
        children: dict[tuple[int, int], int] = {}
        for i, (parent, token) in enumerate(zip(self.parents, self.tokens)):
            children.setdefault((parent, token), i)
        path: list[int] = []
        node = -1
        while (child := children.get((node, token := choose(node, path)))) is not None:
            path.append(child)
            node = child
        return path, token

    def accepted_path(self, choices: Sequence[int]) -> list[int]:
        """`walk` where the full model's tokens are known: `choices[0]` after the root, `choices[i + 1]` after node i
        (greedy). Returns the longest path it agrees with, root excluded."""
        return self.walk(lambda node, path: choices[node + 1])[0]


def build_tree(continuations: Sequence[tuple[Sequence[int], float]], match: int) -> TokenTree:
    """Merge weighted continuations into a tree; the first continuation is the tree's first path (a tree of one
    continuation is that chain)."""
    tokens: list[int] = []
    parents: list[int] = []
    weights: list[float] = []
    index: dict[tuple[int, int], int] = {}
    for continuation, weight in continuations:
        node = -1
        for token in continuation:
            key = (node, int(token))
            child = index.get(key)
            if child is None:
                child = index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                weights.append(0.0)
            weights[child] += weight
            node = child
    return TokenTree(tuple(tokens), tuple(parents), tuple(weights), match)
