"""cache/tree_stats.py over a real RadixCache: the walk's sums against brute force whatever
its step size, read-only (no access time, split, lock or slot changes), partial walks, nodes
removed between steps, hit attribution, prefix text (and none for salted keys), clocks."""
import random

import torch

from radixserve.cache import tree_stats
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache


def make_cache(slots=4096, page_size=1):
    pool = KVPool(slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")
    return RadixCache(pool, page_size=page_size)


def publish(cache, key):
    slots = cache.kv_pool.alloc(len(key))
    cache.insert(key, slots)


def random_tree(seed, n=60):
    rng = random.Random(seed)
    cache = make_cache()
    keys = []
    for _ in range(n):
        base = rng.choice(keys) if keys and rng.random() < 0.7 else []
        key = base[:rng.randrange(len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        publish(cache, key)
        keys.append(key)
    return cache, keys


def state(cache):
    return [(n.node_id, list(n.key), n.last_access_time, n.lock_ref, n.value.tolist())
            for n in cache._walk()], cache._clock, cache._next_node_id


def brute(cache):
    """node_id -> (prefix through its edge, subtree tokens, subtree nodes)."""
    out = {}

    def visit(node, prefix):
        path = prefix + list(node.key)
        tokens, nodes = len(node.key), 1
        for child in node.children.values():
            t, c = visit(child, path)
            tokens, nodes = tokens + t, nodes + c
        if node is not cache.root:
            out[node.node_id] = (path, tokens, nodes)
        return tokens, nodes
    visit(cache.root, [])
    return out


def full_summary(cache, step, k=1000, **kw):
    walk = tree_stats.TreeWalk(cache, max_nodes=10_000)
    turns = 1
    while not walk.step(step):
        turns += 1
    return walk.summary(k, **kw), turns


def test_walk_sums_match_brute_force_for_any_step_size():
    cache, _ = random_tree(1)
    truth = brute(cache)
    decode = lambda ids: ",".join(map(str, ids))      # noqa: E731
    results = []
    for step in (1, 3, 10_000):
        summary, turns = full_summary(cache, step, text=decode)
        assert turns >= (len(truth) // step if step < 10_000 else 1)
        assert summary["nodes"] == len(truth) == cache.num_nodes() - 1
        assert summary["tokens"] == cache.total_size()
        assert not summary["partial"]
        long_paths = 0
        for e in summary["by_tokens"]:
            path, tokens, nodes = truth[e["node_id"]]
            long_paths += len(path) > tree_stats.PREFIX_HEAD + tree_stats.PREFIX_TAIL
            assert (e["depth"], e["subtree_tokens"], e["subtree_nodes"]) == (len(path), tokens, nodes)
            h, t = tree_stats.PREFIX_HEAD, tree_stats.PREFIX_TAIL
            head, tail = (path, []) if len(path) <= h + t else (path[:h], path[-t:])
            assert e["text_head"] == decode(head) and e["text_tail"] == decode(tail)
        assert long_paths > 0                    # both shapes of text were checked
        sizes = [e["subtree_tokens"] for e in summary["by_tokens"]]
        assert sizes == sorted(sizes, reverse=True)
        results.append(summary)
    assert results[0] == results[1] == results[2]


def test_everything_is_read_only():
    cache, keys = random_tree(2)
    node = cache.match_prefix(keys[5]).last_node
    cache.inc_lock_ref(node)
    before = state(cache)
    hits = tree_stats.attribute_hits(cache, [(k, 0, max(len(k) - 1, 0)) for k in keys])
    for k in keys:
        tree_stats.cached_path(cache, k + [99], len(k) + 1)
        tree_stats.cached_path(cache, k[:-1], len(k) - 1)   # may end mid-edge: no split
    summary, _ = full_summary(cache, 7, hits=hits, text=str, idle_of=float, age_of=float)
    assert state(cache) == before
    cache.check_integrity()
    assert sum(e["locked"] for e in summary["by_tokens"]) == summary["locked_nodes"] > 0


def test_cached_path_stops_mid_edge_and_where_the_tree_ends():
    cache = make_cache()
    publish(cache, [1, 2, 3, 4, 5, 6])
    publish(cache, [1, 2, 3, 9])
    path = tree_stats.cached_path(cache, [1, 2, 3, 4, 5, 7, 7], 7)
    assert [(len(n.key), used) for n, used in path] == [(3, 3), (3, 2)]
    assert tree_stats.cached_path(cache, [1, 2, 3, 4, 5, 6], 4)[-1][1] == 1    # the limit
    assert tree_stats.cached_path(cache, [8, 1], 2) == []
    assert cache.num_nodes() == 4


def test_hits_are_attributed_to_the_nodes_a_cached_prefix_reached():
    cache = make_cache()
    publish(cache, [1, 2, 3, 4, 5, 6])
    publish(cache, [1, 2, 3, 9, 9])
    top = cache.root.children[1]
    left, right = top.children[4], top.children[9]
    hits = tree_stats.attribute_hits(cache, [([1, 2, 3, 4, 5, 0], 0, 5),   # ends inside left
                                              ([1, 2, 3, 9, 9, 1], 0, 5),   # all of right
                                              ([1, 2, 7], 0, 2),            # inside top
                                              ([1, 2, 3], 0, 0)])           # no hit: nothing
    assert hits == {top.node_id: [1, 8], left.node_id: [1, 2], right.node_id: [1, 2]}
    summary, _ = full_summary(cache, 100, hits=hits)
    entry = {e["node_id"]: e for e in summary["by_hits"]}
    assert entry[top.node_id]["hits"] == 3 and entry[top.node_id]["hit_tokens"] == 12
    assert summary["by_hits"][0]["node_id"] == top.node_id


def test_salted_keys_walk_with_their_offset_and_show_no_text():
    salt = 12345 << 32
    cache = make_cache()
    publish(cache, [t + salt for t in [5, 6, 7, 8]])
    hits = tree_stats.attribute_hits(cache, [([5, 6, 7, 8, 9], salt, 4), ([5, 6, 7, 8], 0, 3)])
    assert list(hits.values()) == [[1, 4]]
    summary, _ = full_summary(cache, 10, hits=hits, text=str)
    (e,) = summary["by_tokens"]
    assert e["salted"] is True and "text_head" not in e


def test_a_walk_stops_at_max_nodes_and_skips_nodes_removed_between_steps():
    cache, _ = random_tree(3)
    walk = tree_stats.TreeWalk(cache, max_nodes=5)
    while not walk.step(2):
        pass
    summary = walk.summary(3)
    assert summary["partial"] and summary["nodes"] == 5
    walk = tree_stats.TreeWalk(cache, max_nodes=10_000)
    walk.step(2)
    cache.evict(cache.evictable_size())          # everything goes while the walk is halfway
    while not walk.step(2):
        pass
    assert walk.summary(3)["nodes"] == 2         # the two visited before; none removed after


def test_clock_and_ages_come_from_the_callbacks():
    cache, _ = random_tree(4, n=10)
    assert tree_stats.clock(cache) == (cache._clock, cache._next_node_id)
    assert tree_stats.clock(object()) == (0, 0)
    summary, _ = full_summary(cache, 100, idle_of=lambda tick: -tick, age_of=lambda nid: nid)
    nodes = {n.node_id: n for n in cache._walk()}
    for e in summary["by_tokens"]:
        assert e["idle_s"] == -nodes[e["node_id"]].last_access_time
        sub = [n.node_id for n in cache._walk() if _under(n, nodes[e["node_id"]])]
        assert e["age_s"] == min(sub)


def _under(node, top):
    while node is not None:
        if node is top:
            return True
        node = node.parent
    return False


def test_kept_hit_paths_stay_right_across_a_split():
    cache = make_cache()
    publish(cache, [1, 2, 3, 4, 5, 6, 7])
    prompts = [([1, 2, 3, 4, 5, 6, 9], 0, 6), ([1, 2, 3, 4, 5, 0], 0, 5)]
    kept = [tree_stats.hit_path(cache, *p) for p in prompts]
    publish(cache, [1, 2, 3, 8])                     # splits the edge after 3 tokens
    upper = cache.root.children[1]
    assert len(upper.key) == 3
    fresh, _ = full_summary(cache, 10, hits=tree_stats.attribute_hits(cache, prompts))
    stale, _ = full_summary(cache, 10, hits=tree_stats.sum_hits(kept))
    by_id = lambda s: {e["node_id"]: e for e in s["by_tokens"]}   # noqa: E731
    f, s = by_id(fresh), by_id(stale)
    assert {i: e["hits"] for i, e in f.items()} == {i: e["hits"] for i, e in s.items()}
    assert f[upper.node_id]["hit_tokens"] == s[upper.node_id]["hit_tokens"] == 11
