"""The Idempotency-Key store: a retry with the same key (and the same body) attaches to the
request(s) the first try started, instead of starting new ones. A key is (tenant, endpoint,
Idempotency-Key): tenants and endpoints never see each other's. Keys are kept for a TTL and at
most `max_keys` of them (the oldest go first)."""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

from .errors import ApiError

MAX_KEY_CHARS = 255         # a key is kept for its TTL: bounded
Key = tuple[str, str, str]  # (tenant, endpoint, Idempotency-Key)


@dataclass
class IdempotencyEntry:
    body_hash: str
    request_ids: list[str]
    created: float


class IdempotencyKeys:
    def __init__(self, ttl_s: float, max_keys: int) -> None:
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self._entries: OrderedDict[Key, IdempotencyEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, header: str | None, tenant: str, endpoint: str, raw: bytes
               ) -> tuple[Key | None, IdempotencyEntry | None]:
        """A request's key (None: no Idempotency-Key header) and the entry a retry attaches to."""
        key = key_of(header, tenant, endpoint)
        return key, self.find(key, raw)

    def find(self, key: Key | None, raw: bytes) -> IdempotencyEntry | None:
        """The entry a retry attaches to; 409 for the same key with another body."""
        if key is None:
            return None
        now_s = time.monotonic()
        entries = self._entries
        while entries and (len(entries) > self.max_keys or now_s - next(iter(entries.values())).created > self.ttl_s):
            entries.popitem(last=False)
        entry = entries.get(key)
        if entry is None:
            return None
        if entry.body_hash != hashlib.sha256(raw).hexdigest():
            raise ApiError(409, "this Idempotency-Key was used with a different request body",
                           code="idempotency_key_reused")
        return entry

    def remember(self, key: Key | None, raw: bytes, request_ids: list[str]) -> None:
        if key is not None:
            self._entries[key] = IdempotencyEntry(hashlib.sha256(raw).hexdigest(), request_ids, time.monotonic())


def key_of(header: str | None, tenant: str, endpoint: str) -> Key | None:
    """The store's key for a request's Idempotency-Key header (None: no header)."""
    if header is None:
        return None
    if len(header) > MAX_KEY_CHARS:
        raise ApiError(400, f"Idempotency-Key: at most {MAX_KEY_CHARS} characters",
                       param="Idempotency-Key", code="invalid_value")
    return (tenant, endpoint, header)
