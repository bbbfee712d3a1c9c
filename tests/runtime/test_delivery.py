"""Delivery: Engine.replay / ack / newest_event, ack-driven backpressure, and AsyncEngine.follow
(resume at every position, at and past the end, many followers all woken)."""
import asyncio
import time

import pytest

import pagedecode as pd

from .helpers import engine

S, R = pd.RequestState, pd.FinishReason


def slow_engine(script=(101, 102, 103), delay=0.002, **cfg):
    return engine(list(script), on_forward=lambda info: time.sleep(delay), **cfg)


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
        async with pd.AsyncEngine(eng, stream_interval_s=0) as ae:
            for _ in range(trials // at_once):
                rids = [eng.add_request([5], pd.SamplingParams(max_tokens=3)) for _ in range(at_once)]
                got = await asyncio.gather(*(follower(ae, r, d) for r in rids for d in (0, 0.002)))
                for rid, (fast, slow) in zip(rids, zip(got[::2], got[1::2])):
                    finish = next(r["t_us"] for r in eng.trace(rid) if r["kind"] == "finish")
                    late += [t - finish for t in (fast, slow) if t - finish > 150_000]
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


async def _collect(aiter):
    return [e async for e in aiter]
