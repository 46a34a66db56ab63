"""The door: what every HTTP request passes before a route sees it, and the request-scoped
rules the routes apply (JSON bodies, request ownership, what /get_server_info may show).

`Door` is an ASGI middleware around the whole app. In order, for each HTTP request:

1. **Host** (DNS-rebinding defence). A Host header naming a host outside the allowed list
   gets 421: a page that rebinds its own DNS name to this server still sends that name. The
   list is `--allowed-hosts` when given (`*` = any host, `.example.com` = it and its
   subdomains; IP addresses always pass then). Without it a loopback server answers only
   loopback names and addresses (`localhost`, `*.localhost`, which browsers resolve to
   loopback themselves, 127.0.0.0/8, ::1) and the unspecified addresses 0.0.0.0 and ::, which
   reach only this machine (SGLang's bench_serving.py connects to 0.0.0.0 by default; a page
   that names 0.0.0.0 is still refused by the Origin check below), and a server listening
   beyond loopback `localhost`,
   this machine's host name and any IP address. A request without Host (HTTP/1.0; browsers
   always send one) passes. A proxy in front that forwards its own Host needs that name in
   `--allowed-hosts`.
2. **Origin** (CSRF and CORS). A request with an Origin header must come from the server's own
   origin or from one listed in `--allowed-origins` (`*` = any): anything else gets 403, so a
   web page elsewhere cannot make a browser send even a "simple" request (a form post, a
   no-cors fetch) that changes state here. For the listed origins, starlette's CORSMiddleware
   answers preflights (before the API key is checked: preflights carry no credentials) and
   sets the CORS headers of responses. Without `--allowed-origins` there is no CORS at all.
3. **API keys.** With client keys (`--api-key`, any number of times, `--api-key-file`, or
   RADIXSERVE_API_KEY), every route but `/health` needs `Authorization: Bearer <key>` with one
   of them (or, without an Authorization header, `x-api-key: <key>`, which Anthropic's
   clients send); otherwise 401. Keys are held as SHA-256 digests only and the token a request
   sends is looked up by its digest, so the lookup time says nothing about any key. With an admin
   key (`--admin-api-key` or RADIXSERVE_ADMIN_API_KEY), the server-wide routes (ADMIN_PATHS:
   /flush_cache drops every client's cache, /get_server_info and /server_info show the
   deployment, /metrics, /v1/loads and /get_load every client's traffic) take only that key: a client key gets 403, no or a wrong
   key 401; the admin key also works on every other route (as the client "admin"). Without an
   admin key those routes are like the others.
4. **Body size.** A Content-Length above `--max-request-bytes` gets 413 before a byte of the
   body is read; a body without one (chunked) is counted as it arrives and refused with 413 as
   soon as it passes the limit (`RequestTooLarge`, raised from `receive`).

The routes then read their bodies with `read_json_object` (415 for a Content-Type other than
application/json, 400 for invalid JSON, lone surrogates, nesting deeper than
jsonio.MAX_JSON_DEPTH, or a body that is not an object).

**Identity.** Every request is from one client, its identity (client_identity): the key's
(`key:<name>` for a named key of --api-key-file, so keys sharing a name are one client;
`key#<first 16 hex digits of its SHA-256>` otherwise; `admin` for the admin key; never the key
itself), else, on a server without client keys, the peer's IP address as the ASGI server
reports it (`peer:<address>`; uvicorn takes X-Forwarded-For from a proxy on 127.0.0.1). Every
per-client rule keys on it: request ownership below, stored /v1/responses and their quota
(responses_api.ResponseStore), and the scheduler's per-client running cap (req.client_id).

**Request ownership.** A request id names a live request to `/abort_request`. Request ids are
per client: `RequestOwners` maps each (identity, rid) of a live request (the id in /generate's
meta_info; for the OpenAI routes the response id when n = 1, `<id>-<index>` per choice
otherwise) to the id the engine runs it under: the rid itself, or, when another client's live
request holds that rid, a unique alias (`<rid>#<hex>`), so two clients may use the same rid
and neither can tell the other's exists. The routes see the engine through a `ClientView`,
which keeps that map: a client reusing one of ITS OWN live rids gets a 400, and
/abort_request aborts only the client's own requests; for anything else it answers 200 and
does nothing, exactly as for a finished or unknown id, so other clients' ids cannot be probed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import re
import socket
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.errors import ApiError, bad_request
from radixserve.server.jsonio import JSONInputError, error_response, loads_request

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping"})  # reachable without the API key (liveness)
# --admin-api-key's: the server-wide routes (/server_info is /get_server_info's alias; the
# load routes show every client's traffic, like /metrics)
ADMIN_PATHS = frozenset({"/flush_cache", "/get_server_info", "/server_info", "/metrics",
                         "/v1/loads", "/get_load"})
ADMIN_IDENTITY = "admin"
LOOPBACK_NAMES = ("localhost", ".localhost")  # RFC 6761: browsers resolve them to loopback
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


def key_digest(key: str) -> bytes:
    """What the door keeps of a key (and looks a request's token up by)."""
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_identity(key: str, name: Optional[str] = None) -> str:
    """The identity of a client key (module docstring, "Identity"); never the key itself."""
    if name:
        return "key:" + name
    return "key#" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class DoorPolicy:
    """The door's settings, from ServerArgs (see the module docstring)."""
    client_keys: Mapping[bytes, str] = dataclasses.field(default_factory=dict)  # digest -> identity
    admin_key: Optional[bytes] = None                # the admin key's digest
    allowed_hosts: Optional[Tuple[str, ...]] = None  # None: any Host
    any_ip_host: bool = True                         # False: only loopback addresses as Host
    allowed_origins: Tuple[str, ...] = ()            # normalized; "*" = any
    max_request_bytes: int = 8 * 1024 * 1024
    expose_server_info: bool = False

    @classmethod
    def from_server_args(cls, args) -> "DoorPolicy":
        """The policy of ServerArgs; raises ValueError for an unreadable --api-key-file."""
        hosts: Optional[Tuple[str, ...]]
        any_ip = True
        if args.allowed_hosts:
            hosts = tuple(host_name(h) for h in _split_list(args.allowed_hosts))   # ports ignored
            if "*" in hosts:
                hosts = None
        elif is_loopback_bind(args.host):
            hosts, any_ip = LOOPBACK_NAMES, False
        else:
            hosts = tuple(sorted({"localhost", socket.gethostname().lower()}))
        keys = {key_digest(k): key_identity(k, name) for k, name in args.resolved_api_keys()}
        admin = args.resolved_admin_api_key()
        return cls(client_keys=keys, admin_key=key_digest(admin) if admin else None,
                   allowed_hosts=hosts, any_ip_host=any_ip,
                   allowed_origins=tuple(normalize_origin(o) for o in _split_list(args.allowed_origins)),
                   max_request_bytes=args.max_request_bytes,
                   expose_server_info=args.expose_server_info)

    @property
    def requires_key(self) -> bool:
        """Every route but OPEN_PATHS needs a key."""
        return bool(self.client_keys)

    def host_allowed(self, host_header: Optional[str]) -> bool:
        if host_header is None:
            return True          # no Host at all (browsers always send one)
        name = host_name(host_header)
        try:
            ip = ipaddress.ip_address(name)
        except ValueError:
            ip = None
        if ip is not None:
            mapped = getattr(ip, "ipv4_mapped", None)
            return (self.any_ip_host or ip.is_loopback or ip.is_unspecified
                    or bool(mapped and mapped.is_loopback))
        if self.allowed_hosts is None:
            return True
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


# renders a refusal (the error, extra headers) as a response: jsonio.error_response by default
ErrorRenderer = Callable[[ApiError, Optional[dict]], Response]


class Door:
    """ASGI middleware applying a DoorPolicy to every HTTP request (module docstring).
    `errors`: path -> the renderer of that path's refusals, for routes whose clients expect
    another error shape (the Anthropic routes); every other path gets jsonio.error_response."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy,
                 errors: Optional[Mapping[str, ErrorRenderer]] = None):
        self.policy = policy
        self.errors: Mapping[str, ErrorRenderer] = dict(errors or {})
        inner: ASGIApp = _Lock(app, policy, self.errors)
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
                f"allowed name or start it with --allowed-hosts {name}", 421), errors=self.errors)
            return
        origin = headers.get("origin")
        if origin is not None and not self.policy.origin_listed(origin) and not _same_origin(origin, host):
            await _refuse(scope, receive, send, ApiError(
                f"cross-origin requests from {origin[:200]!r} are not allowed; start the server "
                f"with --allowed-origins {origin[:200]} to allow that origin", 403),
                errors=self.errors)
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
    """The API keys and the body-size limit (inside CORS, so preflights skip the key and error
    responses carry CORS headers for allowed origins)."""

    def __init__(self, app: ASGIApp, policy: DoorPolicy,
                 errors: Optional[Mapping[str, ErrorRenderer]] = None):
        self.app = app
        self.policy = policy
        self.errors = errors or {}

    def _identify(self, scope: Scope, authorization: Optional[str]) -> Tuple[Optional[str], Optional[ApiError]]:
        """(the request's identity, or the error to answer instead): module docstring, step 3."""
        policy = self.policy
        digest = _token_digest(authorization)
        admin = (policy.admin_key is not None and digest is not None
                 and hmac.compare_digest(digest, policy.admin_key))
        client_key = policy.client_keys.get(digest) if digest is not None else None
        path = scope["path"]
        if path in ADMIN_PATHS and policy.admin_key is not None:
            if admin:
                return ADMIN_IDENTITY, None
            if client_key is not None:
                return None, ApiError(f"{path} is a server-wide route: it takes the admin key "
                                      "(--admin-api-key), not a client key", 403)
            return None, _unauthorized(authorization, admin_route=True)
        if admin:
            return ADMIN_IDENTITY, None
        if client_key is not None:
            return client_key, None
        if policy.requires_key and path not in OPEN_PATHS:
            return None, _unauthorized(authorization, admin_route=False)
        client = scope.get("client")
        return "peer:" + (client[0] if client else "unknown"), None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        identity, refusal = self._identify(scope, _credentials(headers))
        if refusal is not None:
            await _refuse(scope, receive, send, refusal,
                          headers={"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None,
                          errors=self.errors)
            return
        scope[_IDENTITY_KEY] = identity
        limit = self.policy.max_request_bytes
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await _refuse(scope, receive, send,
                              bad_request(f"Content-Length {length[:40]!r} is not a byte count"),
                              errors=self.errors)
                return
            if int(length) > limit:
                await _refuse(scope, receive, send, RequestTooLarge(limit), errors=self.errors)
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
            await _refuse(scope, receive, send, e, errors=self.errors)


def _credentials(headers: Headers) -> Optional[str]:
    """The key a request sends, as an Authorization value: its Authorization header, else its
    x-api-key header (Anthropic's clients) as a Bearer token; None without either."""
    authorization = headers.get("authorization")
    if authorization is None and headers.get("x-api-key"):
        return "Bearer " + headers["x-api-key"]
    return authorization


def _token_digest(authorization: Optional[str]) -> Optional[bytes]:
    """The digest of a Bearer token (None without one). Header values arrive as latin-1
    text, so a UTF-8 key sent as its bytes is its UTF-8 bytes again here."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return hashlib.sha256(token.encode("latin-1")).digest()


def _unauthorized(authorization: Optional[str], admin_route: bool) -> ApiError:
    which = "the admin key (--admin-api-key)" if admin_route else \
        "a key the server was started with (--api-key, --api-key-file or RADIXSERVE_API_KEY)"
    if authorization is not None:
        return ApiError(f"invalid API key; send {which} as 'Authorization: Bearer <key>' "
                        "(or 'x-api-key: <key>')", 401)
    return ApiError(f"this route needs an API key: send {which} as "
                    "'Authorization: Bearer <key>' (or 'x-api-key: <key>')", 401)


async def _refuse(scope: Scope, receive: Receive, send: Send, err: ApiError,
                  headers: Optional[dict] = None,
                  errors: Optional[Mapping[str, ErrorRenderer]] = None) -> None:
    """Answer `err` (in the shape `errors` gives the path, else jsonio.error_response's)
    without reading the request body; the connection is not reused when a body was left
    unread (the ASGI server closes it)."""
    render = (errors or {}).get(scope["path"], error_response)
    await render(err, headers)(scope, receive, send)


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
    """The live requests: (client identity, rid) -> the rid the engine runs it under (module
    docstring, "Request ownership"). One per app; loop thread only. Filled by
    ClientView.generate for exactly as long as the engine runs the request."""

    def __init__(self) -> None:
        self._engine_rid: Dict[Tuple[str, str], str] = {}   # (owner, rid) -> engine rid
        self._owner: Dict[str, str] = {}                    # engine rid -> owner

    def engine_rid(self, owner: str, rid: str) -> Optional[str]:
        """The engine rid of `owner`'s live request `rid`, or None."""
        return self._engine_rid.get((owner, rid))

    def held(self, engine_rid: str) -> bool:
        """Whether any live request runs under `engine_rid`."""
        return engine_rid in self._owner

    def reserve(self, rid: str, owner: str) -> str:
        """Record `owner`'s new request `rid`; returns the engine rid it is to run under: `rid`
        itself, or a unique alias when another live request runs under that id. Raises
        ValueError when `owner` has a live request `rid` already."""
        if (owner, rid) in self._engine_rid:
            raise ValueError(_rid_in_use(rid))
        engine_rid = rid
        while engine_rid in self._owner:
            engine_rid = f"{rid}#{uuid.uuid4().hex[:12]}"
        self._engine_rid[(owner, rid)] = engine_rid
        self._owner[engine_rid] = owner
        return engine_rid

    def release(self, rid: str, owner: str) -> None:
        engine_rid = self._engine_rid.pop((owner, rid), None)
        if engine_rid is not None:
            self._owner.pop(engine_rid, None)

    def owned_by(self, owner: str) -> List[str]:
        """The engine rids of the live requests `owner` started."""
        return [engine_rid for engine_rid, who in self._owner.items() if who == owner]

    def __len__(self) -> int:
        return len(self._owner)


def _rid_in_use(rid: str) -> str:
    return f"request id {rid!r} is already in use by one of your running requests; send a unique rid"


class ClientView:
    """The engine as one client's request sees it (app.py hands it to every route instead of
    the engine): `generate` runs each request under the engine rid RequestOwners gives its
    (client, rid) for as long as the engine runs it, with req.client_id set to the client's
    identity (the scheduler's per-client key); `validate` refuses a rid of the client's own
    that is live already; `abort` reaches only the client's own live requests (anything else
    is left alone, silently, like a finished request; an id no live request holds goes to the
    engine, which ignores it). Everything else is the engine's own attribute."""

    def __init__(self, engine, identity: str, owners: RequestOwners):
        self._engine = engine
        self._identity = identity
        self._owners = owners

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def identity(self) -> str:
        return self._identity

    def validate(self, req, prompt_checked: bool = False) -> None:
        if self._owners.engine_rid(self._identity, req.rid) is not None:
            raise ValueError(_rid_in_use(req.rid))
        self._engine.validate(req, prompt_checked=prompt_checked)

    async def generate(self, req, validated: bool = False) -> AsyncIterator[Any]:
        """The engine's generate under this client's engine rid; validated: as the engine's
        (the routes validated req through validate, so the engine does not again)."""
        rid = req.rid
        engine_rid = self._owners.reserve(rid, self._identity)
        req.client_id = self._identity        # the scheduler's fairness key
        run = req if engine_rid == rid else dataclasses.replace(req, rid=engine_rid)
        try:
            agen = self._engine.generate(run, validated=validated)
            try:
                async for out in agen:
                    yield out
            finally:
                await agen.aclose()
        finally:
            self._owners.release(rid, self._identity)

    def abort(self, rid: str) -> bool:
        """Abort this client's live request `rid` (or pass an id no live request holds on to
        the engine); returns whether the engine was asked."""
        engine_rid = self._owners.engine_rid(self._identity, rid)
        if engine_rid is None:
            if self._owners.held(rid):
                logger.info("refused to abort another client's request")
                return False
            engine_rid = rid
        self._engine.abort(engine_rid)
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

_SECRET_KEYS = frozenset({"api_key", "admin_api_key"})
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
