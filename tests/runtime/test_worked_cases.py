"""The two worked cases of docs/design.md ("Worked cases"), exactly."""
import pagedecode as pd

from .helpers import check_stream, engine, of, run


def test_stop_string_across_tokens():
    """101 -> "AB", 102 -> "CD", stop "BCD": after 101 only "A" is sent, "B" held; after 102 the
    buffer "BCD" hits; the text is exactly "A"; no further token is selected."""
    eng = engine([101, 102, 103, 103])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=10, stop=["BCD"]))
    events = run(eng)
    evs = check_stream(events, rid)
    deltas = of(events, rid, pd.DeltaEvent)
    assert [d.text for d in deltas] == ["A"]
    assert deltas[0].token_ids == (101,)
    out = eng.result(rid)
    assert out.text == "A" and out.state == pd.RequestState.FINISHED
    assert out.finish_reason == pd.FinishReason.STOP_SEQUENCE and out.stop_reason == "BCD"
    assert out.stop_rule_version == 1
    assert out.selected_token_ids == [101, 102]
    assert evs[-1].finish_reason == pd.FinishReason.STOP_SEQUENCE
    kinds = [(r["kind"], r.get("t")) for r in eng.trace(rid)
             if r["kind"] in ("token.selected", "delta", "decode.completed", "stop.hit", "finish")]
    assert kinds == [("token.selected", 1), ("delta", None), ("decode.completed", 1), ("token.selected", 2),
                     ("stop.hit", None), ("finish", None)]
    u = out.usage
    assert (u.prompt_tokens, u.selected_tokens, u.returned_tokens, u.returned_bytes) == (1, 2, 1, 1)
    assert u.processed_tokens == 2           # the prompt, then 101; 102 was never written


def test_cancel_inside_decode_step_3():
    eng = None
    rid = None

    def on_forward(info):
        batch = info["batch"]
        for s, r in enumerate(batch.request_ids):
            if r == rid and s < batch.num_decode and len(batch.output_ids[s]) == 3:
                assert eng.cancel(rid)            # from inside the running step

    eng = engine([101, 102, 103, 101, 102, 103], on_forward=on_forward)
    rid = eng.add_request([5, 6], pd.SamplingParams(max_tokens=10))
    free_before = eng.pool.free_pages
    events = run(eng)
    evs = check_stream(events, rid)
    trace = eng.trace(rid)
    selected = [r["t"] for r in trace if r["kind"] == "token.selected"]
    assert selected == [1, 2, 3]                           # no token.selected(4)
    assert [r["t"] for r in trace if r["kind"] == "decode.started"] == [1, 2, 3]
    out = eng.result(rid)
    assert out.state == pd.RequestState.CANCELLED and out.finish_reason == pd.FinishReason.CANCELLED
    assert out.text == "ABCDEF"                            # the prefix already sent stays as sent
    assert "".join(e.text for e in of(events, rid, pd.DeltaEvent)) == "ABCDEF"
    assert isinstance(evs[-1], pd.TerminalEvent)           # nothing after the terminal event
    released = [r["resource"] for r in trace if r["kind"] == "release"]
    assert sorted(released) == sorted(["pages", "slot", "rng", "stream", "trace", "grammar"])
    assert eng.pool.free_pages == free_before and eng.slots.free_slots == eng.slots.num_slots
    states = [r["new"] for r in trace if r["kind"] == "state"]
    assert states[-2:] == ["cancel_requested", "cancelled"]
    moments = [r["kind"] for r in trace if r["kind"].startswith("cancel.")]
    assert moments == ["cancel.requested", "cancel.observed", "cancel.effective"]
    assert eng.cancel(rid) is False
