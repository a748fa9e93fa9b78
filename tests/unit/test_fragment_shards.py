"""algo.fragments.shard_fragments: the fragment ownership of syncer shards."""

import pytest

from ddiloco.algo.fragments import shard_fragments


@pytest.mark.parametrize("num_fragments,num_shards", [(4, 1), (4, 2), (4, 4), (7, 3), (16, 4)])
def test_every_fragment_has_exactly_one_owner_and_shares_are_balanced(num_fragments, num_shards):
    owned = [shard_fragments(num_fragments, num_shards, i) for i in range(num_shards)]
    flat = sorted(f for fs in owned for f in fs)
    assert flat == list(range(num_fragments))
    assert max(map(len, owned)) - min(map(len, owned)) <= 1


def test_neighbouring_fragments_land_on_different_shards():
    # rounds are staggered by fragment id: consecutive rounds should not queue on one shard
    owners = {f: i for i in range(3) for f in shard_fragments(6, 3, i)}
    assert all(owners[f] != owners[f + 1] for f in range(5))


@pytest.mark.parametrize("args,match", [((4, 0, 0), "at least 1"), ((4, 2, 2), "outside"),
                                        ((2, 3, 0), "at least as many fragments")])
def test_bad_shard_maps_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        shard_fragments(*args)
