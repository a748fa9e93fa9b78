"""Fragment shards hold their own fragments only (issue 21: a 1B-parameter model with 4 shards in
one machine's memory): a shard of N builds and keeps about 1/N of the model's bytes (values,
outer optimizer state, versions), and its slice is exactly what an unsharded syncer starts from.

Before shards held only their own fragments, every shard built the whole model and kept every
fragment's values and momentum: the byte count of a shard equalled the unsharded syncer's, and
`elsewhere` slots did not exist (the first two tests fail there).
"""

from __future__ import annotations

import collections
import dataclasses
import types

import jax
import numpy as np
import pytest

from ddiloco import models
from ddiloco.algo import fragments as fragments_lib
from services.syncer import __main__ as syncer_main
from services.syncer import config as config_lib
from services.syncer import initial as initial_lib

MAP4 = "127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003,127.0.0.1:7004"
_SKIP = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType,
         types.BuiltinFunctionType, types.MethodType, types.LambdaType)


def _array_bytes(root) -> int:
    """The bytes of every distinct numpy buffer reachable from `root` through the syncer's own
    objects (containers, dataclasses, the parts): values, optimizer state, versions, caches."""
    seen, buffers, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            while isinstance(obj.base, np.ndarray):
                obj = obj.base
            buffers[id(obj)] = obj.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("services.", "ddiloco.")):
            if dataclasses.is_dataclass(obj):
                stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
            stack.extend(getattr(obj, "__dict__", {}).values())
    return sum(buffers.values())


def _core(**fields):
    cfg = config_lib.SyncerConfig(num_fragments=4, model_config='{"preset": "small"}', seed=3, **fields)
    model = models.get_model(cfg.model, cfg.model_overrides)
    return syncer_main.make_core(cfg, model)


@pytest.fixture(scope="module")
def cores():
    return _core(), [_core(fragment_shard=index, fragment_shards=MAP4) for index in range(4)]


def test_a_shard_of_n_holds_about_one_nth_of_the_parameter_bytes(cores):
    unsharded, shards = cores
    total_bytes = _array_bytes(unsharded)
    total_numel = sum(f.numel for f in unsharded.plan.fragments)
    assert total_bytes >= 8 * total_numel  # values and momentum of every fragment, at least
    for shard in shards:
        owned_numel = sum(unsharded.plan.fragments[fid].numel for fid in shard.owned)
        shard_bytes = _array_bytes(shard)
        # Its share of the model's values, to 2% of the unsharded syncer's bytes (fragments are
        # balanced, not equal: each shard's share is that of its own fragments).
        assert abs(shard_bytes - total_bytes * owned_numel / total_numel) <= 0.02 * total_bytes, shard.shards.describe()
        assert shard_bytes < 0.4 * total_bytes
    assert abs(sum(_array_bytes(s) for s in shards) - total_bytes) <= 0.02 * total_bytes


def test_a_shard_decodes_at_once_only_as_many_contributions_as_its_own_fragments_need(cores):
    # Decoded contributions are fragment-sized (1 GB each at 1B parameters): a shard bounds them by
    # the fragments it owns, not the plan's. Before, every shard allowed the unsharded syncer's count.
    unsharded, shards = cores
    per_fragment = unsharded.direction.min_others + 1
    assert unsharded.admission.max_decoding == len(unsharded.plan.fragments) * per_fragment  # as always
    for shard in shards:
        assert shard.admission.max_decoding == len(shard.owned) * per_fragment < unsharded.admission.max_decoding


def test_a_shards_slice_is_the_unsharded_syncers_initial_state_and_it_holds_no_other(cores):
    unsharded, shards = cores
    for shard in shards:
        for slot in shard.slots:
            fid = slot.fragment.fragment_id
            if fid in shard.owned:
                whole = unsharded.slots[fid]
                assert slot.params.tobytes() == whole.params.tobytes() and slot.params_sha256 == whole.params_sha256
                assert [a.tobytes() for a in slot.opt_state] == [a.tobytes() for a in whole.opt_state]
            else:  # another shard's fragment: nothing held, never merged here
                assert slot.params.size == 0 and not slot.opt_state and not slot.history and slot.published is None
    assert sorted(fid for s in shards for fid in s.owned) == list(range(4))


def test_init_tensors_builds_a_slice_bit_identical_to_the_whole_init():
    model = models.get_model("transformer", {"preset": "small"})
    rng = jax.random.PRNGKey(11)
    whole = {name: np.asarray(v) for name, v in model.init(rng).items()}
    names = [spec.name for spec in model.tensor_specs()][::3]
    part = models.init_tensors(model, rng, names)
    assert list(part) == names
    assert all(np.asarray(part[name]).tobytes() == whole[name].tobytes() for name in names)
    with pytest.raises(ValueError, match="no tensor.*nope"):
        model.init_tensors(rng, ["nope"])


def test_a_model_without_init_tensors_is_initialized_whole_and_sliced():
    transformer = models.get_model("transformer", {"preset": "tiny"})

    class Plain:  # a plugin model: the Model protocol only
        init = staticmethod(transformer.init)

    rng = jax.random.PRNGKey(5)
    names = [spec.name for spec in transformer.tensor_specs()][:2]
    part = models.init_tensors(Plain(), rng, names)
    assert list(part) == names
    assert all(np.asarray(part[n]).tobytes() == np.asarray(transformer.init(rng)[n]).tobytes() for n in names)


def test_the_initial_fragments_are_laid_out_as_flatten_fragment_lays_them():
    model = models.get_model("transformer", {"preset": "tiny"})
    plan = fragments_lib.plan_fragments(model.tensor_specs(), 3, 3)
    whole = model.init(jax.random.PRNGKey(4))
    built = initial_lib.initial_fragments(model, plan, 4, [2, 0])
    assert sorted(built) == [0, 2]
    for fid, values in built.items():
        assert values.dtype == np.float32
        assert values.tobytes() == fragments_lib.flatten_fragment(whole, plan.fragments[fid]).tobytes()
