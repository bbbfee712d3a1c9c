"""Scripted engines for runtime tests, and a bare scheduler with queued requests."""
import random

import pagedecode as pd
from pagedecode.runtime.intake import make_request
from pagedecode.runtime.lifecycle import RequestState
from pagedecode.runtime.page_pool import PagePool
from pagedecode.runtime.scheduler import Scheduler
from pagedecode.runtime.slots import SlotTable
from pagedecode.testing import ByteVocabTokenizer, ScriptedModel

VOCAB = {1: b"<s>", 2: b"</s>", 5: b"x", 6: b"y", 101: b"AB", 102: b"CD", 103: b"EF", 104: b"B",
         110: b"\xc3", 111: b"\xa9", 120: " café".encode(), 121: b"\xe2\x82", 122: b"\xac"}
BOS, EOS = 1, 2


def tokenizer():
    return ByteVocabTokenizer(VOCAB, bos_token_id=BOS, eos_token_id=EOS)


def engine(script, vocab_size=200, on_forward=None, max_context=4096, **config):
    model = ScriptedModel(script, vocab_size=vocab_size, on_forward=on_forward, max_context=max_context,
                          eos_token_ids=[EOS])
    config.setdefault("max_cache_tokens", 4096)
    config.setdefault("trace", "tokens")        # the contract tests read per-token records
    return pd.Engine(model, tokenizer(), pd.EngineConfig(**config))


def run(eng, max_steps=100_000):
    """Step to the end, checking the page pool after every step; returns all events."""
    events = []
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        events += eng.step()
        eng.check_integrity()
    events += eng.step()            # anything still in the outbox
    assert not eng.has_unfinished()
    return events


def of(events, rid, kind=None):
    return [e for e in events if e.request_id == rid and (kind is None or isinstance(e, kind))]


def check_stream(events, rid):
    """Start first, strictly increasing seqs, exactly one terminal event, last."""
    evs = of(events, rid)
    assert isinstance(evs[0], pd.StartEvent)
    seqs = [e.seq for e in evs]
    assert seqs == sorted(set(seqs)) and seqs[0] == 0
    terminals = [e for e in evs if isinstance(e, pd.TerminalEvent)]
    assert len(terminals) == 1 and evs[-1] is terminals[0]
    return evs


# -- a scheduler alone (test_scheduler.py, test_units.py's batch builder) ---------------------------

def req(rid, n_prompt, max_tokens=5):
    r = make_request([5] * n_prompt, pd.SamplingParams(max_tokens=max_tokens), rid, tokenizer=tokenizer(),
                     vocab_size=200, max_context=1000, rng=random.Random(0), trace_level="lifecycle")
    r.transition(RequestState.QUEUED)
    return r


def scheduler(pages=11, page=4, slots=3, budget=7):
    return Scheduler(PagePool(pages), SlotTable(slots), page, budget)


def commit(plan):
    """What the engine does after the step: advance, and choose a token for sampling seqs."""
    for s in plan.seqs:
        s.request.seq.num_computed += s.num_new
        if s.samples:
            s.request.output_ids.append(101)
            if s.request.state == RequestState.PREFILLING:
                s.request.transition(RequestState.DECODING)


def poison_past_lengths(eng, caches) -> int:
    """NaN in every slot past each running request's logical length (a draft's K/V, rejected ones
    among them) and in every free page, in each of `caches` (the engine's K and V, or their
    scales: layers x pages x slots ...); returns how many slots past the lengths it poisoned.
    Called after every step, a read of any of them ends in NaN logits."""
    ps, held, poisoned = eng.config.page_size, set(), 0
    for r in eng.scheduler.running:
        held.update(r.seq.pages)
        for pos in range(r.seq.num_computed, len(r.seq.pages) * ps):
            for cache in caches:
                cache[:, r.seq.pages[pos // ps], pos % ps] = float("nan")
            poisoned += 1
    free = [p for p in range(eng.pool.num_pages) if p not in held]
    for cache in caches:
        cache[:, free] = float("nan")
    return poisoned
