"""Prefix cache: the KV of prompt prefixes, reused across samples and operations.

A radix tree of token sequences per namespace. A namespace is (adapter key, weights
generation): the KV of a prefix is a pure function of the weights and the prefix tokens
(positions always start at 0), so an entry is valid exactly as long as the weights it was
computed with are the ones being served. Publishing new generator weights moves the adapter to a
new generation and the engine drops the old one (`drop_owner`), so stale entries never hit and
never hold memory.

Each tree edge holds a run of tokens and their KV, [N, 2, H, P, D] (the KVCache span layout).
`lookup` walks the longest cached prefix and returns the spans that cover it (views, no copy);
`insert` stores only the positions not cached yet, splitting an edge where a new prompt leaves
it. Memory is bounded by a byte budget: the least recently used leaves are evicted first (a
node with children is never evicted before them, so every cached path stays complete).

Not here: which prompts to look up (the sampler caps a hit at len(prompt) - 1, because the last
prompt token must run to give the first logits) and the tensors' device placement (spans stay
where the KV was computed), and the decode-time cache in which one prompt's KV serves all of
its samples within one generate call (model/fanout_kv_cache.FanoutKVCache).

Legend: N = layers, H = KV heads, P = positions of a span, D = head dim.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

Namespace = tuple[str, int]  # (owner: the generator adapter key, weights generation)


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # the edge from the parent; () at a namespace root
    kv_N2HPD: Tensor | None  # None at a namespace root
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.kv_N2HPD is None else self.kv_N2HPD.numel() * self.kv_N2HPD.element_size()


def _common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int, end: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:end]."""
    limit = min(len(edge), end - start)
    for offset in range(limit):
        if edge[offset] != tokens[start + offset]:
            return offset
    return limit


class PrefixCache:
    """KV spans of token prefixes under a byte budget; budget 0 disables caching."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._roots: dict[Namespace, _Node] = {}
        self._clock = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def lookup(
        self, namespace: Namespace, tokens: Sequence[int], *, max_tokens: int
    ) -> list[Tensor]:
        """Spans [N, 2, H, P, D] covering the longest cached prefix of tokens[:max_tokens], in
        order (their P add up to the hit length); [] on a miss."""
        root = self._roots.get(namespace)
        if root is None or max_tokens <= 0:
            return []
        now = next(self._clock)
        spans: list[Tensor] = []
        node, position = root, 0
        root.last_used = now
        while position < max_tokens:
            child = node.children.get(tokens[position])
            if child is None:
                break
            matched = _common_length(child.tokens, tokens, position, max_tokens)
            assert child.kv_N2HPD is not None and matched > 0, "radix edge keyed by its 1st token"
            child.last_used = now
            spans.append(child.kv_N2HPD[:, :, :, :matched])
            position += matched
            if matched < len(child.tokens):
                break
            node = child
        return spans

    def insert(
        self, namespace: Namespace, tokens: Sequence[int], kv_of: Callable[[int, int], Tensor]
    ) -> None:
        """Cache the KV of `tokens`; kv_of(start, end) returns positions start .. end - 1 of it
        ([N, 2, H, P, D], any view): only the positions not cached yet are read and copied."""
        if not self.enabled or not tokens:
            return
        now = next(self._clock)
        root = self._roots.setdefault(namespace, _Node((), None, None))
        node, position = root, 0
        root.last_used = now
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                new = _Node(
                    tuple(tokens[position:]),
                    kv_of(position, len(tokens)).clone(),
                    node,
                    last_used=now,
                )
                node.children[tokens[position]] = new
                self.nbytes += new.nbytes
                break
            matched = _common_length(child.tokens, tokens, position, len(tokens))
            if matched < len(child.tokens):
                self._split(child, matched)
            child.last_used = now
            node, position = child, position + matched
        self._evict()

    def drop_owner(self, owner: str) -> None:
        """Forget every namespace of `owner` (its weights changed, or it is gone)."""
        for namespace in [ns for ns in self._roots if ns[0] == owner]:
            root = self._roots.pop(namespace)
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self.nbytes -= node.nbytes
                stack.extend(node.children.values())

    def _split(self, node: _Node, at: int) -> None:
        """Cut node's edge after `at` tokens: node keeps the head, a new child the tail.

        Both halves are copied so each owns exactly its bytes (a view would keep the whole
        original alive after one half is evicted)."""
        assert node.kv_N2HPD is not None and 0 < at < len(node.tokens)
        tail = _Node(
            node.tokens[at:],
            node.kv_N2HPD[:, :, :, at:].clone(),
            node,
            children=node.children,
            last_used=node.last_used,
        )
        for grandchild in tail.children.values():
            grandchild.parent = tail
        node.tokens = node.tokens[:at]
        node.kv_N2HPD = node.kv_N2HPD[:, :, :, :at].clone()
        node.children = {tail.tokens[0]: tail}

    def _evict(self) -> None:
        """Drop least recently used leaves until the cache fits its budget."""
        if self.nbytes <= self.budget_bytes:
            return
        order = itertools.count()  # tie-breaker: heapq never compares nodes
        leaves = [
            (node.last_used, next(order), node) for node in self._nodes() if not node.children
        ]
        heapq.heapify(leaves)
        while self.nbytes > self.budget_bytes and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self.nbytes -= leaf.nbytes
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.last_used, next(order), parent))
        for namespace in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[namespace]

    def _nodes(self) -> list[_Node]:
        nodes: list[_Node] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes
