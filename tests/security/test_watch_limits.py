"""Caps on concurrent watch streams (issue 24): WatchTrainingState and WatchFragments.

Each RPC has a cap per authenticated identity and one in total (`--max-state-watchers[-per-identity]`,
`--max-fragment-watchers[-per-identity]`); a stream beyond either is RESOURCE_EXHAUSTED with a
message naming the limit, and a slot is free again once its stream ends (here: the client cancels).
Without authentication every caller is anonymous and only the total applies. Real gRPC servers
(the security harness), small caps so the tests stay fast; the defaults and the flags are checked
on the syncer's configuration.
"""

from __future__ import annotations

import time

import grpc
import pytest

from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import serde
from services.syncer import config as config_lib
from services.syncer import servicer as servicer_lib
from tests.security.conftest import Harness, Learner, client_security

pytestmark = pytest.mark.timeout(120)

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_RELEASE_TIMEOUT_S = 10.0


def _caps(total: int, per_identity: int) -> dict:
    return {"state_watch_cap": servicer_lib.StreamCap(total, per_identity, "--max-state-watchers"),
            "fragment_watch_cap": servicer_lib.StreamCap(total, per_identity, "--max-fragment-watchers")}


def _stub(h: Harness, sec) -> syncer_pb2_grpc.SyncerStub:
    return syncer_pb2_grpc.SyncerStub(channel_lib.sync_channel(h.address, sec))


def _watch_state(stub):
    """An open WatchTrainingState stream (its first message read, so the server holds its slot)."""
    call = stub.WatchTrainingState(syncer_pb2.WatchTrainingStateRequest(min_interval_s=0.5), timeout=60)
    assert next(call).state.run_id
    return call


def _watch_fragments(stub, learner: Learner | None = None):
    """An open WatchFragments stream, as an observer or as `learner` (first message read)."""
    request = syncer_pb2.WatchFragmentsRequest(protocol_version=serde.PROTOCOL_VERSION)
    if learner is not None:
        request.learner_id, request.incarnation = learner.learner_id, learner.incarnation
        request.syncer_instance = learner.instance
    call = stub.WatchFragments(request, timeout=60)
    assert next(call).WhichOneof("kind")
    return call


def _refused(open_stream) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        open_stream()
    assert info.value.code() == EXHAUSTED, info.value
    return info.value


def _eventually_opens(open_stream):
    """Opens a stream once a cancelled one's slot is released (within _RELEASE_TIMEOUT_S)."""
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while True:
        try:
            return open_stream()
        except grpc.RpcError as exc:
            assert exc.code() == EXHAUSTED and time.monotonic() < deadline, exc
            time.sleep(0.1)


def test_state_watchers_are_capped_per_identity_and_in_total(tmp_path, pki):
    with Harness(tmp_path, mode="mtls", pki=pki, servicer_kwargs=_caps(total=3, per_identity=2)) as h:
        operator, evaluator = _stub(h, client_security(pki, "operator")), _stub(h, client_security(pki, "evaluator"))
        first, second = _watch_state(operator), _watch_state(operator)
        error = _refused(lambda: _watch_state(operator))
        assert "reader/operator already has 2 streams open" in error.details()
        assert "--max-state-watchers-per-identity 2" in error.details()
        # Another identity is not held back by the operator's streams, up to the total.
        third = _watch_state(evaluator)
        error = _refused(lambda: _watch_state(evaluator))
        assert "3 streams are open" in error.details() and "--max-state-watchers 3" in error.details()
        # The refused calls held no slot; a stream that ends frees its own.
        first.cancel()
        replacement = _eventually_opens(lambda: _watch_state(operator))
        _refused(lambda: _watch_state(operator))
        # The open streams still deliver.
        assert next(second).state.run_id and next(third).state.run_id
        # Refusals for load are not authentication failures.
        assert not any(h.state().auth_failures.values())
        for call in (second, third, replacement):
            call.cancel()


def test_fragment_watchers_are_capped_for_learners_and_observers(tmp_path, pki):
    with Harness(tmp_path, mode="mtls", pki=pki, servicer_kwargs=_caps(total=3, per_identity=2)) as h:
        learner = Learner(h.address, "learner-0", sec=client_security(pki, "learner-0"))
        evaluator = _stub(h, client_security(pki, "evaluator"))
        first, second = _watch_fragments(learner.stub, learner), _watch_fragments(learner.stub, learner)
        error = _refused(lambda: _watch_fragments(learner.stub, learner))
        assert "WatchFragments: learner/learner-0 already has 2 streams open" in error.details()
        third = _watch_fragments(evaluator)
        error = _refused(lambda: _watch_fragments(evaluator))
        assert "--max-fragment-watchers 3" in error.details()
        second.cancel()
        fourth = _eventually_opens(lambda: _watch_fragments(learner.stub, learner))
        for call in (first, third, fourth):
            call.cancel()
        learner.close()


def test_without_authentication_only_the_total_applies(tmp_path):
    with Harness(tmp_path, mode="plaintext", servicer_kwargs=_caps(total=3, per_identity=1)) as h:
        anonymous = _stub(h, security.ClientSecurity.plaintext())
        calls = [_watch_state(anonymous) for _ in range(3)]  # one "identity", three streams: the total is 3
        error = _refused(lambda: _watch_state(anonymous))
        assert "3 streams are open" in error.details()
        for call in calls:
            call.cancel()


def test_watch_caps_are_configurable_with_safe_defaults():
    cfg = config_lib.parse_config([], {"DDILOCO_SYNCER_INSECURE": "1"})
    assert (cfg.max_state_watchers, cfg.max_state_watchers_per_identity) == (64, 16)
    assert (cfg.max_fragment_watchers, cfg.max_fragment_watchers_per_identity) == (1024, 8)
    cfg = config_lib.parse_config(["--insecure", "--max-state-watchers", "5", "--max-state-watchers-per-identity", "2",
                                   "--max-fragment-watchers", "7", "--max-fragment-watchers-per-identity", "3"], {})
    assert (cfg.max_state_watchers, cfg.max_state_watchers_per_identity) == (5, 2)
    assert (cfg.max_fragment_watchers, cfg.max_fragment_watchers_per_identity) == (7, 3)
    with pytest.raises(ValueError, match="max_state_watchers_per_identity"):
        config_lib.SyncerConfig(insecure=True, max_state_watchers_per_identity=0)
    with pytest.raises(ValueError):
        servicer_lib.StreamCap(0, 1, "--max-state-watchers")
