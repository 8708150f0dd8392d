"""The retrieve_futures feeds: cursors, long polls, bounds."""

from __future__ import annotations

import asyncio

from opentinker.server.tinker.completions import CompletionFeeds


def test_a_poll_answers_what_came_after_its_cursor_and_waits_when_there_is_nothing():
    async def scenario():
        feeds = CompletionFeeds()
        feeds.add(1, "s", 0, "r1", failed=False, payload_size=10)
        feeds.add(1, "s", 0, "r2", failed=True)
        got, cursor = await feeds.poll(1, "s", 0, 0, 0)
        assert [c["request_id"] for c in got] == ["r1", "r2"] and cursor == 2
        assert got[0] == {"state": "finished", "request_id": "r1", "response_payload_uncompressed_size": 10}
        assert got[1] == {"state": "failed", "request_id": "r2"}
        assert await feeds.poll(1, "s", 0, cursor, 0) == ([], 2)  # seen: dropped
        # Another user's, or another clone's, feed is its own.
        assert await feeds.poll(2, "s", 0, 0, 0) == ([], 0)
        assert await feeds.poll(1, "s", 1, 0, 0) == ([], 0)
        # A long poll returns as soon as a completion comes.
        waiting = asyncio.ensure_future(feeds.poll(1, "s", 0, cursor, 30))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        feeds.add(1, "s", 0, "r3", failed=False, payload_size=5)
        got, cursor = await asyncio.wait_for(waiting, 5)
        assert [c["request_id"] for c in got] == ["r3"] and cursor == 3

    asyncio.run(scenario())


def test_feeds_are_bounded_and_idle_ones_are_forgotten():
    now = [0.0]

    async def scenario():
        feeds = CompletionFeeds(max_events=3, max_feeds=2, clock=lambda: now[0])
        for i in range(5):
            feeds.add(1, "s", 0, f"r{i}", failed=False)
        got, cursor = await feeds.poll(1, "s", 0, 0, 0)
        assert [c["request_id"] for c in got] == ["r2", "r3", "r4"] and cursor == 5
        feeds.add(1, "t", 0, "x", failed=False)
        feeds.add(1, "u", 0, "y", failed=False)  # a third feed: the least recently used one goes
        assert await feeds.poll(1, "s", 0, 0, 0) == ([], 0)
        now[0] = 100.0
        feeds.add(1, "v", 0, "z", failed=False)
        feeds.forget_idle(50.0)
        assert await feeds.poll(1, "u", 0, 0, 0) == ([], 0)
        assert [c["request_id"] for c in (await feeds.poll(1, "v", 0, 0, 0))[0]] == ["z"]

    asyncio.run(scenario())
