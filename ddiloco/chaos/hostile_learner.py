"""A hostile learner for fault tests (fault-matrix row 21): the normal learner, every upload corrupted.

    python -m ddiloco.chaos.hostile_learner --hostile scale:1e4 <ddiloco learner flags>
    python -m ddiloco.chaos.hostile_learner --hostile noise:19 --claim-steps 4 --claim-batch 20 <flags>

runs services.learner's main with a `HostileSyncClient` wrapped around the learner's own client
(ShardedSyncClient): the learner trains as usual and its own state stays honest, but each
pseudo-gradient v is changed on its way to the wire, when the loop hands it to the client, before
it is encoded (`BEHAVIOURS`): "scale:<x>" sends x v, "signflip" -v, "noise:<x>" Gaussian noise of norm
x ‖v‖, "drift:<x>" v + x ‖v‖ u with u one fixed unit vector (a small constant bias every round),
"replay" the first pseudo-gradient it sent for a fragment of that size, again and again, and
"honest" v itself. A drifting learner keeps the bias out of its own record of what it sent
(`UploadJob.sent_values`, which the learner's rebase subtracts from its progress when the merge
comes back): with the bias in that record, as the other behaviours have it, the next pseudo-gradient
carries -bias and the bias telescopes (measured: the contribution's component along u fell from 0.45
of its norm to about 0 within 4 rounds, then alternated in sign), so the model never drifts. Hidden,
the bias reaches the model every round, as a drifting attacker would have it. `--claim-steps` and `--claim-batch` inflate the claims of every upload header
(steps x s, tokens x s x b: a batch b times bigger over s times the steps). What the syncer must do with such a
learner is in docs/security.md; tests/security/test_hostile_run.py and `ddiloco bench hostile`
run it against honest ones. The production learner has no such knob: this module is the only way
to get one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from ddiloco.cli import service_names
from ddiloco.learner import client as client_lib
from ddiloco.learner import sharded as sharded_lib
from ddiloco.v1 import syncer_pb2
from ddiloco.wire import serde

learner_main = service_names.load("services.learner.__main__")

_USAGE = ("python -m ddiloco.chaos.hostile_learner --hostile {signflip,scale:<x>,noise:<x>,drift:<x>,replay,honest} "
          "[--claim-steps S] [--claim-batch B] <ddiloco learner flags>")
BEHAVIOURS = ("signflip", "scale", "noise", "drift", "replay", "honest")


def parse_hostile(spec: str) -> float:
    """The factor a hostile learner multiplies its pseudo-gradients by: "signflip" -> -1.0,
    "scale:<x>" -> x (finite, nonzero). ValueError otherwise (see `parse_behaviour` for the rest)."""
    if spec == "signflip":
        return -1.0
    kind, _, value = spec.partition(":")
    try:
        factor = float(value) if kind == "scale" else math.nan
    except ValueError:
        factor = math.nan
    if not math.isfinite(factor) or factor == 0.0:
        raise ValueError(f"--hostile {spec!r}: use 'signflip' or 'scale:<finite nonzero number>'")
    return factor


def parse_behaviour(spec: str) -> tuple[str, float]:
    """(kind, x) of a --hostile spec, one of BEHAVIOURS. ValueError otherwise."""
    if spec in ("signflip", "replay", "honest"):
        return spec, -1.0 if spec == "signflip" else 1.0
    kind, _, value = spec.partition(":")
    if kind == "scale":
        return kind, parse_hostile(spec)
    try:
        x = float(value) if kind in ("noise", "drift") else math.nan
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"--hostile {spec!r}: use one of signflip, replay, honest, scale:<x>, noise:<x>, drift:<x> "
                         "(x finite, > 0 for noise and drift)")
    return kind, x


def transform(kind: str, x: float, *, seed: int = 0) -> Callable[[np.ndarray], np.ndarray]:
    """The corruption of one behaviour, as a function of the honest pseudo-gradient (float32)."""
    rng = np.random.default_rng(seed)
    first: dict[int, np.ndarray] = {}  # replay: the first pseudo-gradient per fragment size
    bias: dict[int, np.ndarray] = {}  # drift: one fixed unit vector per fragment size

    def apply(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, np.float32)
        norm = float(np.linalg.norm(values.astype(np.float64)))
        if kind in ("scale", "signflip"):
            return values * np.float32(x)
        if kind == "noise":
            noise = rng.standard_normal(values.size)
            return (noise * (x * norm / max(float(np.linalg.norm(noise)), 1e-30))).astype(np.float32)
        if kind == "drift":
            if values.size not in bias:
                u = np.random.default_rng([seed, values.size]).standard_normal(values.size)
                bias[values.size] = (u / np.linalg.norm(u)).astype(np.float32)
            return values + bias[values.size] * np.float32(x * norm)
        if kind == "replay":
            return first.setdefault(values.size, values.copy())
        return values

    return apply


class HostileSyncClient:
    """A sync client wrapping a real one (`inner`: a SyncClient or the learner's ShardedSyncClient)
    whose every upload carries `factor` x the pseudo-gradient the loop submitted (or `change` of
    it), and whose headers claim `claim_steps` x the steps and `claim_steps` x `claim_batch` x the
    tokens. It perturbs the upload before it reaches `inner.submit_upload`, the public upload
    method, so `inner` encodes and sends the changed values as it would honest ones; every other
    member is `inner`'s (the learner loop's `SyncClientLike` members explicitly, the rest of what
    services/learner uses, e.g. start and close, through `__getattr__`)."""

    def __init__(self, inner, *, factor: float = 1.0, change: Callable[[np.ndarray], np.ndarray] | None = None,
                 claim_steps: float = 1.0, claim_batch: float = 1.0, hide_change: bool = False) -> None:
        self._inner = inner
        scale = np.float32(factor)
        self._change = change or (lambda values: values * scale)
        self.hide_change = hide_change  # sent_values: the honest values as encoded (module docstring: drift)
        self.factor = factor
        self.claim_steps = claim_steps
        self.claim_batch = claim_batch

    def __getattr__(self, name: str):
        # Only for what this class does not define (start, close, run_config, stats, ...).
        return getattr(self._inner, name)

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        """Queues `job` on `inner` with its values changed (and its claims inflated). The values are
        replaced by a new array, never written into: the caller's delta stays honest. The job itself
        is changed in place, so that `inner` records on the caller's job what the syncer will decode
        (`sent_values`), as for an honest upload; with `hide_change` `inner` gets a copy instead and
        the caller's job records what the honest values would have decoded to."""
        honest = job.delta
        changed = np.asarray(self._change(np.asarray(honest, np.float32)), np.float32)
        steps, tokens = job.steps, job.tokens
        if self.claim_steps != 1.0 or self.claim_batch != 1.0:
            steps = max(1, round(job.steps * self.claim_steps))
            tokens = round(job.tokens * self.claim_steps * self.claim_batch)
        if not self.hide_change:
            job.delta, job.steps, job.tokens = changed, steps, tokens
            self._inner.submit_upload(job)
            return
        self._inner.submit_upload(dataclasses.replace(job, delta=changed, steps=steps, tokens=tokens))
        job.sent_values = self._honest_record(honest)

    def _honest_record(self, values: np.ndarray) -> np.ndarray | None:
        """What `inner` would record as sent for `values` (the upload codec's decoding; None when
        lossless), computed as uploads.Uploader does, on the caller's thread (drift only)."""
        cfg = self._inner.run_config
        encoded = self._inner.cfg.encode(values, serde.codec_from_proto(cfg.upload_codec),
                                         block_size=cfg.upload_block_size, zstd_level=cfg.zstd_level)
        if encoded.codec == "fp32":
            return None
        return serde.decode_payload(serde.payload_info_to_proto(encoded), encoded.payload)

    # The rest of SyncClientLike: `inner`'s, unchanged.

    def instance_of(self, fragment_id: int) -> str | None:
        return self._inner.instance_of(fragment_id)

    @property
    def fenced(self) -> client_lib.FencedError | None:
        return self._inner.fenced

    def take_updates(self) -> list[client_lib.GlobalFragment]:
        return self._inner.take_updates()

    def take_outcomes(self) -> list[client_lib.UploadOutcome]:
        return self._inner.take_outcomes()

    def take_calls(self) -> dict[int, syncer_pb2.RoundCall]:
        return self._inner.take_calls()

    def take_refused(self) -> set[tuple[int, str, int]]:
        return self._inner.take_refused()

    def set_progress(self, request: syncer_pb2.ReportProgressRequest) -> None:
        self._inner.set_progress(request)

    def arrivals(self) -> dict[int, int]:
        return self._inner.arrivals()

    def wait_for_arrivals(self, after: dict[int, int], timeout_s: float) -> bool:
        return self._inner.wait_for_arrivals(after, timeout_s)

    def held_values(self) -> dict[int, tuple[int, np.ndarray]]:
        return self._inner.held_values()

    def agree_any(self, flag: bool) -> bool:
        return self._inner.agree_any(flag)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddiloco.chaos.hostile_learner", usage=_USAGE, add_help=False, allow_abbrev=False,
        description="TESTS AND CHAOS ONLY: a learner that corrupts every pseudo-gradient before upload. "
                    "Every other flag is the learner's (`ddiloco learner --help`).")
    parser.add_argument("--hostile", required=True, metavar="{signflip,scale:<x>,noise:<x>,drift:<x>,replay,honest}",
                        help="signflip negates each upload; scale:<x> multiplies it by x (e.g. scale:1e4); noise:<x> "
                             "sends Gaussian noise of x times its norm; drift:<x> adds x times its norm along one "
                             "fixed direction; replay sends its first pseudo-gradient again and again; honest: as is")
    parser.add_argument("--claim-steps", type=float, default=1.0, help="claim this many times the steps (and tokens)")
    parser.add_argument("--claim-batch", type=float, default=1.0, help="claim this many times the batch (tokens/step)")
    parser.add_argument("--hostile-seed", type=int, default=0, help="seed of the noise and drift directions")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        print()
        return learner_main.main(["--help"])  # the learner's flags (exits)
    args, learner_argv = parser.parse_known_args(argv)
    try:
        kind, x = parse_behaviour(args.hostile)
    except ValueError as exc:
        parser.error(str(exc))
    if not (args.claim_steps >= 1 and args.claim_batch >= 1):
        parser.error("--claim-steps and --claim-batch must be >= 1")
    change = transform(kind, x, seed=args.hostile_seed)
    return learner_main.main(learner_argv, lambda cfg: HostileSyncClient(
        sharded_lib.ShardedSyncClient(cfg), factor=x if kind in ("scale", "signflip") else 1.0, change=change,
        claim_steps=args.claim_steps, claim_batch=args.claim_batch, hide_change=kind == "drift"))


if __name__ == "__main__":
    sys.exit(main())
