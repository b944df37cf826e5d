"""The core directory (serve_app/core_directory.py): watchers hear every change at once, and an
address its replica stopped publishing (a killed replica) drops out."""
from __future__ import annotations

import asyncio

from pagedserve.serve_app.core_directory import ENTRY_TTL_S, CoreDirectory


def test_watchers_hear_publications_and_withdrawals_at_once():
    async def main():
        directory = CoreDirectory(warmup_s=0.0)
        version, entries, _ = await directory.watch(-1, timeout_s=0.1)
        assert entries == {}
        waiting = asyncio.ensure_future(directory.watch(version, timeout_s=30))
        await asyncio.sleep(0.01)
        await directory.publish("r1", ["127.0.0.1", 5000, "t"])
        version, entries, _ = await asyncio.wait_for(waiting, 1)
        assert entries == {"r1": ["127.0.0.1", 5000, "t"]}
        await directory.publish("r1", ["127.0.0.1", 5000, "t"])  # again, unchanged: no news
        assert (await directory.watch(version, timeout_s=0.05))[0] == version
        waiting = asyncio.ensure_future(directory.watch(version, timeout_s=30))
        await asyncio.sleep(0.01)
        await directory.withdraw("r1")
        assert (await asyncio.wait_for(waiting, 1))[1] == {}

    asyncio.run(main())


def test_adapters_are_listed_with_ids_given_once():
    async def main():
        directory = CoreDirectory(warmup_s=0.0)
        version, _, adapters = await directory.watch(-1, timeout_s=0.05)
        assert adapters == {}
        waiting = asyncio.ensure_future(directory.watch(version, timeout_s=30))
        await asyncio.sleep(0.01)
        first, created = await directory.register_adapter("a", "/x")
        version, _, adapters = await asyncio.wait_for(waiting, 1)  # watchers hear it at once
        assert created and adapters == {"a": first} and first[:1] == ["a"] and first[2] == "/x"
        assert await directory.register_adapter("a", "/x") == (first, False)  # the same id
        assert await directory.register_adapter("a", "/y") == (None, False)  # name taken
        second, _ = await directory.register_adapter("b", "/y")
        assert second[1] > first[1]
        assert await directory.remove_adapter("a") == first
        assert await directory.remove_adapter("a") is None
        again, _ = await directory.register_adapter("a", "/x")
        assert again[1] > second[1]  # a new id: its KV blocks are not the old ones'
        later = CoreDirectory(warmup_s=0.0)  # a restarted directory never repeats an id
        assert (await later.register_adapter("c", "/z"))[0][1] > again[1]

    asyncio.run(main())


def test_a_new_directory_answers_once_every_replica_had_its_turn_to_publish():
    async def main():
        directory = CoreDirectory(warmup_s=0.2)
        await directory.publish("r1", ["h", 1, "t"])
        waiting = asyncio.ensure_future(directory.watch(-1, timeout_s=0))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # an ingress that read an empty listing now would drop r2
        await directory.publish("r2", ["h", 2, "t"])
        assert set((await waiting)[1]) == {"r1", "r2"}

    asyncio.run(main())


def test_an_address_not_published_again_expires():
    async def main():
        now = [0.0]
        directory = CoreDirectory(clock=lambda: now[0])
        await directory.publish("gone", ["h", 1, "t"])
        now[0] = ENTRY_TTL_S - 1
        await directory.publish("alive", ["h", 2, "t"])
        now[0] = ENTRY_TTL_S + 1
        await directory.publish("alive", ["h", 2, "t"])
        assert set(directory.entries) == {"alive"}

    asyncio.run(main())
