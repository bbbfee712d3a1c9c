"""Tenants: who holds one API key (without keys: the one anonymous tenant). A request's events,
trace and Idempotency-Keys belong to its tenant: another tenant is told they do not exist (404,
never 403), and Idempotency-Keys live apart per (tenant, endpoint)."""
from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from .errors import ApiError

ANONYMOUS = "anonymous"             # the tenant of a server without API keys


class Tenants:
    """The keys a server accepts, each with its tenant's name (a digest of the key, so logs
    never hold a key)."""

    def __init__(self, keys: list[str]) -> None:
        self._keys: list[tuple[bytes, str]] = []
        for key in keys:
            if not key or key != key.strip():
                raise ValueError("an API key must be non-empty, without surrounding whitespace")
            name = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
            if all(n != name for _, n in self._keys):
                self._keys.append((key.encode(), name))

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, request: Request) -> str:
        """The tenant whose key the request carries (ANONYMOUS on a server without keys); 401
        otherwise. The key is a Bearer token or an x-api-key header. Every key is compared, each in constant time."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 7235: "bearer" is "Bearer")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not given:           # Anthropic's clients send the key as x-api-key
            given = request.headers.get("x-api-key", "").strip().encode()
        found: str | None = None
        for expected, tenant in self._keys:
            if hmac.compare_digest(given, expected):
                found = tenant
        if found is None:
            raise ApiError(401, "invalid or missing API key", code="invalid_api_key")
        return found
