"""The page pool: reference counts, the free / evictable / in-use partition, the prefix cache's
hashed chains, least-recently-used eviction, and check_integrity catching a corruption."""
import pytest
from hypothesis import given, settings, strategies as st

import pagedecode as pd
from pagedecode.runtime.page_pool import PagePool


def test_page_pool_double_release_raises():
    pool = PagePool(4)
    pages = pool.allocate(3)
    assert pool.allocate(2) is None and pool.free_pages == 1     # nothing taken on failure
    pool.release(pages[:2])
    with pytest.raises(pd.DoubleReleaseError):
        pool.release(pages[:1])
    pool.retain(pages[2])
    pool.release([pages[2]])
    assert pool.ref_counts[pages[2]] == 1
    pool.release([pages[2]])
    pool.check_integrity()
    assert pool.free_pages == 4


def test_page_pool_release_of_the_same_page_twice_in_one_call_raises():
    pool = PagePool(4)
    pages = pool.allocate(2)
    with pytest.raises(pd.DoubleReleaseError):
        pool.release([pages[0], pages[0]])
    assert pool.ref_counts[pages[0]] == 1                 # nothing was changed
    pool.retain(pages[0])
    pool.release([pages[0], pages[0]])                    # two references: fine
    pool.check_integrity()
    assert pool.free_pages == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_page_pool_integrity_under_random_use(ops):
    pool = PagePool(12)
    held = []
    for alloc, n in ops:
        if alloc:
            got = pool.allocate(n)
            if got is not None:
                held.append(got)
        elif held:
            pool.release(held.pop(n % len(held)))
        pool.check_integrity()
        assert pool.free_pages + sum(map(len, held)) == 12


def test_page_pool_confirms_the_chain_and_forgets_orphans():
    """A hashed page is found only after its own parent; when a parent loses its hash (evicted,
    its page reused), its descendants lose theirs: a reused page number never vouches for them."""
    pool = PagePool(4)
    a0, a1, a2 = pool.allocate(3)
    assert pool.register(a0, b"k0", [1], None) and pool.register(a1, b"k1", [2], a0)
    assert pool.register(a2, b"k2", [3], a1)
    assert not pool.register(pool.allocate(1)[0], b"k9", [4], 3)        # an unhashed parent: refused
    assert pool.lookup(b"k1", [2], a0) == a1
    assert pool.lookup(b"k1", [2], None) is None                       # same key and tokens, other place
    assert pool.lookup(b"k1", [2], a2) is None                         # ... or other parent
    pool.release([a2, a1, a0, 3])
    pool.check_integrity()
    (reused,) = pool.allocate(1)           # the free page 3 first ...
    (reused,) = pool.allocate(1)           # ... then the least recently used cached page: a2, a leaf
    assert reused == a2 and pool.cached_pages == 2
    pool.release([reused, 3])
    pool.clear_cache()
    assert pool.cached_pages == 0 and pool.free_pages == 4
    pool.check_integrity()
    b0, b1 = pool.allocate(2)
    assert pool.register(b0, b"k0", [1], None) and pool.register(b1, b"k1", [2], b0)
    pool.release([b1, b0])
    pool.allocate(2)                       # the two free pages
    (head,) = pool.allocate(1)             # the LRU cached page: b1 then b0 were released, b1 is older
    assert head == b1 and pool.cached_pages == 1
    (head,) = pool.allocate(1)
    assert head == b0 and pool.cached_pages == 0
    pool.check_integrity()


def test_page_pool_evicting_a_parent_drops_its_children():
    pool = PagePool(3)
    p0, p1 = pool.allocate(2)
    pool.register(p0, b"k0", [1], None)
    pool.register(p1, b"k1", [2], p0)
    pool.release([p0, p1])                 # head first: the head is evicted first
    pool.allocate(1)                       # the free page
    (taken,) = pool.allocate(1)
    assert taken == p0
    assert pool.cached_pages == 0 and pool.lookup(b"k1", [2], p0) is None   # its child went with it
    assert pool.free_pages == 1                                             # ... and is free again
    pool.check_integrity()
    assert pool.register(taken, b"k5", [9], None)                           # the page number reused
    assert pool.lookup(b"k1", [2], taken) is None
    pool.check_integrity()


def partition(pool):
    """(free, evictable, in use) page sets, read through the public counts and maps."""
    in_use = {p for p, c in enumerate(pool.ref_counts) if c > 0}
    evictable = {p for p in pool.page_hash if pool.ref_counts[p] == 0}
    free = set(range(pool.num_pages)) - in_use - evictable
    return free, evictable, in_use


def test_ref_counts_move_pages_between_free_evictable_and_in_use():
    pool = PagePool(5)
    a, b, c = pool.allocate(3)
    assert partition(pool) == ({3, 4}, set(), {a, b, c}) and pool.free_pages == 2
    pool.register(a, b"ka", [1], None)
    pool.retain(a)                                  # shared by two requests
    pool.release([a, b])
    assert pool.ref_counts[a] == 1 and partition(pool) == ({b, 3, 4}, set(), {a, c})
    pool.release([a])                               # the last owner: hashed, so kept as evictable
    assert partition(pool) == ({b, 3, 4}, {a}, {c}) and pool.free_pages == 4 and pool.cached_pages == 1
    assert pool.lookup(b"ka", [1], None) == a
    pool.retain(a)                                  # a hit takes it back out of the evictable set
    assert partition(pool) == ({b, 3, 4}, set(), {a, c}) and pool.free_pages == 3
    with pytest.raises(pd.DoubleReleaseError):
        pool.retain(b)                              # a free page cannot be shared
    with pytest.raises(ValueError, match="outside the pool"):
        pool.release([5])
    pool.check_integrity()


def test_eviction_takes_the_least_recently_used_cached_page():
    pool = PagePool(3)
    a, b, c = pool.allocate(3)
    for page, key in ((a, b"ka"), (b, b"kb"), (c, b"kc")):
        pool.register(page, key, [page], None)       # three one-page chains
    pool.release([a, b, c])
    assert pool.lookup(b"ka", [a], None) == a        # a is used again: now the most recent
    taken = [pool.allocate(1)[0] for _ in range(2)]
    assert taken == [b, c] and pool.cached_pages == 1 and pool.lookup(b"kb", [b], None) is None
    assert pool.lookup(b"ka", [a], None) == a
    pool.check_integrity()
    assert pool.allocate(2) is None and pool.cached_pages == 1    # a failed allocation evicts nothing


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool, pages: pool.ref_counts.__setitem__(3, 1), "free and in use"),
    (lambda pool, pages: pool._free.append(4), "twice in the free list"),
    (lambda pool, pages: pool.ref_counts.__setitem__(pages[1], -1), "negative"),
    (lambda pool, pages: pool._free.remove(3), "!= total"),
    (lambda pool, pages: pool.by_hash.__setitem__(b"k0", pages[1]), "not inverse"),
    (lambda pool, pages: pool._evictable.__setitem__(4, None), "evictable"),
    (lambda pool, pages: pool._parent.__setitem__(pages[1], 4), "parent"),
])
def test_check_integrity_catches_a_corruption(corrupt, message):
    pool = PagePool(5)
    pages = pool.allocate(3)
    pool.register(pages[0], b"k0", [1], None)
    pool.register(pages[1], b"k1", [2], pages[0])
    pool.check_integrity()
    corrupt(pool, pages)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
