"""Delivery: Engine.replay / ack / newest_event, ack-driven backpressure, and AsyncEngine.follow
(resume at every position, at and past the end, many followers all woken)."""
import asyncio
import time

import pytest

import pagedecode as pd

from .helpers import engine, run

S, R = pd.RequestState, pd.FinishReason


def slow_engine(script=(101, 102, 103), delay=0.002, **cfg):
    return engine(list(script), on_forward=lambda info: time.sleep(delay), **cfg)


async def until(cond, timeout_s=10.0):
    deadline = time.perf_counter() + timeout_s
    while not cond():
        assert time.perf_counter() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


# -- the engine: replay, newest_event, ack ---------------------------------------------------------

def test_replay_and_newest_event_from_every_position():
    eng = engine([101, 102, 103])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=4))
    (start,) = eng.replay(rid)                      # the start event, at once
    assert isinstance(start, pd.StartEvent) and eng.newest_event(rid) == (0, False)
    eng.step()
    newest, ended = eng.newest_event(rid)
    assert newest >= 0 and not ended and [e.seq for e in eng.replay(rid)] == list(range(newest + 1))
    run(eng)
    events = eng.replay(rid)
    last = events[-1].seq
    assert isinstance(events[-1], pd.TerminalEvent) and eng.newest_event(rid) == (last, True)
    assert [e.seq for e in events] == list(range(last + 1))
    for after in range(-1, last + 1):
        assert eng.replay(rid, after) == events[after + 1:]
    with pytest.raises(ValueError, match=f"after_seq {last + 1} is beyond"):
        eng.replay(rid, last + 1)
    with pytest.raises(KeyError):
        eng.newest_event("never-existed")


def test_unacked_events_pause_only_that_request_and_an_ack_resumes_it():
    eng = engine([101], stream_max_events=3)
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=12), acked=True)
    other = eng.add_request([5], pd.SamplingParams(max_tokens=12))          # not acked: never held
    for _ in range(20):
        eng.step()
    req = eng.requests.get(rid)
    newest, ended = eng.newest_event(rid)
    assert req.delivery.paused_since is not None and not ended and newest == 2       # seqs 0..2 unacked: full
    assert eng.result(other).state == S.FINISHED
    assert any(r["kind"] == "backpressure.paused" for r in eng.trace(rid))
    eng.ack(rid, 0)                                   # one event sent: room for one more
    eng.step()
    eng.step()
    assert eng.newest_event(rid) == (3, False) and req.delivery.paused_since is not None
    eng.ack(rid, -1)                                  # an older ack changes nothing
    eng.ack(other, 100)                               # nor does an ack of a request that is not acked
    for _ in range(200):
        newest, ended = eng.newest_event(rid)
        if ended:
            break
        eng.ack(rid, newest)
        eng.step()
    out = eng.result(rid)
    assert out.state == S.FINISHED and out.text == "AB" * 12
    assert any(r["kind"] == "backpressure.resumed" for r in eng.trace(rid))
    assert [e.seq for e in eng.replay(rid)] == list(range(newest + 1))      # nothing lost while paused


def test_an_ack_past_the_newest_event_does_not_lift_backpressure_for_good():
    """A consumer cannot have taken an event that does not exist: an ack past the newest counts
    up to the newest. (It set the cursor there, so the request ran unheld for that many events.)"""
    eng = engine([101], stream_max_events=3)
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=40), acked=True)
    eng.ack(rid, 1000)
    for _ in range(20):
        eng.step()
    newest, ended = eng.newest_event(rid)
    assert eng.requests.get(rid).delivery.paused_since is not None and not ended and newest == 3


def test_unacked_text_bytes_pause_an_acked_request_too():
    """stream_max_bytes bounds what a consumer has not acked (it bounded only the stream=True
    buffer: a request read by acks ran on with any amount of unacked text)."""
    eng = engine([120], stream_max_events=1000, stream_max_bytes=20)      # " café": 6 bytes a token
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=40), acked=True)
    for _ in range(20):
        eng.step()
    got = eng.read_events(rid)
    text = "".join(e.text for e in got if isinstance(e, pd.DeltaEvent))
    assert eng.requests.get(rid).delivery.paused_since is not None and 20 <= len(text.encode()) < 20 + 12
    for _ in range(200):
        got += eng.read_events(rid)
        if isinstance(got[-1], pd.TerminalEvent):
            break
        eng.step()
    assert eng.result(rid).text == " café" * 40 and [e.seq for e in got] == list(range(len(got)))
    assert eng.result(rid).timings.send_s > 0                # events waited for their consumer


def test_read_events_needs_an_ack_cursor():
    eng = engine([101])
    rid = eng.add_request([5], pd.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="acked=True"):
        eng.read_events(rid)


# -- AsyncEngine.submit and follow -----------------------------------------------------------------------------

def test_follow_a_finished_request_from_every_position():
    async def main():
        eng = slow_engine(delay=0)
        async with pd.AsyncEngine(eng) as ae:
            rid = eng.add_request([5], pd.SamplingParams(max_tokens=5))
            events = await asyncio.wait_for(_collect(ae.follow(rid)), 5)
            resumed = [await asyncio.wait_for(_collect(ae.follow(rid, after)), 5)
                       for after in range(-1, events[-1].seq + 1)]
            for past in (events[-1].seq + 1, events[-1].seq + 50):
                with pytest.raises(ValueError, match="beyond"):
                    await _collect(ae.follow(rid, past))
            with pytest.raises(KeyError):
                await _collect(ae.follow("never-existed"))
        return events, resumed
    events, resumed = asyncio.run(main())
    assert isinstance(events[-1], pd.TerminalEvent) and [e.seq for e in events] == list(range(len(events)))
    assert resumed == [events[after + 1:] for after in range(-1, len(events))]
    assert resumed[-1] == []                                   # at the end: nothing, and no wait


def test_follow_with_acks_drives_backpressure():
    """A follower that stops acking pauses its request (the step loop serves on); acking again
    resumes it, and the follower gets every event once."""
    async def main():
        eng = engine([101], stream_max_events=4)
        async with pd.AsyncEngine(eng, idle_wait_s=0.01) as ae:
            rid = eng.add_request([5], pd.SamplingParams(max_tokens=30), acked=True)
            req = eng.requests.get(rid)
            got = []
            follower = ae.follow(rid)
            async for ev in follower:
                got.append(ev)
                if len(got) == 4:
                    break
            await follower.aclose()
            await until(lambda: req.delivery.paused_since is not None)
            await asyncio.sleep(0.05)
            assert eng.newest_event(rid) == (3, False)         # held: no event past the unacked four
            eng.ack(rid, got[-1].seq)
            async for ev in ae.follow(rid, got[-1].seq):
                got.append(ev)
                eng.ack(rid, ev.seq)
        return eng, rid, got
    eng, rid, got = asyncio.run(main())
    assert [e.seq for e in got] == list(range(len(got))) and isinstance(got[-1], pd.TerminalEvent)
    assert eng.result(rid).text == "AB" * 30
    kinds = [r["kind"] for r in eng.trace(rid)]
    assert "backpressure.paused" in kinds and "backpressure.resumed" in kinds


def test_many_followers_of_one_request_each_get_every_event():
    async def main():
        eng = slow_engine(delay=0.001)
        # a lost wake-up leaves its follower waiting for good (bounded below by wait_for); a loaded
        # machine delays a woken one by far less than the 1 s threshold
        async with pd.AsyncEngine(eng, stream_interval_s=0) as ae:
            rid = eng.add_request([5], pd.SamplingParams(max_tokens=40))
            got = await asyncio.wait_for(asyncio.gather(*(_collect(ae.follow(rid)) for _ in range(30))), 20)
            late = await asyncio.wait_for(_collect(ae.follow(rid, 10)), 5)
        return eng, rid, got, late
    eng, rid, got, late = asyncio.run(main())
    history = eng.replay(rid)
    assert isinstance(history[-1], pd.TerminalEvent)
    assert all(g == history for g in got) and late == history[11:]
    assert not eng.requests.live


def test_every_follower_is_woken_for_its_events():
    """Two followers of each request, one slow: each must get the terminal event when it is
    emitted (a shared asyncio.Event that each cleared lost ~1 wake-up in 40: 0.2 s late)."""
    trials, at_once = 1000, 25

    async def follower(ae, rid, delay):
        async for ev in ae.follow(rid):
            if delay:
                await asyncio.sleep(delay)
            if isinstance(ev, pd.TerminalEvent):
                return time.perf_counter_ns() / 1000.0

    async def main():
        eng = engine([101, 102, 103], on_forward=lambda info: time.sleep(0.0005), trace="lifecycle")
        late = []
        # a lost wake-up leaves its follower waiting for good (bounded below by wait_for); a loaded
        # machine delays a woken one by far less than the 1 s threshold
        async with pd.AsyncEngine(eng, stream_interval_s=0) as ae:
            for _ in range(trials // at_once):
                rids = [eng.add_request([5], pd.SamplingParams(max_tokens=3)) for _ in range(at_once)]
                got = await asyncio.wait_for(
                    asyncio.gather(*(follower(ae, r, d) for r in rids for d in (0, 0.002))), 60)
                for rid, (fast, slow) in zip(rids, zip(got[::2], got[1::2])):
                    finish = next(r["t_us"] for r in eng.trace(rid) if r["kind"] == "finish")
                    late += [t - finish for t in (fast, slow) if t - finish > 1_000_000]
        return late
    assert asyncio.run(main()) == []


def test_follow_at_or_past_the_end():
    async def main():
        eng = slow_engine()
        async with pd.AsyncEngine(eng) as ae:
            rid = eng.add_request([5], pd.SamplingParams(max_tokens=3))
            events = [e async for e in ae.follow(rid)]
            last = events[-1].seq
            at_end = await asyncio.wait_for(_collect(ae.follow(rid, last)), 5)
            middle = await asyncio.wait_for(_collect(ae.follow(rid, 1)), 5)
            with pytest.raises(ValueError, match=f"after_seq {last + 1}"):
                await asyncio.wait_for(_collect(ae.follow(rid, last + 1)), 5)
            live = eng.add_request([5], pd.SamplingParams(max_tokens=10_000))
            with pytest.raises(ValueError, match="beyond"):
                await asyncio.wait_for(_collect(ae.follow(live, 10**6)), 5)
        return events, at_end, middle
    events, at_end, middle = asyncio.run(main())
    assert at_end == [] and middle == events[2:]
    assert isinstance(events[-1], pd.TerminalEvent)


def test_a_stream_read_late_gets_every_event_past_the_finished_budget():
    """submit's stream reads the history: its request stays readable (pinned) until the stream
    has taken its terminal event, however many requests finish meanwhile."""
    async def main():
        eng = slow_engine(delay=0, max_finished_kept=1)
        async with pd.AsyncEngine(eng) as ae:
            late = ae.submit([5], pd.SamplingParams(max_tokens=5))
            for _ in range(5):
                await asyncio.wait_for(_collect(ae.submit([5], pd.SamplingParams(max_tokens=2))), 10)
            await until(lambda: eng.result(late.request_id).state.terminal)
            events = await asyncio.wait_for(_collect(late), 10)
            unpinned = eng.add_request([5], pd.SamplingParams(max_tokens=1))
            await asyncio.wait_for(_collect(ae.follow(unpinned)), 10)
            with pytest.raises(KeyError):                   # read: no longer held past the budget
                eng.result(late.request_id)
        return events
    events = asyncio.run(main())
    assert [e.seq for e in events] == list(range(len(events))) and isinstance(events[-1], pd.TerminalEvent)
    assert "".join(e.text for e in events if isinstance(e, pd.DeltaEvent)) == "ABCDEFEFEF"


async def _collect(aiter):
    return [e async for e in aiter]
