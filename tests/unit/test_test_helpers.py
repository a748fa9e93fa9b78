"""The shared test helpers themselves (tests/fakes.py, tests/waits.py, tests/ports.py): many tests
stand on them, so their promises are checked here."""

from __future__ import annotations

import asyncio
import json
import errno
import socket
import time

import numpy as np
import pytest

from services.syncer import config as config_lib
from services.syncer import wire_views
from tests import fakes, ports, waits


def test_a_refused_address_refuses_connections_and_holds_its_port():
    with ports.refused_address() as address:
        host, port = address.rsplit(":", 1)
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.settimeout(5)
            client.connect((host, int(port)))
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind((host, int(port)))
        assert taken.value.errno == errno.EADDRINUSE


def test_wait_until_returns_the_value_and_treats_only_not_yet_errors_as_not_yet():
    answers = iter([ConnectionError("not up"), None, 0, "ready"])

    def probe():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert waits.wait_until(probe, timeout_s=5, what="x", not_yet=(ConnectionError,), interval_s=0.001) == "ready"
    with pytest.raises(KeyError):  # not a "not yet" error: fails at once, not at the deadline
        waits.wait_until(lambda: {}["missing"], timeout_s=60, what="x", not_yet=(ConnectionError,))


def test_wait_until_fails_with_what_was_awaited_the_last_error_and_the_description():
    def refused():
        raise ConnectionRefusedError("nobody home")

    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)waiting for the merge \(last error: nobody home\)\nlogs here"):
        waits.wait_until(refused, timeout_s=0.2, what="the merge", not_yet=(ConnectionError,), interval_s=0.01,
                         describe=lambda: "logs here")
    assert time.monotonic() - started < 5


def test_wait_until_async_fails_at_its_deadline_without_blocking_the_loop():
    async def run():
        ticks = []

        async def ticker():
            while True:
                ticks.append(1)
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(ticker())
        try:
            with pytest.raises(AssertionError, match="waiting for never"):
                await waits.wait_until_async(lambda: False, timeout_s=0.2, what="never")
            await waits.wait_until_async(lambda: len(ticks) > 3, timeout_s=5, what="ticks")
        finally:
            task.cancel()

    asyncio.run(run())


def test_make_core_is_deterministic_and_routes_config_fields_and_core_knobs(clock):
    a, b = fakes.make_core(clock), fakes.make_core(fakes.FakeClock())
    assert [s.params.tobytes() for s in a.slots] == [s.params.tobytes() for s in b.slots]
    n = a.plan.fragments[0].numel
    scaled = fakes.make_core(clock, initial_std=0.02)
    np.testing.assert_array_equal(scaled.slots[0].params,
                                  (0.02 * np.random.default_rng(0).standard_normal(n)).astype(np.float32))
    zeros = fakes.make_core(clock, initial_std=0.0, max_staleness_versions=0, grace_gamma=0.1)
    assert all(not s.params.any() for s in zeros.slots)
    # A SyncerConfig field reaches the RunConfig; a knob both take goes to the core, which acts on it.
    fakes.join(zeros, "l1")
    fakes.progress(zeros, "l1", step_time_s=2.0)
    assert zeros.run.max_staleness_versions == 0
    assert zeros.grace_window_s() == pytest.approx(0.1 * 2 * 2.0)  # gamma x (tau = 2 steps x 2 s)
    assert wire_views.training_state(a, 0).now_unix_s == clock.now_s
    real = fakes.make_core()
    assert wire_views.training_state(real, 0).now_unix_s == pytest.approx(time.time(), abs=60)  # the real clock
    with pytest.raises(TypeError, match="either a config or its fields"):
        fakes.make_core(clock, config=config_lib.SyncerConfig(), min_quorum=2)
    with pytest.raises(TypeError):
        fakes.make_core(clock, no_such_knob=1)



def test_child_processes_get_the_sessions_jax_compilation_cache_and_this_process_keeps_the_defaults(
        jax_compilation_cache):
    import subprocess
    import sys

    import jax

    # This process: JAX's defaults (it read its environment before the session set the cache).
    assert jax.config.jax_compilation_cache_dir is None
    # A child (a syncer, an evaluator, a CLI command): the session's directory, every program cached.
    child = ("import json, jax; c = jax.config; print(json.dumps([c.jax_compilation_cache_dir, "
             "c.jax_persistent_cache_min_compile_time_secs, c.jax_compilation_cache_max_size]))")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [str(jax_compilation_cache), 0.0, 512 * 2**20]
