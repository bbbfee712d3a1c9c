"""AsyncEngine: streams over one event loop, cancel, disconnect, shutdown."""
import asyncio
import gc
import time

import pytest

import pagedecode as pd

from .helpers import engine

S, R = pd.RequestState, pd.FinishReason


def slow_engine(script=(101, 102, 103), delay=0.002, **cfg):
    return engine(list(script), on_forward=lambda info: time.sleep(delay), **cfg)


async def until_terminal(eng, rid, timeout_s=5.0):
    deadline = time.perf_counter() + timeout_s
    while not eng.result(rid).state.terminal and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)


def test_streams_deliver_the_ordered_events():
    async def main():
        eng = slow_engine()
        async with pd.AsyncEngine(eng) as ae:
            stream = ae.submit([5], pd.SamplingParams(max_tokens=6, stop="DEF"))
            events = [e async for e in stream]
        return eng, stream, events
    eng, stream, events = asyncio.run(main())
    assert isinstance(events[0], pd.StartEvent) and isinstance(events[-1], pd.TerminalEvent)
    assert [e.seq for e in events] == list(range(len(events)))
    assert "".join(e.text for e in events if isinstance(e, pd.DeltaEvent)) == "ABC"
    assert events[-1].finish_reason == R.STOP_SEQUENCE and eng.result(stream.request_id).text == "ABC"


def test_many_streams_do_not_block_the_loop():
    async def main():
        eng = slow_engine(delay=0.005, max_batch_size=8, stream_max_events=4)
        gaps = []

        async def heartbeat(stop):
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async def consume(stream):
            out = []
            async for e in stream:
                out.append(e)
                await asyncio.sleep(0.001)        # a slowish reader
            return out

        async with pd.AsyncEngine(eng) as ae:
            stop = asyncio.Event()
            beat = asyncio.create_task(heartbeat(stop))
            streams = [ae.submit([5 + i % 2], pd.SamplingParams(max_tokens=12)) for i in range(24)]
            results = await asyncio.gather(*(consume(s) for s in streams))
            stop.set()
            await beat
        return eng, results, gaps
    eng, results, gaps = asyncio.run(main())
    assert all(isinstance(r[-1], pd.TerminalEvent) and r[-1].state == S.FINISHED for r in results)
    assert all("".join(e.text for e in r if isinstance(e, pd.DeltaEvent)) == "ABCD" + "EF" * 10 for r in results)
    assert max(gaps) < 0.25                     # the loop kept ticking while steps ran elsewhere
    assert eng.pool.free_pages == eng.pool.num_pages


def test_user_cancel_and_invalid_submit():
    async def main():
        eng = slow_engine()
        async with pd.AsyncEngine(eng) as ae:
            with pytest.raises(pd.InvalidRequestError):
                ae.submit([], pd.SamplingParams())
            stream = ae.submit([5], pd.SamplingParams(max_tokens=10_000))
            got = []
            async for e in stream:
                got.append(e)
                if len(got) == 3:
                    assert await stream.cancel()
        return eng, stream, got
    eng, stream, got = asyncio.run(main())
    assert got[-1].state == S.CANCELLED and got[-1].finish_reason == R.CANCELLED
    assert len(eng.result(stream.request_id).selected_token_ids) < 100


@pytest.mark.parametrize("how", ["aclose", "drop"])
def test_disconnect_cancels_as_transport_error(how):
    async def main():
        eng = slow_engine()
        async with pd.AsyncEngine(eng) as ae:
            stream = ae.submit([5], pd.SamplingParams(max_tokens=10_000))
            rid = stream.request_id
            async for e in stream:
                if isinstance(e, pd.DeltaEvent):
                    break
            if how == "aclose":
                await stream.aclose()
            else:
                del stream
                gc.collect()
            await until_terminal(eng, rid)
        return eng, rid
    eng, rid = asyncio.run(main())
    out = eng.result(rid)
    assert out.state == S.CANCELLED and out.finish_reason == R.TRANSPORT_ERROR
    assert eng.pool.free_pages == eng.pool.num_pages


def test_disconnect_with_continue_runs_to_the_end():
    async def main():
        eng = slow_engine(stream_max_events=2)
        async with pd.AsyncEngine(eng, on_disconnect="continue") as ae:
            stream = ae.submit([5], pd.SamplingParams(max_tokens=30))
            rid = stream.request_id
            await stream.__anext__()
            await stream.aclose()
            await until_terminal(eng, rid)
        return eng, rid
    eng, rid = asyncio.run(main())
    assert eng.result(rid).state == S.FINISHED and len(eng.result(rid).selected_token_ids) == 30


def test_shutdown_ends_every_live_request_exactly_once():
    async def main():
        eng = slow_engine()
        ae = pd.AsyncEngine(eng)
        async with ae:
            streams = [ae.submit([5], pd.SamplingParams(max_tokens=10_000)) for _ in range(5)]
            await asyncio.sleep(0.05)
        return eng, streams
    eng, streams = asyncio.run(main())
    for s in streams:
        history = eng.replay(s.request_id)
        assert sum(isinstance(e, pd.TerminalEvent) for e in history) == 1
        assert eng.result(s.request_id).state == S.CANCELLED
    assert not eng.has_unfinished() and eng.pool.free_pages == eng.pool.num_pages


@pytest.mark.parametrize("where", ["in_anext", "in_body"])
def test_cancelling_the_reading_task_ends_the_request_at_once(where):
    """The cancelled task keeps its traceback (and the stream in it) until it is collected: the
    request must not wait for that. gc is off and the task stays referenced throughout."""
    async def main():
        eng = slow_engine(stream_max_events=2)
        async with pd.AsyncEngine(eng) as ae:
            stream = ae.submit([5], pd.SamplingParams(max_tokens=10_000))
            rid, got = stream.request_id, []

            async def read(stream):
                async for e in stream:
                    got.append(e)
                    if where == "in_body":
                        await asyncio.Event().wait()     # held in the loop's body until cancelled
            task = asyncio.create_task(read(stream))
            del stream
            for _ in range(1000):
                if len(got) >= (2 if where == "in_anext" else 1) or task.done():
                    break
                await asyncio.sleep(0.005)
            if where == "in_anext":
                await asyncio.sleep(0.05)          # the buffer fills: the reader waits in __anext__
            task.cancel()
            await asyncio.wait([task])
            at_cancel = eng.steps
            await until_terminal(eng, rid)
            steps = eng.steps - at_cancel
            eng.check_integrity()
            return eng, rid, task, steps
    gc.disable()
    try:
        eng, rid, task, steps = asyncio.run(main())
    finally:
        gc.enable()
    assert task.cancelled()
    out = eng.result(rid)
    assert out.state == S.CANCELLED and out.finish_reason == R.TRANSPORT_ERROR
    assert steps <= 1                                    # ended at the safe point of the step in flight
    assert eng.pool.free_pages == eng.pool.num_pages and eng.slots.free_slots == eng.slots.num_slots


def test_stream_as_async_context_manager():
    async def main():
        eng = slow_engine()
        async with pd.AsyncEngine(eng) as ae:
            async with ae.submit([5], pd.SamplingParams(max_tokens=10_000)) as stream:
                rid = stream.request_id
                async for e in stream:
                    if isinstance(e, pd.DeltaEvent):
                        break
            await until_terminal(eng, rid)
            async with ae.submit([5], pd.SamplingParams(max_tokens=3)) as whole:
                events = [e async for e in whole]
        return eng, rid, events
    eng, rid, events = asyncio.run(main())
    assert eng.result(rid).finish_reason == R.TRANSPORT_ERROR        # left early: a disconnect
    assert events[-1].state == S.FINISHED                             # read to the end: untouched
