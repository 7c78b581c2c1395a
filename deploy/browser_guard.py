"""What a web page may make a browser send to the server: nothing, unless the operator says so.

A page on any site can make its visitor's browser POST to a server on that visitor's loopback
(a "simple" request: text/plain, no preflight) or, after DNS rebinding, read the answers as its
own origin. Keys stop both; a keyless server must stop them itself. This ASGI middleware runs
before any route:

- Host: with some model answering without a key, the request's Host must name loopback
  (127.0.0.0/8, localhost, [::1], any port) or one of `allowed_hosts`: a rebound name is refused
  (403). With keys on every model the key decides, and any Host passes.
- Origin: a request carrying an Origin (a browser's, cross-site) is refused (403) unless the origin
  is one of `allowed_origins`; those get CORS headers, their preflights a 204. Nothing else gets
  CORS headers.
- Content type: a POST must say `application/json`: the content types a page may send without a
  preflight (text/plain, forms, none at all) get 415. The one exception, a file upload
  (`multipart/form-data` to `/v1/files`), must carry an Authorization header, which no page can
  add without a preflight.

Refusals are OpenAI error JSON, like every other error of the server.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deploy.errors import APIError, PermissionDeniedError, error_response

# Bounds of the two settings: a list an operator writes by hand, entries a URL may hold.
MAX_ALLOWED = 64
MAX_HOST_CHARS = 253  # a DNS name's longest spelling
MAX_ORIGIN_CHARS = 2048
JSON_TYPE = "application/json"
UPLOAD_PATH = "/v1/files"
PREFLIGHT_MAX_AGE_S = 600
_BODY_METHODS = ("POST", "PUT", "PATCH")
# What a browser may read of an allowed origin's answers besides the CORS-safelisted headers.
_EXPOSED = "retry-after, x-raylm-ignored-fields, x-request-id"


class UnsupportedMediaTypeError(APIError, status=415, error_type="invalid_request_error"):
    """A POST that does not say `application/json` (what a page may send without a preflight)."""


def check_hosts(hosts: object, field_name: str = "allowed_hosts") -> list[str]:
    """The host names (lowercased, no port) if `hosts` is a list of at most MAX_ALLOWED of them,
    else ValueError naming the field."""
    items = _string_list(hosts, field_name, MAX_HOST_CHARS)
    for host in items:
        if any(c in host for c in ":/@ ") or host.startswith("["):
            raise ValueError(f"{field_name}: a host name without port or scheme, got {host!r}")
    return [h.lower().rstrip(".") for h in items]


def check_origins(origins: object, field_name: str = "allowed_origins") -> list[str]:
    """The origins (`scheme://host[:port]`, lowercased) if `origins` is a list of at most
    MAX_ALLOWED of them, else ValueError naming the field."""
    items = _string_list(origins, field_name, MAX_ORIGIN_CHARS)
    for origin in items:
        scheme, sep, rest = origin.partition("://")
        if scheme.lower() not in ("http", "https") or not sep or not rest or "/" in rest:
            raise ValueError(
                f"{field_name}: an origin is scheme://host[:port] (http or https, no path), "
                f"got {origin[:64]!r}"
            )
    return [o.lower() for o in items]


def _string_list(value: object, field_name: str, max_chars: int) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_ALLOWED:
        raise ValueError(f"{field_name}: must be a list of at most {MAX_ALLOWED} strings")
    for item in value:
        if not isinstance(item, str) or not 1 <= len(item) <= max_chars:
            raise ValueError(f"{field_name}: each entry a string of 1 to {max_chars} characters")
    return value


def is_loopback(host: str) -> bool:
    """Whether a Host header's value (port and IPv6 brackets allowed) names this machine."""
    name = _host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(host: str) -> str:
    """The host part of a Host header's value, lowercased, without port, brackets or final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, sep, port = host.rpartition(":")
    return (name if sep and port.isdigit() else host).rstrip(".")


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """Which requests the guard lets through (built by the ingress from its settings)."""

    check_host: bool  # some model answers without a key
    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, keyless: bool, hosts: Iterable[str] | None, origins: Iterable[str] | None
    ) -> BrowserPolicy:
        return cls(
            keyless,
            frozenset(check_hosts(list(hosts or []))),
            frozenset(check_origins(list(origins or []))),
        )

    def refusal(self, method: str, headers: Headers, path: str = "") -> APIError | None:
        """Why this request may not reach a route (None: it may)."""
        return (
            self._host_refusal(headers)
            or self._origin_refusal(headers)
            or _media_type_refusal(method, headers, path)
        )

    def _host_refusal(self, headers: Headers) -> APIError | None:
        host = headers.get("host")
        # Every HTTP/1.1 request, and every browser's, names its host; one without is no page's.
        if not self.check_host or host is None or self._host_allowed(host):
            return None
        return PermissionDeniedError(
            "Host: this server answers requests without a key only for loopback names and "
            "its allowed_hosts setting.",
            code="host_not_allowed",
        )

    def _origin_refusal(self, headers: Headers) -> APIError | None:
        origin = headers.get("origin")
        if origin is None or origin.lower() in self.allowed_origins:
            return None
        return PermissionDeniedError(
            "Origin: cross-origin browser requests are refused (the allowed_origins setting "
            "opens the server to an origin).",
            code="origin_not_allowed",
        )

    def _host_allowed(self, host: str) -> bool:
        return is_loopback(host) or _host_name(host) in self.allowed_hosts


def _media_type_refusal(method: str, headers: Headers, path: str) -> APIError | None:
    """A body that is not JSON (a file upload's multipart form aside)."""
    if method not in _BODY_METHODS or _media_type(headers) == JSON_TYPE or _upload(path, headers):
        return None
    return UnsupportedMediaTypeError(
        f"Content-Type: request bodies must be {JSON_TYPE}.", code="unsupported_media_type"
    )


def _media_type(headers: Headers) -> str:
    return headers.get("content-type", "").partition(";")[0].strip().lower()


def _upload(path: str, headers: Headers) -> bool:
    """A file upload of the Batch API by a client that is no web page (it sends a key header)."""
    return (
        path.endswith(UPLOAD_PATH)
        and _media_type(headers) == "multipart/form-data"
        and "authorization" in headers
    )


class BrowserGuard:
    """The ASGI middleware: refuses what BrowserPolicy refuses, answers allowed origins'
    preflights, and adds CORS headers to allowed origins' responses.

    policy_of: the serving ingress's policy, read on each request (the ingress is built after the
    app, in its replica)."""

    def __init__(self, app: ASGIApp, policy_of: Callable[[], BrowserPolicy]) -> None:
        self.app = app
        self.policy_of = policy_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self.policy_of().refusal(scope["method"], headers, scope["path"])
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
        elif scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await _preflight(origin, headers)(scope, receive, send)
        else:
            await self.app(scope, receive, _with_cors(send, origin))


def _preflight(origin: str, headers: Headers) -> Response:
    """An allowed origin's preflight answered here: the routes know no OPTIONS."""
    cors = {
        "access-control-allow-origin": origin,
        "access-control-allow-methods": "GET, POST, OPTIONS",
        # The origin is trusted: it may send the headers it asks for (the OpenAI SDKs' own).
        "access-control-allow-headers": headers.get("access-control-request-headers", ""),
        "access-control-max-age": str(PREFLIGHT_MAX_AGE_S),
        "vary": "Origin",
    }
    return Response(status_code=204, headers=cors)


def _with_cors(send: Send, origin: str) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            extra = [
                (b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-expose-headers", _EXPOSED.encode()),
                (b"vary", b"Origin"),
            ]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped
