"""KV events (--kv-events-config, cache/kv_events.py): a real ZMQ SUB socket on loopback
decodes the published batches with its own msgspec schema (vLLM's definitions, written out
here, not imported from radixserve), replays them into a block tree, and that tree equals the
radix tree after random inserts, matches, locks, evictions and flushes (the cache checked after
every operation), and after random requests, aborts and flushes through the Scheduler on the
default model (check_integrity after every step, as --debug-integrity does). Also: the wire
format byte for byte against vLLM's schema (map encoding) and its legacy one (array
encoding), the replay ROUTER socket, the config's JSON shapes, a full queue (dropped, counted,
followed by AllBlocksCleared, never blocking) and the counters on /metrics."""
from __future__ import annotations

import json
import random
import tempfile
import time
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import msgspec
import pytest
import torch
import zmq

from radixserve.cache import kv_events as ke
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from radixserve.engine.req import salt_offset


# --------------------------------------------------------------------------- vLLM's schema
# vllm/distributed/kv_events.py after vllm-project/vllm#42892: the batch positional, each event
# a tagged map; ExternalBlockHash = bytes | int. Fields with defaults as vLLM declares them, so
# decoding proves a current vLLM subscriber reads what we send.

class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: List[Union[bytes, int]]
    parent_block_hash: Union[bytes, int, None]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(VEvent):
    block_hashes: List[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(VEvent):
    pass


class VKVEventBatch(VBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# The same before #42892 (and SGLang's): events as tagged positional arrays.
class LEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LBlockStored(LEvent, tag="BlockStored"):
    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None


class LBlockRemoved(LEvent, tag="BlockRemoved"):
    block_hashes: List[int]
    medium: Optional[str] = None


class LAllBlocksCleared(LEvent, tag="AllBlocksCleared"):
    pass


class LKVEventBatch(VBatch):
    events: List[Union[LBlockStored, LBlockRemoved, LAllBlocksCleared]]


DECODE_MAP = msgspec.msgpack.Decoder(VKVEventBatch)
DECODE_ARRAY = msgspec.msgpack.Decoder(LKVEventBatch)


# --------------------------------------------------------------------------- the subscriber

class BlockTree:
    """What a subscriber knows: {hash: (parent hash, token ids, salt digest)}, rebuilt from
    decoded events only."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.blocks: Dict[int, Tuple[Optional[int], Tuple[int, ...], int]] = {}
        self.batches = 0
        self.removed = 0
        self.stored = 0

    def apply(self, batch) -> None:
        self.batches += 1
        assert batch.data_parallel_rank == self.rank
        for e in batch.events:
            name = type(e).__name__
            if name.endswith("AllBlocksCleared"):
                self.blocks.clear()
            elif name.endswith("BlockRemoved"):
                for h in e.block_hashes:
                    assert h in self.blocks, f"removal of an unknown block {h}"
                    del self.blocks[h]
                    self.removed += 1
            else:
                b = e.block_size
                assert len(e.token_ids) == b * len(e.block_hashes)
                assert e.medium == "CPU" and e.lora_id is None and e.lora_name is None
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    assert isinstance(h, int) and 0 <= h < 2 ** 63
                    assert h not in self.blocks, f"block {h} stored twice"
                    if parent is None:
                        extra = (e.extra_keys or [None] * len(e.block_hashes))[i]
                        salt = int(extra[0].split(":")[1], 16) if extra else 0
                    else:
                        assert parent in self.blocks, "a block whose parent is unknown"
                        salt = self.blocks[parent][2]
                    self.blocks[h] = (parent, tuple(e.token_ids[i * b:(i + 1) * b]), salt)
                    self.stored += 1
                    parent = h

    def prefixes(self) -> Set[Tuple[int, ...]]:
        """Every stored block's whole prefix, as radix keys (token + salt << 32)."""
        out = set()
        for h in self.blocks:
            parts = []
            while h is not None:
                parent, tokens, salt = self.blocks[h]
                parts.append(tuple(t + (salt << 32) for t in tokens))
                h = parent
            out.add(tuple(k for part in reversed(parts) for k in part))
        return out


class Subscriber:
    """A SUB socket (and, given a replay endpoint, a DEALER for replays) decoding with the
    schema above; checks that sequence numbers run 0, 1, 2, ... without a gap."""

    def __init__(self, ctx, endpoint: Optional[str], topic: str, decoder, bind=False, rank=0):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        if bind:
            self.sub.bind("tcp://127.0.0.1:*")
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(endpoint)
            self.endpoint = endpoint
        self.topic = topic.encode()
        self.decoder = decoder
        self.tree = BlockTree(rank)
        self.next_seq: Optional[int] = None

    def recv(self, timeout_ms: int) -> bool:
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq, payload = self.sub.recv_multipart()
        assert topic == self.topic
        seq = int.from_bytes(seq, "big")
        if self.next_seq is not None:
            assert seq == self.next_seq, f"gap: {seq} after {self.next_seq - 1}"
        self.next_seq = seq + 1
        self.tree.apply(self.decoder.decode(payload))
        return True

    def drain_until(self, last_seq: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.next_seq is None or self.next_seq <= last_seq:
            assert time.monotonic() < deadline, f"batch {last_seq} never arrived"
            self.recv(100)

    def close(self):
        self.sub.close()


def replay_all(ctx, endpoint: str, decoder, start: int = 0) -> Tuple[BlockTree, List[int]]:
    """Ask the replay ROUTER for every batch from `start` on (as vLLM's example subscriber);
    from 0 they rebuild a tree, from later only their sequence numbers count."""
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    tree, seqs = BlockTree(), []
    try:
        req.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert req.poll(5000), "the replay socket did not answer"
            empty, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == ke.END_SEQ:
                assert payload == b""
                break
            seqs.append(int.from_bytes(seq, "big"))
            batch = decoder.decode(payload)
            if start == 0:
                tree.apply(batch)
    finally:
        req.close()
    return tree, seqs


def tree_prefixes(cache: RadixCache) -> Set[Tuple[int, ...]]:
    """Every block-aligned prefix the radix tree holds, from its nodes (not from its events)."""
    b = cache.kv_event_block_size
    out, stack = set(), [(cache.root, [])]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + list(child.key)
            for end in range(b, len(path) + 1, b):
                out.add(tuple(path[:end]))
            stack.append((child, path))
    return out


def expected_blocks(cache: RadixCache):
    return {h: (p, tuple(k & ke.TOKEN_MASK for k in keys), keys[0] >> 32)
            for h, (p, keys) in cache.event_blocks().items()}


def make_pool(num_slots: int) -> KVPool:
    return KVPool(num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")


def start_publisher(cfg: Dict[str, Any]) -> ke.ZmqEventPublisher:
    return ke.ZmqEventPublisher(ke.KVEventsConfig.parse(json.dumps(cfg))).start()


def wait_published(pub: ke.ZmqEventPublisher, timeout_s: float = 10.0) -> None:
    """The publisher thread counts a batch after send_multipart returns, so a subscriber can
    hold the last batch before the count moves: wait (bounded) for the count to catch up."""
    deadline = time.monotonic() + timeout_s
    while pub.published_batches < pub.queued_batches and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_joined(pub: ke.ZmqEventPublisher, sub: Subscriber) -> None:
    """PUB/SUB's slow joiner: publish empty batches until the subscriber gets one."""
    for _ in range(200):
        pub.publish([])
        if sub.recv(50):
            while sub.recv(50):
                pass
            return
    raise AssertionError("the subscriber never joined")


# --------------------------------------------------------------------------- random cache ops

def random_ops(cache: RadixCache, pool: KVPool, rng: random.Random, steps: int,
               salts=(None, "tenant-a")) -> None:
    """Inserts (as the scheduler publishes: matched slots + new ones), matches that lock and
    later unlock, evictions, resets when nothing is locked; check_integrity after each."""
    locks: List[Any] = []
    for _ in range(steps):
        op = rng.random()
        if op < 0.45:
            off = salt_offset(rng.choice(salts))
            key = [rng.randrange(4) + off for _ in range(rng.randrange(0, 40))]
            m = cache.match_prefix(key)
            need = len(key) - len(m.indices)
            if pool.available_size() < need:
                cache.evict(need - pool.available_size())
            if pool.available_size() < need:
                continue
            cache.insert(key, torch.cat([m.indices, pool.alloc(need)]))
        elif op < 0.6:
            off = salt_offset(rng.choice(salts))
            m = cache.match_prefix([rng.randrange(4) + off for _ in range(rng.randrange(1, 30))])
            cache.inc_lock_ref(m.last_node)
            locks.append(m.last_node)
        elif op < 0.75 and locks:
            cache.dec_lock_ref(locks.pop(rng.randrange(len(locks))))
        elif op < 0.9:
            cache.evict(rng.randrange(1, 24))
        elif op < 0.93:
            for node in locks:
                cache.dec_lock_ref(node)
            locks.clear()
            cache.reset()
        cache.check_integrity()
    for node in locks:
        cache.dec_lock_ref(node)
    cache.check_integrity()


@pytest.mark.parametrize("page_size,block_size", [(1, None), (1, 3), (4, None), (2, 8)])
def test_subscriber_replays_the_radix_tree_ipc(page_size, block_size):
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"publisher": "zmq", "endpoint": f"ipc://{tmp}/kv-events",
               "replay_endpoint": f"ipc://{tmp}/kv-replay", "topic": "kv-events"}
        if block_size:
            cfg["block_size"] = block_size
        pub = start_publisher(cfg)
        ctx = zmq.Context()
        sub = Subscriber(ctx, cfg["endpoint"], "kv-events", DECODE_MAP)
        try:
            wait_joined(pub, sub)
            pool = make_pool(96)
            cache = RadixCache(pool, page_size=page_size, kv_events=pub,
                               kv_event_block_size=block_size)
            assert cache.kv_event_block_size == (block_size or (page_size if page_size > 1
                                                                else 16))
            rng = random.Random(1000 * page_size + (block_size or 0))
            for round_ in range(3):
                random_ops(cache, pool, rng, 400)
                sub.drain_until(pub.queued_batches - 1)
                assert sub.tree.blocks == expected_blocks(cache), f"round {round_}"
                assert sub.tree.prefixes() == tree_prefixes(cache)
            assert sub.tree.stored > 20 and sub.tree.removed > 10
            assert pub.dropped_batches == 0 and pub.send_errors == 0
            wait_published(pub)
            assert pub.published_batches == pub.queued_batches
            # a late subscriber replays everything from batch 0 to the same tree
            replayed, seqs = replay_all(ctx, cfg["replay_endpoint"], DECODE_MAP)
            assert seqs == list(range(pub.queued_batches))
            assert replayed.blocks == sub.tree.blocks
            # and from the middle on, only the tail
            _, tail = replay_all(ctx, cfg["replay_endpoint"], DECODE_MAP, start=seqs[-3])
            assert tail == seqs[-3:]
        finally:
            sub.close()
            pub.close()
            ctx.term()


def test_subscriber_replays_the_radix_tree_tcp_connect_array_encoding():
    """The subscriber binds a random loopback port and the publisher connects (an endpoint
    without '*' connects, vLLM's rule); events in the legacy array encoding; a DP rank."""
    ctx = zmq.Context()
    sub = Subscriber(ctx, None, "", DECODE_ARRAY, bind=True, rank=3)
    pub = start_publisher({"enable_kv_cache_events": True, "endpoint": sub.endpoint,
                           "event_encoding": "array", "block_size": 4,
                           "data_parallel_rank": 3})
    try:
        wait_joined(pub, sub)
        pool = make_pool(64)
        cache = RadixCache(pool, page_size=2, kv_events=pub, kv_event_block_size=4)
        random_ops(cache, pool, random.Random(5), 600)
        sub.drain_until(pub.queued_batches - 1)
        assert sub.tree.blocks == expected_blocks(cache)
        assert sub.tree.prefixes() == tree_prefixes(cache)
    finally:
        sub.close()
        pub.close()
        ctx.term()


# --------------------------------------------------------------------------- the wire format

def test_wire_format_is_vllms():
    keys = [7, 8, 9, 10, 11, 12, 300000, 13]
    h1 = ke.chain_hash(None, keys[:4])
    h2 = ke.chain_hash(h1, keys[4:])
    salted = [k + salt_offset("s") for k in keys[:4]]
    hs = ke.chain_hash(None, salted)
    events = [ke.AllBlocksClearedEvent(),
              ke.stored_event(None, [h1, h2], keys, 4, "GPU"),
              ke.stored_event(None, [hs], salted, 4, "GPU"),
              ke.BlockRemovedEvent([h2, h1], "GPU")]
    payload = ke.encode_batch(1757500000.25, events)
    # raw msgpack: [ts, [events...], dp rank]; each event a map with its tag under "type"
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[0] == 1757500000.25 and raw[2] == 0
    assert raw[1][0] == {"type": "AllBlocksCleared"}
    assert raw[1][1] == {"type": "BlockStored", "block_hashes": [h1, h2],
                         "parent_block_hash": None, "token_ids": keys, "block_size": 4,
                         "lora_id": None, "medium": "GPU", "lora_name": None}
    assert raw[1][2]["token_ids"] == keys[:4]          # the real ids; the salt in extra_keys
    assert raw[1][2]["extra_keys"] == [[f"cache_salt_digest:{salt_offset('s') >> 32:016x}"]]
    assert raw[1][3] == {"type": "BlockRemoved", "block_hashes": [h2, h1], "medium": "GPU"}
    batch = DECODE_MAP.decode(payload)
    assert [type(e).__name__ for e in batch.events] == \
        ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved"]
    stored = batch.events[1]
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size,
            stored.medium, stored.group_idx) == ([h1, h2], None, keys, 4, "GPU", None)
    assert all(0 <= h < 2 ** 63 for h in (h1, h2, hs))     # fits int64 and uint64 consumers
    # the legacy encoding: tagged positional arrays (msgspec writes every field)
    legacy = ke.encode_batch(2.0, events, encoding="array")
    raw = msgspec.msgpack.decode(legacy)
    assert raw[1][0] == ["AllBlocksCleared"]
    assert raw[1][1] == ["BlockStored", [h1, h2], None, keys, 4, None, "GPU", None, None]
    assert raw[1][3] == ["BlockRemoved", [h2, h1], "GPU"]
    assert DECODE_ARRAY.decode(legacy).events[2].extra_keys is not None


def test_chain_hash_is_stable_and_chained():
    a = ke.chain_hash(None, [1, 2, 3])
    assert a == ke.chain_hash(None, [1, 2, 3])      # no per-process seed
    assert a != ke.chain_hash(None, [1, 2, 4])
    assert ke.chain_hash(a, [5]) != ke.chain_hash(None, [5])
    assert ke.chain_hash(None, [1 + salt_offset("x")]) != ke.chain_hash(None, [1])


# --------------------------------------------------------------------------- never blocking

def test_full_queue_drops_counts_and_resyncs_without_blocking():
    pub = ke.ZmqEventPublisher(ke.KVEventsConfig(publisher="zmq", max_queue_size=2))  # not started
    cache = RadixCache(make_pool(32), page_size=1, kv_events=pub, kv_event_block_size=2)
    assert pub.queued_batches == 1                   # the new tree's AllBlocksCleared
    # the publisher is not started, so nothing drains the queue: a blocking put would hang
    # here instead of dropping
    cache.insert([1, 2, 3, 4], cache.kv_pool.alloc(4))
    cache.insert([5, 6], cache.kv_pool.alloc(2))     # the queue is full: dropped, not waited
    cache.insert([7, 8], cache.kv_pool.alloc(2))
    assert (pub.queued_batches, pub.dropped_batches) == (2, 2)
    assert pub.stats()["kv_events_dropped_batches"] == 2
    pub._queue.get_nowait()                          # the publisher thread takes one
    cache.insert([9, 10], cache.kv_pool.alloc(2))
    pub._queue.get_nowait()
    _, events = pub._queue.get_nowait()
    # the batch after a loss starts with AllBlocksCleared, so no subscriber keeps stale blocks
    assert isinstance(events[0], ke.AllBlocksClearedEvent)
    assert isinstance(events[1], ke.BlockStoredEvent) and events[1].token_ids == [9, 10]
    cache.insert([11, 12], cache.kv_pool.alloc(2))
    assert not isinstance(pub._queue.get_nowait()[1][0], ke.AllBlocksClearedEvent)
    pub.close()


def test_close_sends_what_is_queued_and_later_batches_count_as_dropped():
    with tempfile.TemporaryDirectory() as tmp:
        ctx = zmq.Context()
        pub = start_publisher({"publisher": "zmq", "endpoint": f"ipc://{tmp}/ev"})
        sub = Subscriber(ctx, f"ipc://{tmp}/ev", "", DECODE_MAP)
        try:
            wait_joined(pub, sub)
            for i in range(50):
                pub.publish([ke.AllBlocksClearedEvent()])
            pub.close()
            sub.drain_until(pub.queued_batches - 1)
            assert pub.published_batches == pub.queued_batches
            assert not pub.publish([ke.AllBlocksClearedEvent()])
            assert pub.dropped_batches == 1
        finally:
            sub.close()
            ctx.term()


def test_bad_endpoint_fails_at_start_naming_the_flag():
    with pytest.raises(ValueError, match="--kv-events-config: cannot open tcp://\\*:notaport"):
        start_publisher({"publisher": "zmq", "endpoint": "tcp://*:notaport"})


# --------------------------------------------------------------------------- configuration

def test_config_shapes_of_vllm_and_sglang():
    parse = ke.KVEventsConfig.parse
    vllm = parse('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert vllm.enabled and vllm.publisher is None and vllm.endpoint == "tcp://*:5557"
    assert (vllm.buffer_steps, vllm.hwm, vllm.max_queue_size) == (10_000, 100_000, 100_000)
    sglang = parse('{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "t", '
                   '"replay_endpoint": "tcp://*:5558", "buffer_steps": 5, "hwm": 9, '
                   '"max_queue_size": 7}')
    assert sglang.enabled and sglang.replay_endpoint == "tcp://*:5558"
    assert not parse('{"endpoint": "tcp://*:5557"}').enabled          # both default to null
    assert not parse('{"publisher": "null"}').enabled
    assert not parse('{"publisher": "zmq", "enable_kv_cache_events": false}').enabled
    assert parse("{}").resolved_block_size(1) == 16
    assert parse("{}").resolved_block_size(8) == 8
    assert parse('{"block_size": 32}').resolved_block_size(8) == 32
    for bad, word in [('{"publisher": "nats"}', "publisher"), ('{"hwm": -1}', "hwm"),
                      ('{"block_size": 0}', "block_size"), ('{"buffer_steps": "x"}', "buffer"),
                      ('{"event_encoding": "json"}', "event_encoding"), ("[1]", "JSON object"),
                      ('{"endpoint": "nowhere"}', "endpoint"), ("{", "JSON object"),
                      ('{"data_parallel_rank": -1}', "data_parallel_rank"),
                      ('{"topics": ""}', "unknown key 'topics'")]:
        with pytest.raises(ValueError, match=word):
            parse(bad)


def test_server_args_flag_and_checks():
    from radixserve import cli
    text = '{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}'
    ns = cli.build_parser().parse_args(["serve", "--kv-events-config", text])
    args = ServerArgs.from_cli_args(ns)
    assert args.kv_events_config == text and ServerArgs().kv_events_config is None
    with pytest.raises(ValueError, match="--disable-radix-cache"):
        ServerArgs(model_path="/m", kv_events_config=text, disable_radix_cache=True).check()
    with pytest.raises(ValueError, match="multiple of --page-size"):
        ServerArgs(model_path="/m", page_size=4,
                   kv_events_config='{"publisher": "zmq", "block_size": 6}').check()
    with pytest.raises(ValueError, match="unknown key"):
        ServerArgs(model_path="/m", kv_events_config='{"publisher": "zmq", "x": 1}').check()
    with pytest.raises(ValueError, match="multiple of the page size"):
        RadixCache(make_pool(8), page_size=4, kv_events=None, kv_event_block_size=6)


def test_from_server_args_without_and_with_a_null_publisher(caplog):
    pool = make_pool(8)
    assert RadixCache.from_server_args(pool, ServerArgs()).kv_events is None
    cache = RadixCache.from_server_args(pool, ServerArgs(kv_events_config='{"topic": "t"}'))
    assert cache.kv_events is None
    assert any("publisher is null" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- /metrics

def test_publisher_counters_on_metrics():
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from radixserve.server.app import create_app
    from test_metrics import CountingEngine, scrape, value
    from test_server_fake_engine import LOCAL

    engine = CountingEngine()
    pub = ke.ZmqEventPublisher(ke.KVEventsConfig(publisher="zmq", max_queue_size=1))
    engine.scheduler = SimpleNamespace(cache=SimpleNamespace(kv_events=pub))
    pub.publish([])
    pub.publish([])                                  # dropped
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        samples, types = scrape(c)
    assert types["radixserve:kv_events_dropped_batches"] == "counter"
    assert value(samples, "radixserve:kv_events_dropped_batches_total",
                 model_name="fake-model") == 1
    assert value(samples, "radixserve:kv_events_published_batches_total") == 0
    pub.close()


# --------------------------------------------------------------------------- the scheduler

def test_scheduler_requests_aborts_flushes_replay_to_the_radix_tree(make_scheduler):
    """Random requests over shared prefixes (some salted), a pool small enough to evict, random
    aborts and flushes; check_integrity after every step (what --debug-integrity runs, the
    cache's event blocks included); the subscriber's tree equals the radix tree at the end of
    each round."""
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/kv"
        ctx = zmq.Context()
        sched = make_scheduler(max_total_tokens=320, chunked_prefill_size=64,
                               kv_events_config=json.dumps(
                                   {"publisher": "zmq", "endpoint": endpoint, "topic": "kv"}))
        pub = sched.cache.kv_events
        assert isinstance(pub, ke.ZmqEventPublisher) and sched.cache.kv_event_block_size == 16
        sub = Subscriber(ctx, endpoint, "kv", DECODE_MAP)
        try:
            wait_joined(pub, sub)
            rng = random.Random(38)
            stems = [[rng.randrange(256, 49152) for _ in range(rng.randrange(20, 70))]
                     for _ in range(3)]
            n = 0
            for round_ in range(3):
                reqs = []
                for _ in range(8):
                    ids = rng.choice(stems) + [rng.randrange(256, 49152)
                                               for _ in range(rng.randrange(1, 40))]
                    sp = SamplingParams(max_new_tokens=rng.randrange(2, 10), temperature=0.0,
                                        ignore_eos=True)
                    reqs.append(Req(f"r{n}", ids, sp, sp.max_new_tokens,
                                    cache_salt=rng.choice([None, None, "tenant"])))
                    n += 1
                for r in reqs[:5]:
                    sched.add_request(r)
                steps = 0
                while sched.has_work() or steps < 3:
                    if steps == 2:
                        for r in reqs[5:]:
                            sched.add_request(r)
                    if rng.random() < 0.15 and sched.reqs:
                        sched.abort(rng.choice(sorted(sched.reqs)))
                    sched.step()
                    sched.check_integrity()
                    steps += 1
                    assert steps < 2000
                assert any(r.finish_reason["type"] == "length" for r in reqs)
                sub.drain_until(pub.queued_batches - 1)
                assert sub.tree.blocks == expected_blocks(sched.cache), f"round {round_}"
                assert sub.tree.prefixes() == tree_prefixes(sched.cache)
                assert sub.tree.blocks, "nothing was cached"
                if round_ == 1:
                    assert sched.flush_cache()
                    sub.drain_until(pub.queued_batches - 1)
                    assert sub.tree.blocks == {}
            assert sched.counters["num_aborted_requests"] > 0
            assert sub.tree.removed > 0, "nothing was evicted"
            assert pub.dropped_batches == 0
        finally:
            sub.close()
            sched.cache.close()
            ctx.term()


def test_offline_engine_with_debug_integrity_publishes_its_tree(default_model_path):
    """The wiring end to end: an offline Engine (AsyncEngine, the scheduler's own cache from
    --kv-events-config, --debug-integrity checking whenever the loop runs out of work)."""
    import asyncio

    import radixserve

    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/kv"
        engine = radixserve.Engine(default_model_path, device="cpu", max_total_tokens=1024,
                                   context_length=512, debug_integrity=True,
                                   kv_events_config=json.dumps({"enable_kv_cache_events": True,
                                                                "endpoint": endpoint}))
        ctx = zmq.Context()
        cache = engine.async_engine.scheduler.cache
        pub = cache.kv_events
        sub = Subscriber(ctx, endpoint, "", DECODE_MAP)

        def on_loop(fn):
            async def call():
                return fn()
            return asyncio.run_coroutine_threadsafe(call(), engine._loop).result()

        try:
            wait_joined(pub, sub)
            rng = random.Random(4)
            stem = [rng.randrange(256, 49152) for _ in range(40)]
            for i in range(4):
                engine.generate(input_ids=stem + [rng.randrange(256, 49152) for _ in range(9)],
                                sampling_params={"temperature": 0.0, "max_new_tokens": 6})
            sub.drain_until(on_loop(lambda: pub.queued_batches) - 1)
            want = on_loop(lambda: (expected_blocks(cache), tree_prefixes(cache)))
            assert sub.tree.blocks == want[0] and sub.tree.prefixes() == want[1]
            assert len(sub.tree.blocks) >= 3            # the shared 40-token stem: 2 blocks + ...
            assert engine.async_engine.is_healthy()     # --debug-integrity found nothing
        finally:
            engine.shutdown()
            cache.close()
            sub.close()
            ctx.term()
