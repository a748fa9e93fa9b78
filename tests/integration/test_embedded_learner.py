"""The Python API as a user runs it (issue 25, must-show 3): examples/embedded_learner.py, twice, as two
processes against one real syncer process. Both learners' work reaches the global model as the
service learners' does: work merged (tokens in merged contributions / (P x tokens processed), as
`ddiloco status` reports it) is 100 %, the figure tests/integration/test_rounds_e2e.py requires of
service learners that finish, and each learner's last contributions are merged before it exits.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from ddiloco import training_state
from tests.integration.conftest import TINY, SyncerProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embedded_learner.py"
STEPS = 300
LEARNERS = ("embedded-a", "embedded-b")


def test_two_embedded_learners_merge_all_their_work_as_service_learners_do(cluster):
    syncer = cluster.start_syncer(run_id="embedded", extra=TINY)
    procs = {}
    try:
        for learner_id in LEARNERS:
            with open(cluster.workdir / f"{learner_id}.out", "wb") as out, \
                    open(cluster.workdir / f"{learner_id}.log", "wb") as log:
                procs[learner_id] = subprocess.Popen(
                    [sys.executable, str(EXAMPLE), "--syncer", syncer.address, "--learner-id", learner_id,
                     # Paced as the service learners of these tests are (LEARNER_PACE): ~30 ms a step.
                     "--steps", str(STEPS), "--step-delay-s", "0.03"],
                    stdout=out, stderr=log, env=cluster.env, cwd=cluster.workdir)
        for learner_id, proc in procs.items():
            log = cluster.workdir / f"{learner_id}.log"
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        for proc in procs.values():  # only the processes this test started, by their handles
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    probe = SyncerProbe(syncer.address)
    try:
        state = probe.state()
    finally:
        probe.close()
    # Rounds went on while they trained (not only their last contributions at the end), and some
    # held both learners' work, as the service learners' rounds do.
    assert state.outer_steps > 2 * state.config.num_fragments, state.outer_steps
    assert any(len(m.contributors) == len(LEARNERS) for m in state.recent_merges), [
        [c.learner_id for c in m.contributors] for m in state.recent_merges]
    summaries = {lid: json.loads((cluster.workdir / f"{lid}.out").read_text().strip().splitlines()[-1])
                 for lid in LEARNERS}
    tokens = sum(s["tokens"] for s in summaries.values())
    assert tokens == len(LEARNERS) * STEPS * 8 * 32  # steps x batch x predicted positions (tiny: 32)
    assert state.tokens_processed == tokens
    derived = training_state.derived(state)
    assert derived["work_merged"] == pytest.approx(1.0), (state.tokens_merged, tokens, summaries)
    for learner_id, summary in summaries.items():
        assert summary["all_merged"] is True, (learner_id, summary)
        assert summary["merged_contributions"] > 0, (learner_id, summary)
        assert summary["steps"] == STEPS
        assert summary["uploads_queued"] > state.config.num_fragments, (learner_id, summary)  # not only the final ones
