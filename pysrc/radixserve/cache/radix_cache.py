"""RadixCache: a compressed trie over token ids whose nodes index KV slots in the KVPool.

Each node holds an edge (`key`, a list of token ids) and the slots of those tokens (`value`, an
int64 CPU tensor of the same length); children are keyed by their edge's first page (the first
token when page_size == 1). The tree stores no K/V tensors: it is an index into the pool, and the
pool's free list plus the tree's slots plus the running requests' own slots account for every
slot (see cache/base.py for the ownership rules this class implements).

Locks. `inc_lock_ref(node)` adds one to the lock_ref of node and of every ancestor below the root;
`dec_lock_ref` undoes it. Precisely, for every non-root node n:
    n.lock_ref == n.direct_locks + sum(c.lock_ref for c in n.children)
where `direct_locks` counts the outstanding inc_lock_ref calls made on n itself (splits keep
handles valid: the original node object keeps the lower part of its edge, so a handle still names
the deepest locked node, and the new upper node inherits the child's lock_ref with no direct
locks). A node's slots count as protected when its lock_ref > 0, else as evictable.

Eviction is LRU over unlocked leaves and incremental: the set of evictable leaves (no children,
lock_ref == 0) is maintained on every insert / lock / unlock / split / evict, and a min-heap keyed
by (last_access_time, node id) with lazy deletion orders it. A heap entry is live only while its
node is in the evictable set and the entry's time equals the node's current access time; stale
entries are skipped when popped and the heap is rebuilt from the set when stale ones dominate.
Access times come from a per-cache monotonic counter (one tick per match / insert), so behaviour
is deterministic. Every operation touches a whole root-to-node path with one tick, hence a parent
is never older than its children and leaf-LRU order is subtree-LRU order.

Pages. With page_size > 1 the tree works in whole pages: match_prefix matches a multiple of
page_size tokens; insert publishes only the leading whole pages of its key and, because insert
takes ownership of ALL given slots, frees the slots of the trailing partial page itself.

KV events (--kv-events-config, cache/kv_events.py). With a publisher, each node also keeps
`blocks`: (end offset on its edge, hash) of every event block (block_size tokens from the root)
whose last position lies on its edge. insert announces the blocks ending on its new leaf
(BlockStored, chained from the last block on the matched path), evict the blocks of the leaves it
frees (BlockRemoved), reset AllBlocksCleared (also sent once at construction: a new tree is
empty); a split moves each block to the half holding its end and announces nothing. Each public
call queues at most one batch and never waits (kv_events.ZmqEventPublisher.publish).
"""
from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from radixserve.cache import kv_events as kv_events_module
from radixserve.cache.base import MatchResult, PrefixCache
from radixserve.cache.kv_pool import KVPool


class RadixNode:
    """One trie node. The root has an empty key and value and is never evicted or locked."""

    __slots__ = ("key", "value", "children", "parent", "lock_ref", "direct_locks",
                 "last_access_time", "node_id", "removed", "blocks")

    def __init__(self, key: List[int], value: torch.Tensor, parent: Optional["RadixNode"],
                 node_id: int, last_access_time: int):
        self.key = key                      # token ids of this edge
        self.value = value                  # [len(key)] int64 slots (CPU)
        self.children: Dict[object, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.direct_locks = 0
        self.last_access_time = last_access_time
        self.node_id = node_id
        self.removed = False                # set once evicted or dropped by reset
        self.blocks: Optional[List[Tuple[int, int]]] = None   # KV events: (end offset, hash)

    def __repr__(self) -> str:
        return (f"RadixNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"t={self.last_access_time}, children={len(self.children)})")


def _common_prefix_len(a: Sequence[int], a_start: int, a_end: int, b: Sequence[int]) -> int:
    """Length of the common prefix of a[a_start:a_end] and b."""
    n = min(a_end - a_start, len(b))
    i = 0
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    """Prefix cache with token (or page) precision sharing; see the module docstring."""

    def __init__(self, kv_pool: KVPool, page_size: int = 1, kv_events: Any = None,
                 kv_event_block_size: Optional[int] = None):
        """kv_events: None, or a publisher (`publish(list of kv_events.*Event) -> bool`, e.g.
        kv_events.ZmqEventPublisher) told of every block stored and removed, in blocks of
        kv_event_block_size tokens (a multiple of page_size; default: page_size, 16 when that
        is 1)."""
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.kv_pool = kv_pool
        self.page_size = page_size
        self._next_node_id = 0
        self._clock = 0
        self.kv_events = kv_events
        self.kv_event_block_size = kv_event_block_size or (
            page_size if page_size > 1 else kv_events_module.DEFAULT_BLOCK_SIZE)
        if self.kv_event_block_size % page_size:
            # siblings can share a page's first tokens, so a block must end on a page boundary
            raise ValueError(f"the KV event block size ({self.kv_event_block_size}) must be a "
                             f"multiple of the page size ({page_size})")
        device = getattr(kv_pool, "device", None)
        self._medium = kv_events_module.MEDIUM_GPU if getattr(device, "type", "cpu") == "cuda" \
            else kv_events_module.MEDIUM_CPU
        self._init_tree()
        if self.kv_events is not None:
            self.kv_events.publish([kv_events_module.AllBlocksClearedEvent()])

    @classmethod
    def from_server_args(cls, kv_pool: KVPool, server_args: Any) -> "RadixCache":
        """The server's cache: --page-size, and with --kv-events-config a started publisher
        (raises ValueError naming the flag when its sockets cannot be opened)."""
        page_size = getattr(server_args, "page_size", 1)
        publisher, config = kv_events_module.open_publisher(
            getattr(server_args, "kv_events_config", None))
        block_size = config.resolved_block_size(page_size) if config is not None else None
        return cls(kv_pool, page_size=page_size, kv_events=publisher,
                   kv_event_block_size=block_size)

    def close(self) -> None:
        """Stop the KV event publisher, if any (it sends what is queued first)."""
        if self.kv_events is not None and hasattr(self.kv_events, "close"):
            self.kv_events.close()

    # ------------------------------------------------------------------ state

    def _init_tree(self) -> None:
        self.root = self._new_node([], torch.empty(0, dtype=torch.int64), None, 0)
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 1
        self._evictable_leaves: Dict[int, RadixNode] = {}         # node_id -> node
        self._heap: List[Tuple[int, int, RadixNode]] = []         # (access time, node_id, node)

    def _new_node(self, key: List[int], value: torch.Tensor, parent: Optional[RadixNode],
                  t: int) -> RadixNode:
        node = RadixNode(key, value, parent, self._next_node_id, t)
        self._next_node_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: Sequence[int], start: int) -> object:
        if self.page_size == 1:
            return key[start]
        return tuple(key[start:start + self.page_size])

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    # ---------------------------------------------------- evictable-leaf index

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _refresh_leaf_state(self, node: RadixNode) -> None:
        """Re-derive node's membership of the evictable set after a change to it."""
        if node is self.root:
            return
        if self._is_evictable_leaf(node):
            if node.node_id not in self._evictable_leaves:
                self._evictable_leaves[node.node_id] = node
                self._push_heap(node)
        else:
            self._evictable_leaves.pop(node.node_id, None)

    def _touch(self, node: RadixNode, t: int) -> None:
        if node.last_access_time == t:
            return
        node.last_access_time = t
        if node.node_id in self._evictable_leaves:
            self._push_heap(node)   # the old entry becomes stale (time mismatch)

    def _push_heap(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access_time, node.node_id, node))
        # Lazy deletion leaves stale entries behind; rebuild once they outnumber live ones.
        if len(self._heap) > 2 * len(self._evictable_leaves) + 64:
            self._heap = [(n.last_access_time, n.node_id, n) for n in self._evictable_leaves.values()]
            heapq.heapify(self._heap)

    def _entry_is_live(self, entry: Tuple[int, int, RadixNode]) -> bool:
        t, node_id, node = entry
        return node_id in self._evictable_leaves and node.last_access_time == t

    # ------------------------------------------------------------- structure

    def _split(self, child: RadixNode, split_len: int) -> RadixNode:
        """Split child's edge after split_len tokens; returns the new upper node.

        The child object keeps the lower part so outstanding lock handles stay valid."""
        parent = child.parent
        upper = self._new_node(child.key[:split_len], child.value[:split_len], parent,
                               child.last_access_time)
        upper.lock_ref = child.lock_ref
        upper.children[self._child_key(child.key, split_len)] = child
        parent.children[self._child_key(child.key, 0)] = upper
        child.parent = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        if child.blocks:        # each event block stays with the half holding its last position
            upper.blocks = [(end, h) for end, h in child.blocks if end <= split_len]
            child.blocks = [(end - split_len, h) for end, h in child.blocks if end > split_len]
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------ interface

    def match_prefix(self, key: List[int]) -> MatchResult:
        """Longest cached prefix of key in whole pages. Touches the matched path (LRU); splits the
        last edge when the match ends inside it, so last_node ends exactly at the match."""
        n = self._page_floor(len(key))
        t = self._tick()
        node = self.root
        self._touch(node, t)
        values: List[torch.Tensor] = []
        pos = 0
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            common = self._page_floor(_common_prefix_len(key, pos, n, child.key))
            ends_mid_edge = common < len(child.key)
            if ends_mid_edge:
                child = self._split(child, common)
            self._touch(child, t)
            values.append(child.value)
            pos += common
            node = child
            if ends_mid_edge:
                break
        if not values:
            return MatchResult(torch.empty(0, dtype=torch.int64), node)
        return MatchResult(values[0] if len(values) == 1 else torch.cat(values), node)

    def continuation(self, key: Sequence[int], max_tokens: int) -> List[int]:
        """PrefixCache.continuation: walk key down the tree (every token, pages or not); from
        where it ends, follow the rest of that edge, then at each node the most recently used
        child, until max_tokens. O(len(key)) comparisons; changes nothing."""
        node, pos, n = self.root, 0, len(key)
        edge_off = 0                       # how far into node.key the walk is
        while pos < n:
            if edge_off == len(node.key):  # at node's end: the child that continues key
                nxt = None
                for child in node.children.values():
                    if child.key and child.key[0] == key[pos]:
                        nxt = child
                        break
                if nxt is None:
                    return []
                node, edge_off = nxt, 0
            common = _common_prefix_len(key, pos, n, node.key[edge_off:])
            if common == 0:
                return []
            pos += common
            edge_off += common
            if pos < n and edge_off < len(node.key):
                return []                  # key leaves the tree inside this edge
        out: List[int] = list(node.key[edge_off:edge_off + max_tokens])
        while len(out) < max_tokens and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access_time)
            out += node.key[:max_tokens - len(out)]
        return out

    def insert(self, key: List[int], indices: torch.Tensor) -> int:
        """Publish key's KV. Takes ownership of every slot in indices: slots at positions the tree
        already holds with a different slot are freed to the pool, as are the slots of a trailing
        partial page (page_size > 1). Returns the number of leading positions already cached."""
        if indices.numel() != len(key):
            raise ValueError(f"insert: {indices.numel()} slots for {len(key)} tokens")
        indices = indices.to(dtype=torch.int64, device="cpu")
        key = list(key)
        n = self._page_floor(len(key))
        if n < len(key):
            self.kv_pool.free(indices[n:])
        t = self._tick()
        node = self.root
        self._touch(node, t)
        pos = 0
        last_block: Optional[int] = None    # hash of the last event block on the matched path
        while pos < n:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            common = self._page_floor(_common_prefix_len(key, pos, n, child.key))
            ends_mid_edge = common < len(child.key)
            if ends_mid_edge:
                child = self._split(child, common)
            if child.blocks:
                last_block = child.blocks[-1][1]
            given = indices[pos:pos + common]
            duplicate = given != child.value
            if bool(duplicate.any()):
                self.kv_pool.free(given[duplicate])
            self._touch(child, t)
            pos += common
            node = child
            if ends_mid_edge:
                break
        if pos < n:
            leaf = self._new_node(key[pos:n], indices[pos:n].clone(), node, t)
            node.children[self._child_key(key, pos)] = leaf
            self._num_nodes += 1
            self._evictable_size += n - pos
            self._refresh_leaf_state(leaf)
            self._refresh_leaf_state(node)
            if self.kv_events is not None:
                self._publish_stored(leaf, key, pos, n, last_block)
        return pos

    def _publish_stored(self, leaf: RadixNode, key: List[int], start: int, end: int,
                        parent: Optional[int]) -> None:
        """The leaf holds key[start:end]: hash the event blocks ending on it (chained from
        `parent`, the last block before them) and announce them in one BlockStored."""
        b = self.kv_event_block_size
        first_end = (start // b + 1) * b
        if first_end > end:
            return
        blocks, hashes, h = [], [], parent
        for block_end in range(first_end, end + 1, b):
            h = kv_events_module.chain_hash(h, key[block_end - b:block_end])
            blocks.append((block_end - start, h))
            hashes.append(h)
        leaf.blocks = blocks
        self.kv_events.publish([kv_events_module.stored_event(
            parent, hashes, key[first_end - b:first_end - b + b * len(hashes)], b,
            self._medium)])

    def inc_lock_ref(self, node: RadixNode) -> None:
        if node is self.root:
            return
        if node.removed:
            raise AssertionError("inc_lock_ref on an evicted node")
        node.direct_locks += 1
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.value)
                self._protected_size += len(node.value)
            node.lock_ref += 1
            self._refresh_leaf_state(node)
            node = node.parent

    def dec_lock_ref(self, node: RadixNode) -> None:
        if node is self.root:
            return
        if node.direct_locks <= 0:
            raise AssertionError("dec_lock_ref without a matching inc_lock_ref")
        node.direct_locks -= 1
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node.value)
                self._evictable_size += len(node.value)
            self._refresh_leaf_state(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until num_tokens slots are freed or
        nothing evictable remains. A parent left childless and unlocked becomes evictable."""
        freed = 0
        removed: List[int] = []
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._entry_is_live(entry):
                continue
            node = entry[2]
            if node.blocks:
                removed.extend(h for _, h in node.blocks)
            self.kv_pool.free(node.value)
            freed += len(node.value)
            self._evictable_size -= len(node.value)
            del self._evictable_leaves[node.node_id]
            parent = node.parent
            del parent.children[self._child_key(node.key, 0)]
            node.removed = True
            node.parent = None
            self._num_nodes -= 1
            self._refresh_leaf_state(parent)
        if removed and self.kv_events is not None:
            self.kv_events.publish([kv_events_module.BlockRemovedEvent(removed, self._medium)])
        return freed

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        return self._num_nodes

    def owned_slots(self) -> torch.Tensor:
        values = [node.value for node in self._walk() if node is not self.root]
        if not values:
            return torch.empty(0, dtype=torch.int64)
        return torch.cat(values)

    def reset(self) -> None:
        """Free every slot the tree owns and start empty. Raises if any node is locked."""
        if self._protected_size != 0:
            raise AssertionError(f"reset with {self._protected_size} locked slots")
        owned = self.owned_slots()
        for node in self._walk():
            node.removed = True
        self.kv_pool.free(owned)
        self._init_tree()
        if self.kv_events is not None:
            self.kv_events.publish([kv_events_module.AllBlocksClearedEvent()])

    def event_blocks(self) -> Dict[int, Tuple[Optional[int], Tuple[int, ...]]]:
        """{hash: (parent hash, keys of the block)} of every event block the tree holds, from
        the tree itself (the state a subscriber that saw every batch rebuilds; for tests)."""
        b = self.kv_event_block_size
        out: Dict[int, Tuple[Optional[int], Tuple[int, ...]]] = {}
        stack: List[Tuple[RadixNode, List[int], Optional[int]]] = [(self.root, [], None)]
        while stack:
            node, prefix, last = stack.pop()
            for child in node.children.values():
                path = prefix + child.key
                h = last
                for block_end in range(len(prefix) // b * b + b, len(path) + 1, b):
                    keys = tuple(path[block_end - b:block_end])
                    h_new = kv_events_module.chain_hash(h, keys)
                    out[h_new] = (h, keys)
                    h = h_new
                stack.append((child, path, h))
        return out

    # ------------------------------------------------------------- checking

    def _walk(self) -> List[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Recompute everything from the tree and compare with the incremental state:
        evictable/protected sizes; lock_ref == direct_locks + sum of children's lock_ref and >= 0;
        edges non-empty, whole pages, len(key) == len(value), child keyed by its edge's first page,
        parent pointers; a parent's access time >= its children's; no slot owned twice, none is
        slot 0 or out of range or in the pool's free list; the evictable-leaf set equals the
        recomputed one and each member has a live heap entry."""
        nodes = self._walk()
        assert len(nodes) == self._num_nodes, (len(nodes), self._num_nodes)
        assert not self.root.key and self.root.value.numel() == 0 and self.root.lock_ref == 0
        evictable = protected = 0
        leaves = {}
        for node in nodes:
            assert not node.removed, f"removed node still in the tree: {node}"
            for ck, child in node.children.items():
                assert child.parent is node, f"bad parent pointer at {child}"
                assert ck == self._child_key(child.key, 0), f"child key {ck!r} mismatches {child}"
                assert child.last_access_time <= node.last_access_time, (node, child)
            if node is self.root:
                continue
            assert len(node.key) > 0 and len(node.key) % self.page_size == 0, node
            assert node.value.dtype == torch.int64 and node.value.numel() == len(node.key), node
            assert node.direct_locks >= 0 and node.lock_ref >= 0, node
            expected = node.direct_locks + sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref == expected, f"lock_ref {node.lock_ref} != {expected} at {node}"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            if self._is_evictable_leaf(node):
                leaves[node.node_id] = node
        assert evictable == self._evictable_size, (evictable, self._evictable_size)
        assert protected == self._protected_size, (protected, self._protected_size)
        assert leaves.keys() == self._evictable_leaves.keys(), "evictable-leaf set out of date"
        live = {nid for (t, nid, node) in self._heap if self._entry_is_live((t, nid, node))}
        assert live == set(leaves), "an evictable leaf has no live heap entry"
        owned = self.owned_slots()
        assert owned.numel() == evictable + protected
        if owned.numel():
            assert torch.unique(owned).numel() == owned.numel(), "a slot is owned twice"
            assert int(owned.min()) >= 1 and int(owned.max()) <= self.kv_pool.num_slots, \
                "slot out of range (or the padding slot 0)"
            free = self.kv_pool.free_slots()
            assert not bool(torch.isin(owned, free).any()), "a slot is both free and in the tree"
        if self.kv_events is not None:
            self._check_event_blocks()

    def _check_event_blocks(self) -> None:
        """Each node's `blocks` are exactly the event blocks ending on its edge, with the hash
        chained from the root (what subscribers were told)."""
        b = self.kv_event_block_size
        stack: List[Tuple[RadixNode, int, Optional[int]]] = [(self.root, 0, None)]
        while stack:
            node, depth, last = stack.pop()
            for child in node.children.values():
                end = depth + len(child.key)
                want, h = [], last
                for block_end in range(depth // b * b + b, end + 1, b):
                    keys = self._path_keys(child, block_end - depth - b, block_end - depth)
                    h = kv_events_module.chain_hash(h, keys)
                    want.append((block_end - depth, h))
                assert (child.blocks or []) == want, f"event blocks of {child} out of date"
                stack.append((child, end, h))

    def _path_keys(self, node: RadixNode, lo: int, hi: int) -> List[int]:
        """Keys at offsets [lo, hi) relative to the start of node's edge (lo may be negative:
        positions on its ancestors' edges)."""
        keys = list(node.key[max(lo, 0):hi])
        while lo < 0:
            node = node.parent
            take = node.key[max(len(node.key) + lo, 0):]
            keys = list(take) + keys
            lo += len(node.key)
        return keys
