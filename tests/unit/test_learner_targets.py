"""ddiloco/learner/targets.py: which syncer the learner's next session uses."""

from __future__ import annotations

import pytest

from ddiloco.learner import targets as targets_lib


def test_one_address_is_always_used():
    t = targets_lib.SyncerTargets("syncer.example:50051")
    assert [t.next() for _ in range(3)] == ["syncer.example:50051"] * 3


def test_one_address_behind_a_load_balancer_is_tried_again_after_a_named_leader_fails():
    t = targets_lib.SyncerTargets("syncers.example:50051")
    assert t.next() == "syncers.example:50051"
    assert t.redirected(targets_lib.NotLeader("standby", leader="10.1.2.3:50051")) == "10.1.2.3:50051"
    assert t.next() == "10.1.2.3:50051"
    assert t.next() == "syncers.example:50051"  # the named leader was unreachable: back to the list


def test_failures_rotate_through_the_list_and_a_named_leader_comes_first():
    t = targets_lib.SyncerTargets("a:1, b:2,c:3")
    assert t.next() == "a:1"
    assert t.next() == "b:2"  # a failed session moves on
    assert t.redirected(targets_lib.NotLeader("standby", leader="c:3")) == "c:3"
    assert t.next() == "c:3"
    assert t.redirected(targets_lib.NotLeader("standby", leader="")) == ""  # no leader known: rotate
    assert t.next() == "a:1"


def test_redirects_in_a_row_are_bounded_then_back_off_like_failures():
    t = targets_lib.SyncerTargets("a:1,b:2")
    t.next()
    hops = []
    for i in range(targets_lib.MAX_REDIRECTS + 2):
        hops.append(t.redirected(targets_lib.NotLeader("standby", leader="b:2" if i % 2 == 0 else "a:1")))
        t.next()
    assert hops[:targets_lib.MAX_REDIRECTS] == ["b:2", "a:1", "b:2"] and hops[-1] == ""
    t.joined()
    assert t.redirected(targets_lib.NotLeader("standby", leader="a:1" if t.current == "b:2" else "b:2")) != ""


def test_an_empty_list_is_refused():
    with pytest.raises(ValueError):
        targets_lib.SyncerTargets(" , ")


def test_the_client_never_folds_in_a_version_of_an_older_epoch():
    import asyncio

    import numpy as np

    from ddiloco.v1 import syncer_pb2
    from ddiloco.wire import codec as codec_lib
    from ddiloco.wire import serde
    from ddiloco.learner import client as client_lib

    client = client_lib.SyncClient(client_lib.ClientConfig(target="a:1,b:2", learner_id="l", incarnation=1,
                                                           region="r", tokens_per_step=1))
    client.instance = "new"
    encoded = codec_lib.encode(np.ones(8, np.float32), "fp32")

    def header(epoch: int, instance: str) -> syncer_pb2.GlobalFragmentHeader:
        return syncer_pb2.GlobalFragmentHeader(fragment_id=0, version=3, syncer_instance=instance, epoch=epoch,
                                               payload=serde.payload_info_to_proto(encoded))

    asyncio.run(client._receive(header(7, "new"), encoded.payload))
    assert client.max_epoch == 7 and [u.version for u in client.take_updates()] == [3]
    client.instance = "old"  # a deposed leader's stream, still open
    with pytest.raises(targets_lib.NotLeader):
        asyncio.run(client._receive(header(5, "old"), encoded.payload))
    assert client.take_updates() == []
