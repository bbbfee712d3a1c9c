"""Scripted engines for runtime tests."""
import pagedecode as pd
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
