"""The held-out evaluations evaluators report to the syncer (TrainingState.evals, the loss gauge).

Owns `EvalLog`: checks a report (protocol version, a finite loss), stamps it with the wall clock
and keeps the last `EVAL_HISTORY`, oldest first; a restore refills it (snapshots.py).
Must not: build protobuf (the report arrives in its plain form, state.EvalReport, made by
wire_views.eval_report) or take part in rounds.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable

from ddiloco.rpc import errors
from . import membership as membership_lib
from . import state as state_lib

_LOG = logging.getLogger("ddiloco.syncer")

EVAL_HISTORY = 512


class EvalLog(collections.deque):
    """The last EVAL_HISTORY evaluations (state.EvalSnapshot), a deque the views read as it is."""

    def __init__(self, wall_clock: Callable[[], float]) -> None:
        super().__init__((), EVAL_HISTORY)
        self._wall = wall_clock

    def report(self, report: state_lib.EvalReport) -> None:
        """Keeps one evaluation; InvalidArgument (or the protocol's error) when it is unusable."""
        membership_lib.check_protocol(report.protocol_version)
        if not math.isfinite(report.heldout_loss):
            raise errors.InvalidArgument("heldout_loss must be finite", reason="eval")
        self.append(state_lib.EvalSnapshot(at_unix_s=self._wall(), heldout_loss=report.heldout_loss,
                                           tokens_merged=report.tokens_merged, outer_steps=report.outer_steps))
        _LOG.info("held-out loss",
                  extra={"fields": {"loss": round(report.heldout_loss, 4), "evaluator": report.evaluator_id}})
