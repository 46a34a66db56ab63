"""KV cache events (--kv-events-config): the radix cache's BlockStored / BlockRemoved /
AllBlocksCleared, published over ZMQ in vLLM's KVEventBatch wire format, for KV-aware routers
(llm-d's kv-cache indexer, Dynamo's ZMQ relay) that track which prefixes each server holds.

Blocks. The events speak of fixed-size blocks of B tokens (the config's `block_size`, a multiple
of --page-size; default: --page-size, or 16 when pages are one token). Block i of a cached
sequence is its tokens [i*B, (i+1)*B); it is *stored* while the radix tree holds that whole
prefix, and the tree node whose edge holds the block's last position owns it (RadixCache keeps,
per node, the hashes of the blocks ending on its edge). So: inserting a new leaf stores the blocks
ending on it (one BlockStored per insert, `parent_block_hash` the last block before them);
evicting a leaf removes the blocks ending on it (one BlockRemoved per evict call); splitting an
edge changes nothing a subscriber sees; reset (/flush_cache) is AllBlocksCleared. A trailing part
of a block is never announced. Block hashes chain: hash(block i) = H(hash(block i-1), the block's
keys), H 63 bits of an 8-byte BLAKE2b, a non-negative int that every consumer's int64 or
uint64 decodes (vLLM's ExternalBlockHash is `bytes | int`; Dynamo, llm-d and TensorRT-LLM's
publisher use ints). The keys are the radix tree's: a request with a `cache_salt` has its ids
moved into the salt's own key range (engine/req.salt_offset: id + (digest << 32)), so salted and
unsalted blocks never share a hash. `token_ids` carries the real token ids (key & 0xFFFFFFFF); the
first block of a salted sequence (no parent) carries `extra_keys` [("cache_salt_digest:<16
hex>",)], where vLLM puts the salt itself, which the tree no longer knows.

Wire format (vLLM's vllm/distributed/kv_events.py as of vllm-project/vllm#42892, 2026; read for
this module: its EventBatch, KVCacheEvent, BlockStored, BlockRemoved, AllBlocksCleared,
KVEventBatch and ZmqEventPublisher; and SGLang's python/sglang/srt/disaggregation/kv_events.py):
  * a ZMQ PUB message of three frames: topic (utf-8), sequence number (8 bytes, big-endian,
    from 0, one per batch), msgpack payload;
  * the payload is a KVEventBatch, msgspec `array_like=True, omit_defaults=True`:
    [ts (float, time.time()), [events...], data_parallel_rank (0 unless configured)];
  * each event is a msgspec struct with `tag=True` (tag field "type", tag value the class name)
    and `omit_defaults=True`. event_encoding "map" (the default; vLLM since #42892, llm-d-kv-cache
    >= v0.9 and Dynamo decode it): a map {"type": "BlockStored", "block_hashes": [...],
    "parent_block_hash": int|nil, "token_ids": [...], "block_size": B, "lora_id": nil,
    "medium": "GPU"|"CPU", "lora_name": nil[, "extra_keys": [...]]}; {"type": "BlockRemoved",
    "block_hashes": [...], "medium": ...}; {"type": "AllBlocksCleared"}. event_encoding "array"
    (vLLM before #42892 and SGLang: `array_like=True` events): the same fields as a positional
    array after the tag, ["BlockStored", hashes, parent, token_ids, B, nil, medium, nil,
    extra_keys|nil] and ["BlockRemoved", hashes, medium] (msgspec writes every field of an
    array-like struct; consumers of the older, shorter arrays read the leading ones).
    Fields vLLM added later with defaults (group_idx, kv_cache_spec_kind,
    kv_cache_spec_sliding_window, locality, ...) are omitted: they describe hybrid or tiered
    caches radixserve does not have. `medium` is "GPU" for a KV pool on a GPU, "CPU" on the CPU.
  * replay: with `replay_endpoint`, a ROUTER socket answers a request [identity, b"", start seq
    (8 bytes big-endian)] with every buffered batch from that sequence on, each
    [identity, b"", seq, payload], then [identity, b"", -1 (8 bytes, signed), b""]; the last
    `buffer_steps` batches are kept.

--kv-events-config takes vLLM's and SGLang's JSON: {"publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000,
"max_queue_size": 100000, "topic": ""} (their defaults), plus vLLM's "enable_kv_cache_events"
and radixserve's own "block_size", "event_encoding" and "data_parallel_rank" (the batches'
third field, 0 by default; a replica of `--dp-size N` may set its index, as vLLM and SGLang
stamp their DP rank). Publishing is on when "publisher" is
"zmq" and "enable_kv_cache_events" is not false; without "publisher" it follows
"enable_kv_cache_events" (vLLM's rule; SGLang's configs name the publisher). The PUB socket
binds when the endpoint has "*" or "::" or is ipc:// or inproc://, else connects (vLLM's rule).

Never blocking the loop. The cache only appends plain tuples to a bounded queue
(`queue.Queue.put_nowait`, `max_queue_size` batches); a thread (`radixserve-kv-events`) owns the
sockets, builds the msgspec structs, encodes and sends (a PUB socket drops for a subscriber past
`hwm` rather than block). A batch that finds the queue full is dropped and counted
(`dropped_batches`, on /metrics as `kv_events_dropped_batches_total`); since a dropped batch never
gets a sequence number no subscriber could notice the gap, so the next batch that is queued
starts with AllBlocksCleared: a subscriber may then know fewer blocks than the server holds,
never more. pyzmq and msgspec are imported only when publishing is on.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import hashlib
import json
import logging
import queue
import threading
import time
from array import array
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
TOKEN_MASK = (1 << 32) - 1      # a radix key is token id + (salt digest << 32)
HASH_MASK = (1 << 63) - 1
DEFAULT_BLOCK_SIZE = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("map", "array")


# --------------------------------------------------------------------------- configuration

@dataclasses.dataclass
class KVEventsConfig:
    """The parsed --kv-events-config (see the module docstring)."""
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    enable_kv_cache_events: Optional[bool] = None
    block_size: Optional[int] = None
    event_encoding: str = "map"
    data_parallel_rank: int = 0

    @property
    def enabled(self) -> bool:
        publisher = self.publisher
        if publisher is None:
            publisher = "zmq" if self.enable_kv_cache_events else "null"
        return publisher == "zmq" and self.enable_kv_cache_events is not False

    def resolved_block_size(self, page_size: int) -> int:
        if self.block_size is not None:
            return self.block_size
        return page_size if page_size > 1 else DEFAULT_BLOCK_SIZE

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """The config of the flag's JSON text; ValueError naming the flag and the key."""
        flag = "--kv-events-config"
        try:
            raw = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{flag} takes a JSON object, e.g. "
                             f"'{{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}}': {e}") \
                from None
        if not isinstance(raw, dict):
            raise ValueError(f"{flag} takes a JSON object, not {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"{flag}: unknown key {unknown[0]!r} (known: {', '.join(fields)})")
        cfg = cls(**raw)

        def want(ok: bool, key: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{flag}: {key!r} must be {what}, not {raw.get(key)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        want(cfg.publisher in (None, "zmq", "null"), "publisher", '"zmq" or "null"')
        want(isinstance(cfg.endpoint, str) and "://" in cfg.endpoint, "endpoint",
             'a ZMQ endpoint such as "tcp://*:5557" or "ipc:///tmp/kv-events"')
        want(cfg.replay_endpoint is None or (isinstance(cfg.replay_endpoint, str)
                                             and "://" in cfg.replay_endpoint),
             "replay_endpoint", "null or a ZMQ endpoint")
        want(is_int(cfg.buffer_steps) and cfg.buffer_steps >= 1, "buffer_steps", "an int >= 1")
        want(is_int(cfg.hwm) and cfg.hwm >= 0, "hwm", "an int >= 0")
        want(is_int(cfg.max_queue_size) and cfg.max_queue_size >= 1, "max_queue_size",
             "an int >= 1")
        want(isinstance(cfg.topic, str), "topic", "a string")
        want(cfg.enable_kv_cache_events in (None, True, False), "enable_kv_cache_events",
             "true or false")
        want(cfg.block_size is None or (is_int(cfg.block_size) and cfg.block_size >= 1),
             "block_size", "an int >= 1 (tokens per block)")
        want(cfg.event_encoding in ENCODINGS, "event_encoding", '"map" or "array"')
        want(is_int(cfg.data_parallel_rank) and cfg.data_parallel_rank >= 0,
             "data_parallel_rank", "an int >= 0")
        return cfg


# --------------------------------------------------------------------------- events and hashes

class BlockStoredEvent(NamedTuple):
    block_hashes: List[int]
    parent_block_hash: Optional[int]
    token_ids: List[int]
    block_size: int
    medium: str
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None


class BlockRemovedEvent(NamedTuple):
    block_hashes: List[int]
    medium: str


class AllBlocksClearedEvent(NamedTuple):
    pass


def chain_hash(parent: Optional[int], keys: Sequence[int]) -> int:
    """The block hash of `keys` (radix keys) after the block `parent` (None: the first block)."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    if all(k <= 0xFFFFFFFFFFFFFFFF for k in keys):
        h.update(array("Q", keys).tobytes())
    else:                                   # salted keys reach past 64 bits
        h.update(b"".join(k.to_bytes(16, "little") for k in keys))
    return int.from_bytes(h.digest(), "little") & HASH_MASK


def token_ids(keys: Sequence[int]) -> List[int]:
    """The token ids of radix keys (a salted key is id + (digest << 32))."""
    return [k & TOKEN_MASK for k in keys]


def salt_marker(first_key: int) -> Optional[Tuple[str]]:
    """extra_keys entry of the first block of a salted sequence, None when unsalted."""
    digest = first_key >> 32
    return (f"cache_salt_digest:{digest:016x}",) if digest else None


def stored_event(parent: Optional[int], hashes: List[int], keys: Sequence[int],
                 block_size: int, medium: str) -> BlockStoredEvent:
    """BlockStored for consecutive blocks `hashes` whose keys are `keys` (len(hashes) * B)."""
    extra = None
    if parent is None and keys:
        marker = salt_marker(keys[0])
        if marker is not None:
            extra = [marker] + [None] * (len(hashes) - 1)
    return BlockStoredEvent(hashes, parent, token_ids(keys), block_size, medium, extra)


# --------------------------------------------------------------------------- wire types

_WIRE: Dict[str, Any] = {}


def wire_types(encoding: str = "map") -> Dict[str, Any]:
    """The msgspec structs of vLLM's wire format for `encoding` ("map": tagged maps, "array":
    tagged positional arrays); KVEventBatch is positional in both. Built once, lazily."""
    if encoding in _WIRE:
        return _WIRE[encoding]
    import msgspec

    array_like = encoding == "array"

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: List[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: List[int]
        parent_block_hash: Optional[int]
        token_ids: List[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: List[int]
        medium: Optional[str]

    class AllBlocksCleared(KVCacheEvent):
        pass

    _WIRE[encoding] = dict(EventBatch=EventBatch, BlockStored=BlockStored,
                           BlockRemoved=BlockRemoved, AllBlocksCleared=AllBlocksCleared)
    return _WIRE[encoding]


def to_wire(events: Sequence[Any], encoding: str = "map") -> List[Any]:
    """Our event tuples as the wire structs of `encoding`."""
    t = wire_types(encoding)
    out = []
    for e in events:
        if isinstance(e, BlockStoredEvent):
            out.append(t["BlockStored"](e.block_hashes, e.parent_block_hash, e.token_ids,
                                        e.block_size, None, e.medium, None, e.extra_keys))
        elif isinstance(e, BlockRemovedEvent):
            out.append(t["BlockRemoved"](e.block_hashes, e.medium))
        elif isinstance(e, AllBlocksClearedEvent):
            out.append(t["AllBlocksCleared"]())
        else:
            raise TypeError(f"not a KV event: {e!r}")
    return out


def encode_batch(ts: float, events: Sequence[Any], encoding: str = "map",
                 data_parallel_rank: int = 0) -> bytes:
    """One KVEventBatch payload (msgpack)."""
    import msgspec
    batch = wire_types(encoding)["EventBatch"](ts, to_wire(events, encoding), data_parallel_rank)
    return msgspec.msgpack.encode(batch)


# --------------------------------------------------------------------------- publisher

def binds(endpoint: str) -> bool:
    """vLLM's rule: a PUB endpoint with a wildcard, or ipc / inproc, is bound; else connected."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class ZmqEventPublisher:
    """Publishes event batches from a thread of its own; publish() never blocks (see the module
    docstring). start() binds the sockets and raises if they cannot be bound; close() sends what
    is queued (for up to `close_timeout` seconds) and stops the thread."""

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig, close_timeout: float = 1.0):
        self.config = config
        self.encoding = config.event_encoding
        self.close_timeout = close_timeout
        self._queue: "queue.Queue[Optional[Tuple[float, list]]]" = \
            queue.Queue(maxsize=config.max_queue_size)
        self._resync = False          # a batch was dropped: the next one starts with a clear
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self.queued_batches = 0        # written by the publishing thread (the loop) only
        self.dropped_batches = 0       # idem
        self.published_batches = 0     # written by the publisher thread only
        self.send_errors = 0           # idem
        self.replay_requests = 0       # idem

    # ------------------------------------------------------------------ caller's side
    def start(self) -> "ZmqEventPublisher":
        try:            # fail here, on the caller's thread, if missing
            import msgspec  # noqa: F401
            import zmq      # noqa: F401
        except ImportError as e:
            raise ImportError(f"--kv-events-config needs pyzmq and msgspec (pip install pyzmq "
                              f"msgspec): {e}") from e
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-events",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"--kv-events-config: cannot open {self.config.endpoint}"
                             + (f" / {self.config.replay_endpoint}"
                                if self.config.replay_endpoint else "")
                             + f": {self._error}") from self._error
        atexit.register(self.close)
        logger.info("KV events: publishing on %s (topic %r, %s encoding)%s",
                    self.config.endpoint, self.config.topic, self.encoding,
                    f", replay on {self.config.replay_endpoint}"
                    if self.config.replay_endpoint else "")
        return self

    def publish(self, events: List[Any]) -> bool:
        """Queue one batch; False (and counted) when the queue is full or the publisher closed."""
        if self._resync:
            events = [AllBlocksClearedEvent()] + list(events)
        try:
            if self._closed:
                raise queue.Full
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped_batches += 1
            self._resync = True
            if self.dropped_batches & (self.dropped_batches - 1) == 0:     # 1, 2, 4, 8, ...
                logger.warning("KV events: %d batch(es) dropped (queue of %d full or publisher "
                               "closed); subscribers are told AllBlocksCleared next",
                               self.dropped_batches, self.config.max_queue_size)
            return False
        self._resync = False
        self.queued_batches += 1
        return True

    def stats(self) -> Dict[str, int]:
        return {"kv_events_queued_batches": self.queued_batches,
                "kv_events_published_batches": self.published_batches,
                "kv_events_dropped_batches": self.dropped_batches,
                "kv_events_send_errors": self.send_errors}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self.close)
        except Exception:       # pragma: no cover
            pass
        thread = self._thread
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=self.close_timeout)
        except queue.Full:
            pass                # the thread stops at its deadline instead
        thread.join(timeout=self.close_timeout + 1.0)

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        import msgspec
        import zmq
        cfg = self.config
        ctx = zmq.Context()
        pub = replay = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.set_hwm(cfg.hwm)
                pub.setsockopt(zmq.LINGER, int(self.close_timeout * 1000))
                if binds(cfg.endpoint):
                    pub.bind(cfg.endpoint)
                else:
                    pub.connect(cfg.endpoint)
                if cfg.replay_endpoint:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.LINGER, 0)
                    replay.bind(cfg.replay_endpoint)
            except Exception as e:          # zmq.ZMQError: address in use, bad endpoint, ...
                self._error = e
                return
            finally:
                self._ready.set()
            encoder = msgspec.msgpack.Encoder()
            topic = cfg.topic.encode("utf-8")
            buffer: "collections.deque[Tuple[int, bytes]]" = \
                collections.deque(maxlen=cfg.buffer_steps)
            seq = 0
            deadline = None
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._serve_replay(replay, buffer)
                try:
                    item = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    if deadline is not None and time.monotonic() > deadline:
                        break
                    continue
                if item is None:
                    break
                if self._closed and deadline is None:
                    deadline = time.monotonic() + self.close_timeout
                ts, events = item
                try:
                    batch = wire_types(self.encoding)["EventBatch"](
                        ts, to_wire(events, self.encoding), cfg.data_parallel_rank)
                    payload = encoder.encode(batch)
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload),
                                       flags=zmq.NOBLOCK)
                except zmq.Again:           # a connected PUB with no peer yet: dropped by zmq
                    self.send_errors += 1
                    payload = None
                except Exception:
                    self.send_errors += 1
                    logger.exception("KV events: could not send batch %d", seq)
                    payload = None
                if payload is not None:
                    buffer.append((seq, payload))
                    self.published_batches += 1
                seq += 1
                if deadline is not None and time.monotonic() > deadline:
                    break
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close()
            ctx.term()

    def _serve_replay(self, replay, buffer) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: bad replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        self.replay_requests += 1
        for seq, payload in list(buffer):
            if seq >= start_seq:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_SEQ, b""))


def open_publisher(text: Optional[str]
                   ) -> Tuple[Optional[ZmqEventPublisher], Optional[KVEventsConfig]]:
    """(started publisher or None, parsed config or None) for --kv-events-config's text."""
    if not text:
        return None, None
    config = KVEventsConfig.parse(text)
    if not config.enabled:
        logger.warning("--kv-events-config given, but its publisher is null (set \"publisher\": "
                       "\"zmq\" or \"enable_kv_cache_events\": true): no KV events are published")
        return None, config
    return ZmqEventPublisher(config).start(), config
