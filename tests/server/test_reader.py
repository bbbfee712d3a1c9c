"""The Reader (server/reader.py) owns what one HTTP exchange holds of its requests: whichever way
the exchange ends (the request's end, the client gone, the handler's task cancelled, the server's
drain), the client count goes back, the pin is released, the disconnect policy runs only for a
request that had not ended, and the request is metered exactly once."""
import asyncio

import pytest

import pagedecode as pd
from pagedecode.runtime.output.events import DeltaEvent, TerminalEvent

BODY = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}


async def read_all(reader, track, per_event_s=0.0, first=None):
    async with reader:
        async for ev in reader.events(track):
            if isinstance(ev, DeltaEvent) and first is not None:
                first.set()
            await asyncio.sleep(per_event_s)


async def to_end(reader, track):
    await read_all(reader, track)


async def client_gone(reader, track):
    async with reader:
        async for ev in reader.events(track):
            if isinstance(ev, DeltaEvent):
                break                             # the client went away after its first chunk


async def cancelled(reader, track):
    first = asyncio.Event()
    task = asyncio.ensure_future(read_all(reader, track, 0.02, first))
    await first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def drained(reader, track):
    from pagedecode.server.serve import drain
    first = asyncio.Event()
    task = asyncio.ensure_future(read_all(reader, track, 0.02, first))
    await first.wait()
    await drain(reader.state.async_engine, reader.state, grace_s=0.0)
    await task


@pytest.mark.parametrize("scenario, disconnects, state", [
    (to_end, 0, "finished"), (client_gone, 1, "cancelled"), (cancelled, 1, "cancelled"), (drained, 0, "cancelled")])
def test_every_way_out_releases_once_and_meters_once(stories_path, monkeypatch, scenario, disconnects, state):
    from pagedecode.server import reader as reader_module
    from pagedecode.server.admission import Parsing, start
    from pagedecode.server.completions import COMPLETIONS
    from pagedecode.server.protocol import Limits, parse_request
    from pagedecode.server.state import ServerOptions, ServerState
    metered = []
    observe = reader_module.observe
    monkeypatch.setattr(reader_module, "observe", lambda m, track, out: (metered.append(track.request_id),
                                                                         observe(m, track, out)))

    async def main():
        engine = pd.Engine.from_pretrained(stories_path, model_name="m", max_batch_size=4)
        async with pd.AsyncEngine(engine) as ae:
            server = ServerState(ae, None, ServerOptions(model_name="m"))
            parsing = Parsing(parse_request(BODY, False, {}, Limits(), 1))
            [track] = start(server, [BODY["prompt"]], parsing, COMPLETIONS, "tenant")
            await scenario(reader_module.Reader(server, [track]), track)
            while engine.has_unfinished():
                await asyncio.sleep(0.01)
            for _ in range(20):                   # a watcher meters on its next turn
                await asyncio.sleep(0.01)
            return track, engine.result(track.request_id), dict(engine.requests._pins)
    track, out, pins = asyncio.run(main())
    assert out.state.value == state
    assert track.attached == 0 and track.request_id not in pins
    assert track.disconnects == disconnects
    assert metered == [track.request_id] and track.metered
