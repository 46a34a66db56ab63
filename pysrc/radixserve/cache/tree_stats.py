"""Read-only views of a RadixCache for the dashboard (server/dashboard.py): never touches an
access time, never splits an edge, never locks, never frees. Event-loop thread (the tree's).

  * `clock(cache)`: the tree's logical clocks (access ticks, node ids handed out), which the
    dashboard samples with the wall time to turn a node's access tick and id into ages.
  * `cached_path(cache, key, limit)`: the nodes the first `limit` tokens of key run through.
  * `attribute_hits(cache, prompts)` (= `sum_hits` of each prompt's `hit_path`): per node, how
    many recent prompts' cached prefixes ended on its edge and how many of their cached
    tokens its edge served.
  * `TreeWalk`: a breadth-first walk that can stop and resume (`step(n)` visits up to n
    nodes), so a large tree is read over several turns of the loop instead of one long stall,
    then `summary(...)`: node and token totals and the top-K subtrees by tokens held and by
    hits. Nodes removed between two steps are skipped; a split between two steps may leave
    the new upper node's tokens out (its lower half, already queued, is still counted): the
    totals of a walk over a changing tree are approximate, by that much.
Subtree sums are over the nodes the walk visited; a walk cut at `max_nodes` says so
(`partial`) and sums only the top of the tree (breadth-first: the shallowest nodes).
"""
from __future__ import annotations

import collections
import heapq
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple

SALT_BASE = 1 << 32        # ids at or above it are salted keys (engine/req.salt_offset)
PREFIX_HEAD = 16           # tokens of a node's prefix decoded from its start
PREFIX_TAIL = 32           # and from its end


def clock(cache: Any) -> Tuple[int, int]:
    """(access ticks so far, node ids handed out so far); (0, 0) for a cache that has none
    (ChunkCache)."""
    return getattr(cache, "_clock", 0), getattr(cache, "_next_node_id", 0)


def is_radix(cache: Any) -> bool:
    return hasattr(cache, "root") and hasattr(cache, "_child_key")


def cached_path(cache: Any, key: Sequence[int], limit: int) -> List[Tuple[Any, int]]:
    """The nodes holding key[:limit] now, root excluded, each with how many of its edge's
    tokens lie within key[:limit] (the last one may be cut mid-edge); stops where the tree
    stops matching."""
    out: List[Tuple[Any, int]] = []
    node, pos = cache.root, 0
    limit = min(limit, len(key))
    while pos < limit:
        child = node.children.get(cache._child_key(key, pos))
        if child is None:
            break
        edge = child.key
        m = min(len(edge), limit - pos)
        if key[pos:pos + m] != edge[:m]:
            same = 0
            while same < m and key[pos + same] == edge[same]:
                same += 1
            if same:
                out.append((child, same))
            break
        out.append((child, m))
        pos += m
        if m < len(edge):
            break
        node = child
    return out


def hit_path(cache: Any, ids: Sequence[int], salt: int, cached: int) -> List[Tuple[int, int]]:
    """[(node id, cached tokens its edge served)] of one prompt (ids, its salt offset, its cached
    tokens), root first, over the tree as it is now (a prefix evicted since counts only as far
    as the tree still holds it). Kept for later summaries it stays right as the tree changes:
    a split keeps the lower half's id (the deepest node is still the one the hit ended on; the
    new upper node's share is credited to the lower one, so subtree sums from the upper node
    up are unchanged), and an evicted node's id is simply no longer in the tree."""
    if cached <= 0:
        return []
    key = ids if not salt else [t + salt for t in ids[:cached]]
    return [(node.node_id, served) for node, served in cached_path(cache, key, cached)]


def sum_hits(paths: Iterable[List[Tuple[int, int]]]) -> Dict[int, List[int]]:
    """{node_id: [prompts whose cached prefix ended on its edge, cached tokens its edge served
    them]} of hit_path results."""
    hits: Dict[int, List[int]] = {}
    for path in paths:
        for node_id, served in path:
            entry = hits.setdefault(node_id, [0, 0])
            entry[1] += served
        if path:
            hits[path[-1][0]][0] += 1
    return hits


def attribute_hits(cache: Any, prompts: Iterable[Tuple[Sequence[int], int, int]]
                   ) -> Dict[int, List[int]]:
    """sum_hits of the hit_path of prompts given as (ids, salt offset, cached tokens)."""
    return sum_hits(hit_path(cache, ids, salt, cached) for ids, salt, cached in prompts)


class TreeWalk:
    """A breadth-first walk of a RadixCache's nodes (module docstring): construct, call
    step(n) until it returns True, then summary(). Loop thread, with no await inside a step."""

    def __init__(self, cache: Any, max_nodes: int):
        self.cache = cache
        self.max_nodes = max_nodes
        # per visited node: the node, parent's index (-1: a child of the root), tokens before
        # its edge, its edge's tokens, locked, access tick, id, children
        self.nodes: List[Any] = []
        self.parent: List[int] = []
        self.depth: List[int] = []
        self.edge: List[int] = []
        self.locked: List[bool] = []
        self.tick: List[int] = []
        self.node_id: List[int] = []
        self.fanout: List[int] = []
        self._queue: Deque[Tuple[Any, int, int]] = collections.deque(
            (child, -1, 0) for child in list(cache.root.children.values()))
        self.partial = False

    def step(self, n: int) -> bool:
        """Visit up to n more nodes; True when the walk is over (every node reached, or
        max_nodes visited: then `partial`)."""
        queue = self._queue
        while n > 0 and queue:
            if len(self.nodes) >= self.max_nodes:
                self.partial = True
                queue.clear()
                break
            node, parent, depth = queue.popleft()
            if node.removed:
                continue
            index = len(self.nodes)
            length = len(node.key)
            children = list(node.children.values())
            self.nodes.append(node)
            self.parent.append(parent)
            self.depth.append(depth)
            self.edge.append(length)
            self.locked.append(node.lock_ref > 0)
            self.tick.append(node.last_access_time)
            self.node_id.append(node.node_id)
            self.fanout.append(len(children))
            for child in children:
                queue.append((child, index, depth + length))
            n -= 1
        return not queue

    def summary(self, k: int, hits: Optional[Dict[int, List[int]]] = None,
                text: Optional[Callable[[List[int]], str]] = None,
                idle_of: Optional[Callable[[int], Any]] = None,
                age_of: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
        """Totals and the top k subtrees by tokens held and by hits (each an entry: node id,
        depth = prefix tokens through its edge, edge and subtree tokens, subtree nodes,
        children, locked, hits and hit tokens of its subtree, and, given the callbacks, its
        idle time (idle_of(access tick)), its age (age_of(oldest node id in its subtree)) and
        its prefix's text (text(ids): the first PREFIX_HEAD and last PREFIX_TAIL tokens;
        salted prefixes get none)). hits: attribute_hits' map."""
        hits = hits or {}
        count = len(self.nodes)
        sub_tokens = list(self.edge)
        sub_nodes = [1] * count
        sub_hits = [hits.get(i, (0, 0))[0] for i in self.node_id]
        sub_hit_tokens = [hits.get(i, (0, 0))[1] for i in self.node_id]
        oldest = list(self.node_id)
        for i in range(count - 1, -1, -1):      # children come after their parent
            p = self.parent[i]
            if p >= 0:
                sub_tokens[p] += sub_tokens[i]
                sub_nodes[p] += sub_nodes[i]
                sub_hits[p] += sub_hits[i]
                sub_hit_tokens[p] += sub_hit_tokens[i]
                if oldest[i] < oldest[p]:
                    oldest[p] = oldest[i]

        def entry(i: int) -> Dict[str, Any]:
            e: Dict[str, Any] = {
                "node_id": self.node_id[i], "depth": self.depth[i] + self.edge[i],
                "edge_tokens": self.edge[i], "subtree_tokens": sub_tokens[i],
                "subtree_nodes": sub_nodes[i], "children": self.fanout[i],
                "locked": self.locked[i], "hits": sub_hits[i], "hit_tokens": sub_hit_tokens[i]}
            if idle_of is not None:
                e["idle_s"] = idle_of(self.tick[i])
            if age_of is not None:
                e["age_s"] = age_of(oldest[i])
            if text is not None:
                head, tail = self._prefix(i)
                if any(t >= SALT_BASE for t in head):
                    e["salted"] = True
                else:
                    e["text_head"] = text(head)
                    e["text_tail"] = text(tail) if tail else ""
            return e

        made: Dict[int, Dict[str, Any]] = {}       # a node on both lists is described once

        def described(i: int) -> Dict[str, Any]:
            if i not in made:
                made[i] = entry(i)
            return dict(made[i])

        by_tokens = heapq.nlargest(k, range(count), key=lambda i: (sub_tokens[i], -i))
        with_hits = [i for i in range(count) if sub_hits[i] > 0]
        by_hits = heapq.nlargest(k, with_hits,
                                 key=lambda i: (sub_hits[i], sub_hit_tokens[i], -i))
        return {
            "nodes": count, "tokens": sum(self.edge), "partial": self.partial,
            "leaves": sum(1 for f in self.fanout if f == 0),
            "locked_nodes": sum(self.locked),
            "max_depth": max((self.depth[i] + self.edge[i] for i in range(count)), default=0),
            "by_tokens": [described(i) for i in by_tokens],
            "by_hits": [described(i) for i in by_hits],
        }

    def _prefix(self, i: int) -> Tuple[List[int], List[int]]:
        """Node i's prefix (root to the end of its edge) whole, and no tail, when it has at most
        PREFIX_HEAD + PREFIX_TAIL tokens; else its first PREFIX_HEAD and last PREFIX_TAIL."""
        chain = []
        while i >= 0:
            chain.append(self.nodes[i])
            i = self.parent[i]
        chain.reverse()
        total = sum(len(n.key) for n in chain)
        if total <= PREFIX_HEAD + PREFIX_TAIL:
            return [t for n in chain for t in n.key], []
        head: List[int] = []
        for node in chain:
            head.extend(node.key[:PREFIX_HEAD - len(head)])
            if len(head) >= PREFIX_HEAD:
                break
        rest = total - len(head)
        want = min(PREFIX_TAIL, rest)
        tail: List[int] = []
        for node in reversed(chain):
            if len(tail) >= want:
                break
            take = want - len(tail)
            tail[:0] = node.key[-take:] if take < len(node.key) else node.key
        return head, tail[-want:] if want else []
