"""Prefix caching: full KV pages keyed by a chained hash, shared between requests whose known
tokens start the same way.

    key(page i) = sha256(key(page i - 1) || token ids of page i || namespace)

The namespace holds the model's identity, the request's `cache_salt` and its LoRA adapter's
name and weights' digest, so requests with different salts, or under different adapters (or one
and the base model), never share a page: K/V computed under an adapter is that adapter's. Only full pages are keyed, and only after the step that
wrote their last token committed. At admission the longest chain of cached pages is matched,
at most up to the second-to-last known token (the last one is always computed, to produce the
logits that choose the next token), each page confirmed by the pool against its tokens and
its parent page, so the whole chain is confirmed, never the key alone.

    known tokens   | page 0 | page 1 | page 2 | partial |
    matched        | hit    | hit    | miss -> computed from here on
"""
from __future__ import annotations

import hashlib
from array import array

from .page_pool import PagePool
from .request import Request


def page_key(prev: bytes, tokens: list[int], namespace: bytes) -> bytes:
    """The chained key of one full page (module docstring)."""
    h = hashlib.sha256(prev)
    h.update(array("q", tokens).tobytes())
    h.update(namespace)
    return h.digest()


def namespace(model_id: str, cache_salt: str | None, adapter: tuple[str, str] | None = None) -> bytes:
    """adapter: the LoRA adapter's (name, digest of its weights), None for the base model."""
    lora = "" if adapter is None else f"\x00lora\x00{adapter[0]}\x00{adapter[1]}"
    return hashlib.sha256(f"{model_id}\x00{cache_salt or ''}{lora}".encode()).digest()


def _page_tokens(req: Request, i: int, page_size: int) -> list[int]:
    return [req.token_at(p) for p in range(i * page_size, (i + 1) * page_size)]


def keys_for(req: Request, n_pages: int, page_size: int) -> list[bytes]:
    """The request's page keys up to n_pages full pages (computed once, kept on the request:
    they depend on its tokens only, so they survive preemption)."""
    keys = req.seq.page_keys
    while len(keys) < n_pages:
        prev = keys[-1] if keys else b""
        keys.append(page_key(prev, _page_tokens(req, len(keys), page_size), req.cache_namespace))
    return keys[:n_pages]


def match(pool: PagePool, req: Request, page_size: int) -> list[int]:
    """The cached pages of req's longest matching prefix (not yet retained), leaving at least the
    last known token to compute. Each page is confirmed by its tokens and its parent, the page
    matched before it: the whole chain, not only the key."""
    limit = (req.num_tokens - 1) // page_size
    pages: list[int] = []
    for i, key in enumerate(keys_for(req, limit, page_size)):
        page = pool.lookup(key, _page_tokens(req, i, page_size), pages[-1] if pages else None)
        if page is None:
            break
        pages.append(page)
    return pages


def register(pool: PagePool, req: Request, page_size: int) -> None:
    """After a commit: key every page of req that is now full and not yet keyed. A page whose
    parent is not cached (its key named another page) is not: its chain cannot be confirmed."""
    full = min(req.seq.num_computed // page_size, len(req.seq.pages))
    if full <= req.seq.pages_registered:
        return
    for i, key in enumerate(keys_for(req, full, page_size)[req.seq.pages_registered:], start=req.seq.pages_registered):
        parent = req.seq.pages[i - 1] if i else None
        pool.register(req.seq.pages[i], key, _page_tokens(req, i, page_size), parent)
    req.seq.pages_registered = full
