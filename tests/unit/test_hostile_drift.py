"""The chaos tool's drifting learner (ddiloco/chaos/hostile_learner.py): the syncer receives the
bias every round, and the learner's own record of what it sent (UploadJob.sent_values, which its
rebase subtracts from its progress) does not hold it. Before, the record held the bias, the next
pseudo-gradient carried -bias, and the bias telescoped away (measured: the contribution's component
along the bias fell from 0.45 of its norm to about 0 within 4 rounds)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from ddiloco.chaos import hostile_learner
from ddiloco.learner import client as client_lib
from ddiloco.learner import uploads as uploads_lib
from ddiloco.rpc import security
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde


def _encoded(hide: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(delta, the values the syncer decodes, job.sent_values) of one int4 upload of a drift:0.5 learner."""
    kind, x = hostile_learner.parse_behaviour("drift:0.5")
    client = hostile_learner.HostileSyncClient(
        client_lib.ClientConfig(target="127.0.0.1:1", learner_id="l", incarnation=1, region="r", tokens_per_step=0,
                                security=security.ClientSecurity(insecure=True)),
        change=hostile_learner.transform(kind, x), hide_change=hide)
    try:
        client.run_config = syncer_pb2.RunConfig(upload_codec=serde.codec_to_proto("int4"), upload_block_size=64,
                                                 chunk_size_bytes=1 << 20)
        delta = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
        job = uploads_lib.UploadJob(fragment_id=0, base_version=0, syncer_instance="s", steps=4, tokens=400, delta=delta)
        messages = asyncio.run(client._encode(job))
    finally:
        client._loop.close()
    header = messages[0].header
    payload = b"".join(m.chunk.data for m in messages[1:])
    return delta, serde.decode_payload(header.payload, payload), job.sent_values


def _along_bias(values: np.ndarray) -> float:
    """The component of `values` along the drift's fixed direction, over their norm."""
    u = np.random.default_rng([0, values.size]).standard_normal(values.size)
    return float(values @ (u / np.linalg.norm(u)) / np.linalg.norm(values))


@pytest.mark.parametrize("hide", [True, False])
def test_the_syncer_gets_the_bias_and_a_drifting_learners_rebase_record_does_not(hide):
    delta, wire, sent = _encoded(hide)
    assert _along_bias(wire) == pytest.approx(0.5 / np.sqrt(1.25), abs=0.03)
    if hide:  # what an honest int4 upload of the delta decodes to
        assert abs(_along_bias(sent)) < 0.05
        assert np.linalg.norm(sent - delta) < 0.2 * np.linalg.norm(delta)
    else:  # the record the rebase reads holds the bias: it telescopes away
        assert _along_bias(sent) == pytest.approx(_along_bias(wire), abs=1e-6)
