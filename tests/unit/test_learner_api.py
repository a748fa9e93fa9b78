"""ddiloco.Learner's errors that need no syncer (docs/python-api.md, "Errors"): a parameter tree that
is not the syncer's model, an address where no syncer answers (bounded by join_timeout_s), and the
choices that are refused before any network call."""

from __future__ import annotations

import time

import numpy as np
import pytest

import ddiloco
from ddiloco.algo import fragments as fragments_lib
from ddiloco.learner import api
from tests import ports

pytestmark = pytest.mark.timeout(60)

SPECS = [fragments_lib.TensorSpec("embed", (10, 4), is_embedding=True), fragments_lib.TensorSpec("w", (4, 4)),
         fragments_lib.TensorSpec("b", (4,))]
PLAN = fragments_lib.plan_fragments(SPECS, num_fragments=2, sync_period_steps=4)


def _params() -> dict:
    return {s.name: np.zeros(s.shape, np.float32) for s in SPECS}


def test_the_api_is_ddiloco_learner():
    assert ddiloco.Learner is api.Learner
    with pytest.raises(AttributeError):
        ddiloco.NoSuchThing  # noqa: B018


def test_params_that_are_the_syncers_model_have_no_problems():
    assert api.params_problems(_params(), PLAN) == []


@pytest.mark.parametrize("change, expected", [
    (lambda p: p.pop("w"), "missing 1 tensor(s) of the syncer's model: w"),
    (lambda p: p.update(extra=np.zeros(3, np.float32)), "1 tensor(s) the syncer's model does not have: extra"),
    (lambda p: p.update(b=np.zeros(5, np.float32)), "b: shape (5,), the syncer's is (4,)"),
    (lambda p: p.update(w=np.zeros((4, 4), np.float16)), "w: dtype float16, the syncer's parameters are float32"),
])
def test_each_difference_from_the_fragment_plan_is_named(change, expected):
    params = _params()
    change(params)
    assert api.params_problems(params, PLAN) == [expected]


def test_plaintext_must_be_asked_for():
    with pytest.raises(ValueError, match="insecure=True"):
        api.Learner("127.0.0.1:1", _params(), "a")


def test_a_nested_tree_is_refused_with_what_to_pass_instead():
    with pytest.raises(TypeError, match="flat dict"):
        api.Learner("127.0.0.1:1", [np.zeros(3)], "a", insecure=True)


def test_no_syncer_at_the_address_fails_within_the_join_deadline_naming_both():
    with ports.refused_address() as address:
        learner = api.Learner(address, _params(), "a", insecure=True, join_timeout_s=1.0, call_timeout_s=0.5,
                              retry_bound_s=0.5)
        started = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            with learner:
                pytest.fail("joined a syncer that does not exist")
        waited_s = time.monotonic() - started
    message = str(caught.value)
    assert address in message and "within 1 s" in message and "join_timeout_s=1" in message, message
    # The bound holds: the join timeout, plus the client's bounded shutdown.
    assert 1.0 <= waited_s < 8.0, waited_s
    with pytest.raises(RuntimeError, match="not joined"):
        learner.after_step(_params(), tokens=1)
