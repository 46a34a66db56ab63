"""The door: what every HTTP request passes before a route sees it, and the request-scoped
rules the routes apply (JSON bodies, request ownership, what /get_server_info may show).

`Door` is an ASGI middleware around the whole app. In order, for each HTTP request:

1. **Host** (DNS-rebinding defence). When a Host check is in force, a Host header naming a
   host outside the allowed list gets 421. An IP address in Host always passes: a page that
   rebinds its own DNS name to this server still sends that name, never an address. In force
   when `--allowed-hosts` is given (`*` = any host, `.example.com` = it and its subdomains),
   and by default whenever the server listens beyond loopback (then the default list is
   `localhost` and this machine's host name). A loopback-only server checks Host only when
   `--allowed-hosts` says so.
2. **Origin** (CSRF and CORS). A request with an Origin header must come from the server's own
   origin or from one listed in `--allowed-origins` (`*` = any): anything else gets 403, so a
   web page elsewhere cannot make a browser send even a "simple" request (a form post, a
   no-cors fetch) that changes state here. For the listed origins, starlette's CORSMiddleware
   answers preflights (before the API key is checked: preflights carry no credentials) and
   sets the CORS headers of responses. Without `--allowed-origins` there is no CORS at all.
3. **API key.** With `--api-key` (or RADIXSERVE_API_KEY), every route but `/health` needs
   `Authorization: Bearer <key>`, compared in constant time; otherwise 401.
4. **Body size.** A Content-Length above `--max-request-bytes` gets 413 before a byte of the
   body is read; a body without one (chunked) is counted as it arrives and refused with 413 as
   soon as it passes the limit (`RequestTooLarge`, raised from `receive`).

The routes then read their bodies with `read_json_object` (415 for a Content-Type other than
application/json, 400 for invalid JSON, lone surrogates, nesting deeper than
jsonio.MAX_JSON_DEPTH, or a body that is not an object).

**Request ownership.** A request id names a live request to `/abort_request`. `RequestOwners`
maps each live engine rid (the id in /generate's meta_info; for the OpenAI routes the response
id when n = 1, `<id>-<index>` per choice otherwise) to the identity of the client that started
it: with an API key, that key (every holder of the one key is the same client); without one,
the peer's IP address as the ASGI server reports it (uvicorn takes X-Forwarded-For from a proxy
on 127.0.0.1). The routes see the engine through a `ClientView`, which keeps that map and lets
/abort_request abort a live request only for its owner; for someone else's live request it
answers 200 and does nothing, exactly as for a finished or unknown id, so other clients' ids
cannot even be probed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import re
import socket
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import ApiError, bad_request, error_response
from radixserve.server.jsonio import JSONInputError, loads_request

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})          # reachable without the API key
_IDENTITY_KEY = "radixserve.client_identity"  # the scope entry Door fills for the routes


# --------------------------------------------------------------------------- policy

def _split_list(value: Optional[str]) -> Tuple[str, ...]:
    return tuple(p.strip() for p in (value or "").split(",") if p.strip())


def normalize_origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def is_loopback_bind(host: str) -> bool:
    """True when binding `host` listens on loopback only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class DoorPolicy:
    """The door's settings, from ServerArgs (see the module docstring)."""
    api_key: Optional[str] = None
    allowed_hosts: Optional[Tuple[str, ...]] = None  # None: no Host check
    allowed_origins: Tuple[str, ...] = ()            # normalized; "*" = any
    max_request_bytes: int = 8 * 1024 * 1024
    expose_server_info: bool = False

    @classmethod
    def from_server_args(cls, args) -> "DoorPolicy":
        hosts: Optional[Tuple[str, ...]] = None
        if args.allowed_hosts:
            hosts = tuple(host_name(h) for h in _split_list(args.allowed_hosts))   # ports ignored
        elif not is_loopback_bind(args.host):
            hosts = tuple(sorted({"localhost", socket.gethostname().lower()}))
        return cls(api_key=args.resolved_api_key(), allowed_hosts=hosts,
                   allowed_origins=tuple(normalize_origin(o) for o in _split_list(args.allowed_origins)),
                   max_request_bytes=args.max_request_bytes,
                   expose_server_info=args.expose_server_info)

    def host_allowed(self, host_header: Optional[str]) -> bool:
        if self.allowed_hosts is None or host_header is None:
            return True          # no check, or no Host at all (browsers always send one)
        name = host_name(host_header)
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        for pattern in self.allowed_hosts:
            if pattern == "*" or name == pattern:
                return True
            if pattern.startswith(".") and (name.endswith(pattern) or name == pattern[1:]):
                return True
        return False

    def origin_listed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or normalize_origin(origin) in self.allowed_origins


def host_name(host_header: str) -> str:
    """The host of a Host header, lowercased, without port, brackets or a trailing dot."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else h[1:]
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


# --------------------------------------------------------------------------- the middleware

class RequestTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than {limit} bytes; send a smaller one "
                         "(or start the server with a larger --max-request-bytes)", 413)


class Door:
    """ASGI middleware applying a DoorPolicy to every HTTP request (module docstring)."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy):
        self.policy = policy
        inner: ASGIApp = _Lock(app, policy)
        if policy.allowed_origins:
            inner = CORSMiddleware(inner, allow_origins=list(policy.allowed_origins),
                                   allow_methods=["GET", "POST"], allow_headers=["*"],
                                   allow_private_network=True, max_age=600)
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.policy.host_allowed(host):
            name = host_name(host)
            await _refuse(scope, receive, send, ApiError(
                f"this server does not answer to the host name {name!r}; address it by an "
                f"allowed name or start it with --allowed-hosts {name}", 421))
            return
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_listed(origin) and not _same_origin(origin, host):
            await _refuse(scope, receive, send, ApiError(
                f"cross-origin requests from {origin[:200]!r} are not allowed; start the server "
                f"with --allowed-origins {origin[:200]} to allow that origin", 403))
            return
        await self.inner(scope, receive, send)


def _same_origin(origin: str, host: Optional[str]) -> bool:
    if host is None:
        return False
    try:
        netloc = urlsplit(origin.strip()).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host.strip().lower()


class _Lock:
    """The API key and the body-size limit (inside CORS, so preflights skip the key and error
    responses carry CORS headers for allowed origins)."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy):
        self.app = app
        self.policy = policy
        self._key = policy.api_key.encode("utf-8") if policy.api_key else None
        self._key_identity = ("key:" + hashlib.sha256(self._key).hexdigest()[:16]) if self._key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self._key is not None:
            if scope["path"] not in OPEN_PATHS and not self._authorized(headers.get("authorization")):
                given = headers.get("authorization") is not None
                await _refuse(scope, receive, send, ApiError(
                    "invalid API key; send the key the server was started with (--api-key or "
                    "RADIXSERVE_API_KEY) as 'Authorization: Bearer <key>'" if given else
                    "this server needs an API key: send 'Authorization: Bearer <key>'", 401),
                    headers={"WWW-Authenticate": "Bearer"})
                return
            scope[_IDENTITY_KEY] = self._key_identity
        else:
            client = scope.get("client")
            scope[_IDENTITY_KEY] = "peer:" + (client[0] if client else "unknown")
        limit = self.policy.max_request_bytes
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _refuse(scope, receive, send,
                              bad_request(f"Content-Length {length[:40]!r} is not a byte count"))
                return
            if int(length) > limit:
                await _refuse(scope, receive, send, RequestTooLarge(limit))
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit)
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except RequestTooLarge as e:     # raised outside a route's guard (routes answer it themselves)
            if started:
                raise
            await error_response(e)(scope, receive, send)

    def _authorized(self, authorization: Optional[str]) -> bool:
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode("latin-1"), self._key)


async def _refuse(scope: Scope, receive: Receive, send: Send, err: ApiError,
                  headers: Optional[dict] = None) -> None:
    """Answer `err` without reading the request body; the connection is not reused when a
    body was left unread (the ASGI server closes it)."""
    await error_response(err, headers)(scope, receive, send)


# --------------------------------------------------------------------------- for the routes

JSON_MEDIA_TYPE = "application/json"


async def read_json_object(request: Request) -> dict:
    """The request body as a JSON object. 415 for a Content-Type other than application/json:
    the types a browser may send cross-origin without a CORS preflight (text/plain, forms) never
    reach a route. A request without Content-Type is read as JSON: browsers label every body
    they send, except a no-cors POST of raw bytes, which carries an Origin header and so is
    refused at the door (Door, step 2) unless that origin is allowed; scripts posting raw
    bytes often leave it out. 413 past the size limit; 400 for
    invalid JSON, lone surrogates (naming the field), nesting deeper than
    jsonio.MAX_JSON_DEPTH, or anything but an object."""
    content_type = request.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != JSON_MEDIA_TYPE:
            raise ApiError(f"this route takes a JSON body: send 'Content-Type: application/json' "
                           f"(got {content_type[:100]!r})", 415)
    raw = await request.body()
    try:
        body = loads_request(raw)
    except JSONInputError as e:
        raise bad_request(e.message, param=e.param) from None
    if not isinstance(body, dict):
        kind = "an array" if isinstance(body, list) else type(body).__name__
        raise bad_request(f"the request body must be a JSON object, got {kind}")
    return body


def client_identity(request: Request) -> str:
    """Who sent `request` (see "Request ownership" above); Door sets it on every request."""
    identity = request.scope.get(_IDENTITY_KEY)
    if identity is None:            # an app without Door (never served that way)
        client = request.scope.get("client")
        identity = "peer:" + (client[0] if client else "unknown")
    return identity


class RequestOwners:
    """Live request ids -> the identity of the client that started them. One per app; loop
    thread only. Filled by ClientView.generate for exactly as long as the engine runs the
    request."""

    def __init__(self) -> None:
        self._owner: Dict[str, str] = {}

    def owner(self, rid: str) -> Optional[str]:
        return self._owner.get(rid)

    def reserve(self, rid: str, owner: str) -> None:
        """Raises ValueError when `rid` is live already (no client can take over, or collide
        with, another's request id)."""
        if rid in self._owner:
            raise ValueError(f"request id {rid!r} is already in use by a running request; "
                             "send a unique rid")
        self._owner[rid] = owner

    def release(self, rid: str) -> None:
        self._owner.pop(rid, None)

    def owned_by(self, owner: str) -> List[str]:
        """The live request ids `owner` started."""
        return [rid for rid, who in self._owner.items() if who == owner]

    def __len__(self) -> int:
        return len(self._owner)


class ClientView:
    """The engine as one client's request sees it (app.py hands it to every route instead of
    the engine): `generate` records each request id it starts as owned by the client for as
    long as the engine runs it, `validate` refuses an id that is live already, and `abort`
    reaches only the client's own live requests (another client's live id is left alone,
    silently, like a finished one; an id no request holds goes to the engine, which ignores
    it). Everything else is the engine's own attribute."""

    def __init__(self, engine, identity: str, owners: RequestOwners):
        self._engine = engine
        self._identity = identity
        self._owners = owners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def identity(self) -> str:
        return self._identity

    def validate(self, req) -> None:
        if self._owners.owner(req.rid) is not None:
            raise ValueError(f"request id {req.rid!r} is already in use by a running request; "
                             "send a unique rid")
        self._engine.validate(req)

    async def generate(self, req) -> AsyncIterator[Any]:
        self._owners.reserve(req.rid, self._identity)
        req.client_id = self._identity        # the scheduler's fairness key
        try:
            agen = self._engine.generate(req)
            try:
                async for out in agen:
                    yield out
            finally:
                await agen.aclose()
        finally:
            self._owners.release(req.rid)

    def abort(self, rid: str) -> bool:
        """Abort `rid` if this client may; returns whether the engine was asked."""
        owner = self._owners.owner(rid)
        if owner is not None and owner != self._identity:
            logger.info("refused to abort request %r for another client", rid)
            return False
        self._engine.abort(rid)
        return True

    def abort_all(self) -> int:
        """Abort every live request of this client (never another's); how many."""
        rids = self._owners.owned_by(self._identity)
        for rid in rids:
            self._engine.abort(rid)
        return len(rids)


def request_owners(request: Request) -> RequestOwners:
    return request.app.state.request_owners


# --------------------------------------------------------------------------- server info

_SECRET_KEYS = frozenset({"api_key"})
_PATH_SUFFIXES = ("_path", "_dir", "_file")


def redact_server_info(info: Any, expose_paths: bool) -> Any:
    """`info` without secrets (never shown) and, unless `expose_paths`, without filesystem
    paths: keys named path / *_path / *_dir / *_file, and absolute paths in string values."""
    if isinstance(info, dict):
        out = {}
        for key, value in info.items():
            if key in _SECRET_KEYS:
                continue
            if not expose_paths and isinstance(key, str) and (key == "path" or key.endswith(_PATH_SUFFIXES)):
                continue
            out[key] = redact_server_info(value, expose_paths)
        return out
    if isinstance(info, (list, tuple)):
        return [redact_server_info(v, expose_paths) for v in info]
    if isinstance(info, str) and not expose_paths and _looks_like_path(info):
        return None
    return info


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "~/")) or re.match(r"[A-Za-z]:[\\/]", s) is not None
