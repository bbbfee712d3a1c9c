"""What a web page in the user's browser must not be able to do with the server.

- Cross-site request forgery: a page may send a `text/plain` (or form) POST to any address
  without asking first; a POST whose Content-Type is not `application/json` is refused (415),
  so only requests a browser preflights (and we never allow) carry a body we read. A POST
  without a body (cancelling a response) needs no Content-Type: it names its target only by
  the random id in its path, which a page cannot know.
- DNS rebinding: a page whose name the attacker points at 127.0.0.1 reads the answers as its
  own origin; its requests carry the attacker's name in Host. The Host header must name the
  address the connection arrived on (an IP literal), `localhost` on a loopback connection, or
  one of `allowed_hosts` ("*": any); otherwise 421. The port is not compared.
"""
from __future__ import annotations

import ipaddress
from typing import Any, Awaitable, Callable, Iterable

from starlette.responses import JSONResponse

from .errors import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


def host_name(header: str) -> str:
    """The name in a Host header, without port or brackets, lower case: `[::1]:80` -> `::1`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _has_body(headers: dict[str, str]) -> bool:
    """Whether the request says a body follows: a bodiless POST (POST /v1/responses/{id}/cancel)
    has no media type to name, and a route that wants a body answers 400 for the empty one."""
    return "transfer-encoding" in headers or headers.get("content-length", "0").strip() != "0"


class RequestGuard:
    """ASGI middleware: the Host and Content-Type checks above, before any route runs."""

    def __init__(self, app: App, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed = {host_name(h) for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self.check(scope)
            except ApiError as e:
                await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, scope: Scope) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        self.check_host(headers.get("host"), scope.get("server"))
        if scope.get("method") == "POST" and _has_body(headers):
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                raise ApiError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                               code="unsupported_media_type", type_="invalid_request_error")

    def check_host(self, header: str | None, server: tuple[str, int] | None) -> None:
        if "*" in self.allowed or server is None:     # no socket address (a unix socket): no browser
            return
        name = host_name(header or "")
        local = str(server[0])
        if name in self.allowed or _same_address(name, local) or (name == "localhost" and _loopback(local)):
            return
        raise ApiError(421, f"Host {header!r} is not this server's address (start it with --allowed-host NAME "
                       "to answer to that name)", code="host_not_allowed", type_="invalid_request_error")
