"""Server-sent events as the official openai client parses them: each event is
`data: <json>\\n\\n`, the stream ends with `data: [DONE]\\n\\n`.

EventStreamResponse sends an async iterator of encoded events and watches the connection: when
the client disconnects, the iterator is cancelled and then closed (`aclose()`), so the engine
generators it wraps abort their requests and free their KV at once, not at garbage collection.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from radixserve.server.jsonio import dumps

logger = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"


def encode_event(obj: Any) -> bytes:
    """One SSE event carrying `obj` as compact JSON (orjson: UTF-8, non-ASCII kept verbatim;
    never raises for what the server builds, see jsonio.dumps)."""
    return b"data: " + dumps(obj) + b"\n\n"


class EventStreamResponse(Response):
    """A text/event-stream response over `events` (already-encoded SSE events).

    Contract: `events` is always closed when this response ends, whether the stream ran to its
    end, the client went away (the iterator is cancelled where it waits, then closed), or sending
    failed. Exceptions raised by `events` after the headers went out are logged and end the
    stream; the iterator should rather emit an error event itself (openai_api does).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], status_code: int = 200,
                 headers: Optional[dict] = None):
        self.events = events
        self.status_code = status_code
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            results = await asyncio.gather(pump, watch, return_exceptions=True)
            await self.events.aclose()
        err = results[0]
        if isinstance(err, BaseException) and not isinstance(err, (asyncio.CancelledError, OSError)):
            logger.error("event stream failed", exc_info=err)

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports the client gone (call after the body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
