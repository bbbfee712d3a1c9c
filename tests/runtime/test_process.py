"""runtime/process.py: what an engine changes for the whole process (torch's threads, the frozen
heap, glibc's malloc) is applied by its ProcessEffects and put back when the engine closes,
where it can be."""
import asyncio
import gc

import pytest
import torch

import pagedecode as pd
from pagedecode.runtime import process
from pagedecode.runtime.process import ProcessEffects

from .helpers import engine as scripted_engine


@pytest.fixture
def threads_and_heap():
    """The test's starting point (a thread count the engine will change, nothing frozen), and
    torch's count put back whatever happens."""
    before = torch.get_num_threads()
    gc.unfreeze()
    torch.set_num_threads(2)
    yield
    gc.unfreeze()
    torch.set_num_threads(before)


def test_creating_and_closing_an_engine_puts_back_the_threads_and_the_heap(threads_and_heap):
    eng = scripted_engine([5, 6], num_threads=1)
    assert torch.get_num_threads() == 1
    assert eng.process.freeze_heap() > 0 and gc.get_freeze_count() > 0     # as `pagedecode serve` does
    eng.generate([[5, 6]], pd.SamplingParams(max_tokens=3))
    eng.close()
    assert torch.get_num_threads() == 2 and gc.get_freeze_count() == 0
    eng.close()                                             # idempotent: nothing set twice
    assert torch.get_num_threads() == 2 and gc.get_freeze_count() == 0


def test_a_heap_frozen_before_the_engine_stays_frozen(threads_and_heap):
    """gc has one frozen generation: an engine that did not freeze it first does not thaw it."""
    pd.freeze_heap()
    frozen = gc.get_freeze_count()
    eng = scripted_engine([5], num_threads=1)
    eng.process.freeze_heap()
    eng.close()
    assert gc.get_freeze_count() >= frozen > 0


def test_the_async_engine_lends_a_thread_through_the_same_owner(threads_and_heap):
    """The AsyncEngine lends one of the engine's threads to its event loop while it runs (through
    the same owner); its shutdown gives it back, and the engine's close the count from before."""
    eng = scripted_engine([5, 6], num_threads=2)

    async def run():
        async with pd.AsyncEngine(eng, leave_core_for_loop=True) as ae:
            assert torch.get_num_threads() == 1
            events = [e async for e in ae.submit([5], pd.SamplingParams(max_tokens=2))]
            assert isinstance(events[-1], pd.TerminalEvent)
        assert torch.get_num_threads() == 2
    asyncio.run(run())
    torch.set_num_threads(3)            # the engine puts back what was there before it, not what is now
    eng.close()
    assert torch.get_num_threads() == 2


def test_the_async_engine_keeps_every_thread_by_default(threads_and_heap):
    """By default the forward keeps all its threads under an AsyncEngine (the server's): giving one
    to the event loop cost SmolLM2's streams a quarter of their speed on 2 cores."""
    eng = scripted_engine([5, 6], num_threads=2)

    async def run():
        async with pd.AsyncEngine(eng) as ae:
            events = [e async for e in ae.submit([5], pd.SamplingParams(max_tokens=2))]
            assert isinstance(events[-1], pd.TerminalEvent)
            assert torch.get_num_threads() == 2
    asyncio.run(run())
    eng.close()


def test_the_malloc_setting_is_the_owners_and_is_never_undone(monkeypatch):
    calls = []
    monkeypatch.setattr(process.cpu_forward, "keep_freed_memory", lambda: calls.append(1) or True)
    effects = ProcessEffects()
    assert effects.keep_freed_memory() is True and calls == [1]
    effects.restore()
    assert calls == [1]
