"""Learner liveness (ddiloco/liveness.py): the staleness rule on an injected clock, the health
server that reports it (a real gRPC server on 127.0.0.1:0, probed as the kubelet and compose do),
the `stall` failpoint that hangs a loop, and the learner's flags."""

from __future__ import annotations

import threading

import pytest

from ddiloco import healthcheck
from ddiloco import liveness as liveness_lib
from ddiloco import failpoints
from services.learner import config as learner_config

pytestmark = pytest.mark.timeout(60)


def test_alive_within_the_bound_since_the_start_or_the_last_beat(clock):
    liveness = liveness_lib.LoopLiveness(30.0, clock=clock)
    assert liveness.alive() and liveness.since_beat_s() == 0.0  # the start counts as progress
    clock.advance(30.0)
    assert liveness.alive()  # the bound itself is still alive
    clock.advance(0.001)
    assert not liveness.alive()
    liveness.beat()
    assert liveness.alive() and liveness.beats == 1
    clock.advance(29.0)
    liveness.beat()
    clock.advance(29.0)
    assert liveness.alive() and liveness.since_beat_s() == pytest.approx(29.0)
    clock.advance(1.5)
    assert not liveness.alive()


def test_status_maps_to_the_grpc_health_enum_and_zero_disables(clock):
    liveness = liveness_lib.LoopLiveness(5.0, clock=clock)
    serving, not_serving = 1, 2  # grpc.health.v1 HealthCheckResponse.ServingStatus
    assert liveness.status() == serving
    clock.advance(6.0)
    assert liveness.status() == not_serving
    never = liveness_lib.LoopLiveness(0.0, clock=clock)
    clock.advance(1e9)
    assert never.alive() and never.status() == serving
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="must be >= 0"):
            liveness_lib.LoopLiveness(bad)


def test_health_server_reports_serving_then_not_serving_when_the_loop_stalls(clock):
    liveness = liveness_lib.LoopLiveness(10.0, clock=clock)
    server = liveness_lib.HealthServer("127.0.0.1:0", liveness)
    try:
        target = f"127.0.0.1:{server.port}"
        assert server.address == target
        assert healthcheck.check(target, timeout_s=5.0)[0] == healthcheck.EXIT_SERVING
        for _ in range(3):  # a loop that steps every 4 s stays alive
            clock.advance(4.0)
            liveness.beat()
            assert healthcheck.check(target, timeout_s=5.0)[0] == healthcheck.EXIT_SERVING
        clock.advance(10.5)  # then it stops stepping
        code, message = healthcheck.check(target, timeout_s=5.0)
        assert code == healthcheck.EXIT_NOT_SERVING and "NOT_SERVING" in message
        liveness.beat()  # a loop that recovers is alive again
        assert healthcheck.check(target, timeout_s=5.0)[0] == healthcheck.EXIT_SERVING
    finally:
        server.stop()
    # Stopped: nothing answers.
    assert healthcheck.check(target, timeout_s=2.0)[0] == healthcheck.EXIT_UNREACHABLE


def test_health_server_refuses_a_taken_port_with_oserror():
    liveness = liveness_lib.LoopLiveness(10.0)
    first = liveness_lib.HealthServer("127.0.0.1:0", liveness)
    try:
        with pytest.raises(OSError, match="could not bind the health port"):
            liveness_lib.HealthServer(f"127.0.0.1:{first.port}", liveness)
    finally:
        first.stop()


def test_stall_failpoint_blocks_only_the_thread_that_reaches_it():
    assert failpoints.parse("learner.inner_step=stall@3") == {"learner.inner_step": ("stall", 3)}
    fp = failpoints.Failpoints("learner.inner_step=stall@3", prefix="learner.")
    steps: list[int] = []
    stalled = threading.Event()

    def loop():
        for i in range(5):
            if i == 2:
                stalled.set()  # the next hit (the third) stalls
            fp.hit("learner.inner_step")
            steps.append(i)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert stalled.wait(10.0)
    thread.join(0.5)
    assert thread.is_alive() and steps == [0, 1], "the third hit must block the loop"
    fp.release_stalls()
    thread.join(10.0)
    assert not thread.is_alive() and steps == [0, 1, 2, 3, 4]


def test_learner_flags_default_to_a_container_port_and_validate():
    cfg = learner_config.parse_learner_config([], {})
    assert cfg.health_bind == "0.0.0.0:8083" and cfg.liveness_timeout_s == 300.0
    cfg = learner_config.parse_learner_config(["--health-bind", "127.0.0.1:0", "--liveness-timeout-s", "4"], {})
    assert cfg.health_bind == "127.0.0.1:0" and cfg.liveness_timeout_s == 4.0
    env = {"DDILOCO_LEARNER_HEALTH_BIND": "", "DDILOCO_LEARNER_LIVENESS_TIMEOUT_S": "0"}
    cfg = learner_config.parse_learner_config([], env)
    assert cfg.health_bind == "" and cfg.liveness_timeout_s == 0.0
    for bad in (["--health-bind", "8083"], ["--liveness-timeout-s", "-1"]):
        with pytest.raises(SystemExit):
            learner_config.parse_learner_config(bad, {})
