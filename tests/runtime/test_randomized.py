"""Random workloads of many requests with stop strings, cancels, deadlines, slow consumers and a
tight page pool. After every step: one terminal event per request at most, none before its
deltas end, strictly increasing sequence numbers, a consistent page pool. At the end: every
page free, every resource released once, streamed text == final text."""
from hypothesis import HealthCheck, event, given, settings, strategies as st

import pagedecode as pd
from pagedecode.testing import ByteVocabTokenizer, ScriptedModel

VOCAB = {1: b"<s>", 2: b"</s>", 10: b"a", 11: b"b", 12: b"ab", 13: b"ba", 14: b" ", 15: b"\xc3", 16: b"\xa9",
         17: "é".encode(), 18: b"\xe2\x82", 19: b"\xac"}
IDS = sorted(VOCAB)


def script(prompt, out):
    """Deterministic per request: a walk over the vocabulary driven by the prompt."""
    h = (sum(prompt) * 31 + len(out) * 17 + (out[-1] if out else 0) * 7) % 101
    if h == 0:
        return 2                                  # EOS now and then
    return IDS[2 + h % (len(IDS) - 2)]


request = st.fixed_dictionaries({
    "prompt": st.lists(st.sampled_from(IDS[2:]), min_size=1, max_size=20),
    "max_tokens": st.integers(1, 25),
    "stop": st.lists(st.sampled_from(["ab", "ba", "é", "b a", "€", "aab"]), max_size=2),
    "stop_ids": st.lists(st.sampled_from([12, [10, 11], [13, 14, 10]]), max_size=2),
    "cancel_at": st.none() | st.integers(0, 30),
    "deadline": st.sampled_from([None, None, None, 1e-6]),
    "acked": st.booleans(),
    "read": st.integers(0, 3),                    # events read per step (0: a stalled consumer)
    "arrive": st.integers(0, 10),
    "temperature": st.sampled_from([0.0, 0.0, 1.0]),
})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=10), pages=st.integers(4, 24), page_size=st.sampled_from([2, 4, 8]),
       budget=st.integers(4, 24), batch=st.integers(1, 6), buf=st.integers(1, 4))
def test_random_workloads_keep_every_invariant(reqs, pages, page_size, budget, batch, buf):
    model = ScriptedModel(script, vocab_size=32, max_context=64, eos_token_ids=[2])
    tok = ByteVocabTokenizer(VOCAB, bos_token_id=1, eos_token_id=2)
    cfg = pd.EngineConfig(page_size=page_size, max_cache_tokens=pages * page_size, max_tokens_per_step=budget,
                          max_batch_size=batch, stream_max_events=buf, seed=0)
    eng = pd.Engine(model, tok, cfg)
    rids, seen, read = {}, {}, {}
    step = 0
    while step < 400:
        for i, r in enumerate(reqs):
            if r["arrive"] == step:
                params = pd.SamplingParams(max_tokens=r["max_tokens"], stop=r["stop"], deadline_s=r["deadline"],
                                           stop_token_ids=r["stop_ids"],
                                           temperature=r["temperature"], seed=i, utf8_errors="replace")
                try:
                    rid = eng.add_request(r["prompt"], params, acked=r["acked"])
                except pd.InvalidRequestError:
                    assert len(r["prompt"]) > eng.max_context
                    continue
                rids[rid], seen[rid], read[rid] = r, [], []
            if r["cancel_at"] == step and (rid_ := next((k for k, v in rids.items() if v is r), None)):
                eng.cancel(rid_)
        events = eng.step()
        step += 1
        eng.check_integrity()
        free = [p for p, c in enumerate(eng.pool.ref_counts) if c == 0 and p not in eng.pool.page_hash]
        eng.kv.k[:, free] = float("nan")                   # whatever a free page holds never matters
        eng.kv.v[:, free] = float("nan")
        for e in events:
            seen[e.request_id].append(e)
        for rid, r in rids.items():
            if r["acked"] and r["read"]:
                read[rid] += eng.read_events(rid, r["read"])
        for rid, evs in seen.items():
            seqs = [e.seq for e in evs]
            assert seqs == sorted(set(seqs))
            terminals = [i for i, e in enumerate(evs) if isinstance(e, pd.TerminalEvent)]
            assert len(terminals) <= 1 and (not terminals or terminals[0] == len(evs) - 1)
        if step > max(r["arrive"] for r in reqs) and not eng.has_unfinished():
            break
        if step > 300:     # stalled consumers hold their requests forever: let them read now
            for rid, r in rids.items():
                r["read"] = 99
    assert not eng.has_unfinished()
    assert eng.pool.free_pages == eng.pool.num_pages and eng.slots.free_slots == batch
    for rid, r in rids.items():
        out = eng.result(rid)
        evs = seen[rid]
        assert isinstance(evs[0], pd.StartEvent) and isinstance(evs[-1], pd.TerminalEvent)
        assert evs[-1].state == out.state and out.state.terminal
        text = "".join(e.text for e in evs if isinstance(e, pd.DeltaEvent))
        assert text == out.text
        assert sum(len(e.token_ids) for e in evs if isinstance(e, pd.DeltaEvent)) == out.usage.returned_tokens
        releases = [x["resource"] for x in eng.trace(rid) if x["kind"] == "release"]
        assert sorted(releases) == sorted(["pages", "slot", "rng", "stream", "trace", "grammar"])
        if r["acked"]:
            got = read[rid] + eng.read_events(rid)
            assert got == evs                                   # the ack cursor lost and reordered nothing
        assert not any(s in out.text for s in r["stop"])        # a stop never leaks into the text
        for kind in ("preempted", "backpressure.paused", "cancel.effective", "stop.hit"):
            event(kind) if any(x["kind"] == kind for x in eng.trace(rid)) else None
        if r["deadline"] is not None:
            assert out.finish_reason in (pd.FinishReason.DEADLINE_EXCEEDED, pd.FinishReason.CANCELLED)
