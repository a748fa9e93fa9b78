"""The syncer's change waiters (services/syncer/publishing.py Watchers), which WatchFragments polls.

A WatchFragments call ended (cancelled) while its stream waited for a change raised
"RuntimeError: Lock is not acquired" out of the servicer: the waiters were an asyncio.Condition
under asyncio.wait_for, and on CPython 3.11 a cancellation that lands while wait_for is cancelling
the timed-out Condition.wait leaves `async with` releasing a lock the wait had not re-acquired.
"""

from __future__ import annotations

import asyncio

from services.syncer import publishing


async def _race(watchers_count: int, notify_tick: int, cancel_ticks: tuple[int, int]) -> list[BaseException]:
    """`watchers_count` streams wait; a change comes at `notify_tick` (waking all of them, who each
    take the condition's lock in turn), and the last stream is cancelled at both `cancel_ticks` (its
    call ends while wait_for is still cancelling the inner wait). What ended the streams, other
    than a cancellation or a counter."""
    watchers = publishing.Watchers()
    waiters = [asyncio.ensure_future(watchers.wait_for_change(0, 10.0)) for _ in range(watchers_count)]
    for tick in range(max(notify_tick, *cancel_ticks) + 1):
        if tick == notify_tick:
            watchers.notify()
        if tick in cancel_ticks:
            waiters[-1].cancel()
        await asyncio.sleep(0)
    endings = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5.0)
    return [e for e in endings if isinstance(e, BaseException) and not isinstance(e, asyncio.CancelledError)]


def test_a_watch_stream_cancelled_while_waiting_ends_without_a_lock_error():
    # Fails before the fix (12 of these timings raise RuntimeError('Lock is not acquired.'), e.g.
    # two streams, the change at tick 3, the cancellations at ticks 3 and 5).
    async def scenario() -> list:
        errors = []
        for watchers_count in (1, 2, 4):
            for notify_tick in range(6):
                for first in range(8):
                    for second in range(first, 10):
                        errors += await _race(watchers_count, notify_tick, (first, second))
        return errors

    assert asyncio.run(scenario()) == []


def test_a_change_wakes_every_waiter_and_a_timeout_returns_the_same_counter():
    async def scenario() -> tuple:
        watchers = publishing.Watchers()
        waiters = [asyncio.ensure_future(watchers.wait_for_change(0, 10.0)) for _ in range(3)]
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        watchers.notify()
        woken = await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
        woke_after_s = loop.time() - started
        timed_out = await watchers.wait_for_change(watchers.counter, 0.01)
        already = await watchers.wait_for_change(0, 10.0)  # changed since 0: no wait at all
        return woken, woke_after_s, timed_out, already

    woken, woke_after_s, timed_out, already = asyncio.run(scenario())
    assert woken == [1, 1, 1]
    assert woke_after_s < 5.0
    assert (timed_out, already) == (1, 1)


def test_waiters_of_two_event_loops_do_not_collide():
    # A syncer core outlives an event loop in tests (asyncio.run per scenario): each waiter's
    # future belongs to its own loop and leaves with it.
    watchers = publishing.Watchers()
    assert asyncio.run(watchers.wait_for_change(0, 0.01)) == 0
    assert asyncio.run(watchers.wait_for_change(0, 0.01)) == 0
    watchers.notify()
    assert asyncio.run(watchers.wait_for_change(0, 0.01)) == 1
