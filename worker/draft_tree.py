"""Draft trees: a request's drafts as a tree of alternatives rather than one chain.

A tree's nodes are listed so that each node's parent comes before it: `parents[j]` is the index
of node j's parent among the drafts, or -1 for a child of the root (the request's last known
token, which the verify step computes with them). A chain of k drafts is parents [-1, 0, ..,
k - 2]. The verify step computes the root and every node in one pass: node j's KV goes to the
position after the root's plus j (the slots a chain would use), its RoPE position is the root's
plus its depth, and it attends to the cached context, the root, its ancestors and itself
(`contexts`). Greedy acceptance walks down from the root along the children whose token is the
target's argmax (`accept`); the kept nodes' KV then moves to the positions a chain would have
put them at (`moves`).

Static trees come from rank paths (as Medusa and EAGLE write them): (0,) is the head's first
choice after the root, (0, 1) the second choice after that, and so on (`from_paths`).
"""

from __future__ import annotations

from collections.abc import Sequence


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == j - 1 for j, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: Sequence[int], j: int) -> list[int]:
    """Nodes from the root's child down to j (inclusive)."""
    out = []
    while j >= 0:
        out.append(j)
        j = parents[j]
    return out[::-1]


def contexts(root: int, num_before: int, parents: Sequence[int]
             ) -> list[tuple[int, list[int]]]:
    """Each query row's attention context in a verify chunk whose root is at position `root`
    (position = slot index in the request's table), after `num_before` plain rows (causal: the
    rest of a prompt): rows before the root and the root see positions 0 .. their own; node j
    (row num_before + 1 + j, KV at root + 1 + j) sees 0 .. root, then its path's KV."""
    first = root - num_before
    rows = [(first + r + 1, []) for r in range(num_before + 1)]
    for j in range(len(parents)):
        rows.append((root + 1, [root + 1 + n for n in path(parents, j)]))
    return rows


def accept(top: Sequence[int], drafts: Sequence[int], parents: Sequence[int]
           ) -> tuple[list[int], list[int]]:
    """Greedy: top[0] is the root row's argmax, top[1 + j] node j's. Returns (tokens: the kept
    drafts then the target's next token, the kept nodes)."""
    kept, at = [], -1
    while True:
        want = top[at + 1]
        child = next((j for j, p in enumerate(parents) if p == at and drafts[j] == want), None)
        if child is None:
            return [drafts[j] for j in kept] + [want], kept
        kept.append(child)
        at = child


def moves(root: int, kept: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) positions that put the kept nodes' KV where a chain's would be: node kept[i]
    at root + 1 + kept[i] goes to root + 1 + i (only those not there already)."""
    return [(root + 1 + j, root + 1 + i) for i, j in enumerate(kept) if j != i]


def from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Rank paths -> (the nodes' rank paths in tree order: by depth, then as given; parents).
    ValueError when a path's prefix is missing or a path repeats."""
    nodes = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), [*p]))
    if len(nodes) != len(paths) or not nodes or any(not p or min(p) < 0 for p in nodes):
        raise ValueError("draft tree: paths must be distinct, non-empty rank lists")
    index = {p: j for j, p in enumerate(nodes)}
    parents = []
    for p in nodes:
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"draft tree: path {list(p)} has no parent {list(p[:-1])}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return nodes, parents
