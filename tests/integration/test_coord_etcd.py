"""ddiloco.coord against a real etcd (tests/etcd.py): election, the epoch, fenced commits.

Time-dependent cases use the shortest lease etcd grants (its minimum TTL, ~2 s) and real time.
"""

from __future__ import annotations

import asyncio

import pytest

from ddiloco.checkpoint_commit import CommitFenced, CommitRecord
from ddiloco.coord import commit as commit_lib
from ddiloco.coord import election as election_lib
from ddiloco.coord import etcd as etcd_lib
from tests import ports


def _run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def test_parse_endpoints_refuses_what_is_not_host_port():
    assert etcd_lib.parse_endpoints("a:1, b:2") == ["a:1", "b:2"]
    for bad in ("", "a", "a:", ":1", "a:x", "a:70000"):
        with pytest.raises(ValueError):
            etcd_lib.parse_endpoints(bad)


def test_one_leader_and_a_deposed_leader_cannot_commit(etcd_server):
    async def scenario():
        client = etcd_lib.Etcd([etcd_server.endpoint])
        key = election_lib.leader_key("/t", "run")
        a = election_lib.Election(client, key, address="a:1", instance="A", lease_ttl_s=2)
        b = election_lib.Election(client, key, address="b:1", instance="B", lease_ttl_s=2)
        pointer = commit_lib.EtcdCommitPointer(client, prefix="/t", leader_key=key)
        assert await a.try_acquire()
        assert not await b.try_acquire()
        assert b.leader == election_lib.Leader("a:1", a.epoch, "A")
        assert await b.observe() == election_lib.Leader("a:1", a.epoch, "A")
        await pointer.commit(CommitRecord("run", 5, a.epoch))
        await pointer.commit(CommitRecord("run", 5, a.epoch))  # a retry is a no-op
        assert await pointer.latest("run") == CommitRecord("run", 5, a.epoch)
        with pytest.raises(ValueError):  # never backwards under one epoch
            await pointer.commit(CommitRecord("run", 4, a.epoch))
        # A resigns (its lease is revoked): B leads with a newer epoch.
        old_epoch = a.epoch
        await a.resign()
        assert await b.try_acquire() and b.epoch > old_epoch
        # The deposed leader's commit is refused, even at a later step, and even though B has not
        # committed anything yet (the leader key fences it).
        with pytest.raises(CommitFenced):
            await pointer.commit(CommitRecord("run", 9, old_epoch))
        await pointer.commit(CommitRecord("run", 6, b.epoch))
        assert await pointer.latest("run") == CommitRecord("run", 6, b.epoch)
        with pytest.raises(CommitFenced):  # older than what the pointer holds
            await pointer.commit(CommitRecord("run", 7, old_epoch))
        assert await pointer.latest("other") is None
        await client.close()

    _run(scenario())


def test_a_dead_leaders_lease_expires_and_the_standby_takes_over(etcd_server):
    async def scenario():
        loop = asyncio.get_running_loop()
        client = etcd_lib.Etcd([etcd_server.endpoint])
        key = election_lib.leader_key("/t", "run")
        a = election_lib.Election(client, key, address="a:1", lease_ttl_s=2)
        b = election_lib.Election(client, key, address="b:1", lease_ttl_s=2, poll_interval_s=0.1)
        assert await a.try_acquire()
        died_at = loop.time()  # A stops refreshing: as if it were killed
        epoch = await asyncio.wait_for(b.campaign(), 10)
        took_s = loop.time() - died_at
        print(f"standby elected {took_s:.2f} s after the leader stopped refreshing (lease {a._ttl_s} s)")
        assert epoch > a.epoch
        assert took_s < a._ttl_s + 2.0
        await client.close()

    _run(scenario())


def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_ends(etcd_server):
    async def scenario():
        loop = asyncio.get_running_loop()
        client = etcd_lib.Etcd([etcd_server.endpoint], call_timeout_s=0.5)
        key = election_lib.leader_key("/t", "run")
        a = election_lib.Election(client, key, address="a:1", lease_ttl_s=2)
        assert await a.try_acquire()
        holding = asyncio.create_task(a.hold())
        await asyncio.sleep(1.5)  # a few keep-alives go through
        assert not holding.done() and a.is_leader()
        etcd_server.pause()
        cut_at = loop.time()
        try:
            reason = await asyncio.wait_for(holding, 10)
            stepped_down_s = loop.time() - cut_at
        finally:
            etcd_server.resume()
        print(f"leader stepped down {stepped_down_s:.2f} s after etcd stopped answering ({reason})")
        assert not a.is_leader()
        # Before etcd could expire the lease: at most one TTL after the cut.
        assert stepped_down_s <= a._ttl_s
        await client.close()

    _run(scenario())


def test_unreachable_endpoints_fail_within_the_deadline_and_the_next_one_answers(etcd_server):
    async def scenario():
        loop = asyncio.get_running_loop()
        with ports.refused_address() as dead:
            client = etcd_lib.Etcd([dead], call_timeout_s=0.5)
            started = loop.time()
            with pytest.raises(etcd_lib.EtcdUnavailable):
                await client.get(b"k")
            assert loop.time() - started < 2.0
            await client.close()
            client = etcd_lib.Etcd([dead, etcd_server.endpoint], call_timeout_s=1.0)
            assert await client.get(b"k") is None
            await client.close()

    _run(scenario())


def test_a_candidate_whose_lease_etcd_forgot_takes_a_new_one_and_still_wins(etcd_server):
    async def scenario():
        client = etcd_lib.Etcd([etcd_server.endpoint])
        key = election_lib.leader_key("/t", "run")
        a = election_lib.Election(client, key, address="a:1", lease_ttl_s=30)
        b = election_lib.Election(client, key, address="b:1", lease_ttl_s=30, poll_interval_s=0.1)
        assert await a.try_acquire()
        assert not await b.try_acquire()
        forgotten = b.lease_id
        await client.revoke(forgotten)  # etcd no longer knows b's lease; b still thinks it valid
        await a.resign()
        epoch = await asyncio.wait_for(b.campaign(), 10)
        assert epoch > a.leader.epoch and b.lease_id != forgotten
        await client.close()

    _run(scenario())
