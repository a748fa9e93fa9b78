"""A hostile learner for fault tests (fault-matrix row 21): the normal learner, every upload corrupted.

    python -m ddiloco.chaos.hostile_learner --hostile scale:1e4 <ddiloco learner flags>
    python -m ddiloco.chaos.hostile_learner --hostile noise:19 --claim-steps 4 --claim-batch 20 <flags>

runs services.learner's main with a `HostileSyncClient`: the learner trains as usual and its own
state stays honest, but each pseudo-gradient v is changed on its way to the wire, before it is
encoded (`BEHAVIOURS`): "scale:<x>" sends x v, "signflip" -v, "noise:<x>" Gaussian noise of norm
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
import asyncio
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from ddiloco.learner import client as client_lib
from ddiloco.learner import uploads as uploads_lib
from ddiloco.cli import service_names
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


def corrupting(encode: Callable[..., object], factor: float | Callable[[np.ndarray], np.ndarray]) -> Callable[..., object]:
    """`encode` (codec.encode's signature) applied to `factor` x the values (or to `factor(values)`):
    the syncer decodes the corrupted values, and the client's record of what was sent
    (UploadJob.sent_values) holds them too."""
    if callable(factor):
        change = factor
    else:
        scale = np.float32(factor)

        def change(values: np.ndarray) -> np.ndarray:
            return values * scale

    def encode_corrupted(values: np.ndarray, *args, **kwargs):
        return encode(np.asarray(change(np.asarray(values, np.float32)), np.float32), *args, **kwargs)

    return encode_corrupted


class HostileSyncClient(client_lib.SyncClient):
    """A SyncClient whose every upload carries `factor` x the pseudo-gradient the loop submitted
    (or `change` of it), and whose headers claim `claim_steps` x the steps and `claim_steps` x
    `claim_batch` x the tokens."""

    def __init__(self, cfg: client_lib.ClientConfig, *, factor: float = 1.0,
                 change: Callable[[np.ndarray], np.ndarray] | None = None,
                 claim_steps: float = 1.0, claim_batch: float = 1.0, hide_change: bool = False) -> None:
        super().__init__(dataclasses.replace(cfg, encode=corrupting(cfg.encode, change or factor)))
        self._honest_encode = cfg.encode
        self.hide_change = hide_change  # sent_values: the honest values as encoded (module docstring: drift)
        self.factor = factor
        self.claim_steps = claim_steps
        self.claim_batch = claim_batch

    def submit_upload(self, job: client_lib.UploadJob) -> None:
        if self.claim_steps != 1.0 or self.claim_batch != 1.0:
            job = dataclasses.replace(job, steps=max(1, round(job.steps * self.claim_steps)),
                                      tokens=round(job.tokens * self.claim_steps * self.claim_batch))
        super().submit_upload(job)

    async def _encode(self, job: uploads_lib.UploadJob) -> list | None:
        messages = await super()._encode(job)
        if messages is not None and self.hide_change and job.sent_values is not None:
            # A lossy codec: the record the rebase reads is what an honest upload would have decoded
            # to. (Lossless: sent_values stays None and the rebase reads the honest delta itself.)
            cfg = self.run_config
            honest = await asyncio.to_thread(self._honest_encode, job.delta, serde.codec_from_proto(cfg.upload_codec),
                                             block_size=cfg.upload_block_size, zstd_level=cfg.zstd_level)
            job.sent_values = await asyncio.to_thread(serde.decode_payload, serde.payload_info_to_proto(honest),
                                                      honest.payload)
        return messages


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
        cfg, factor=x if kind in ("scale", "signflip") else 1.0, change=change,
        claim_steps=args.claim_steps, claim_batch=args.claim_batch, hide_change=kind == "drift"))


if __name__ == "__main__":
    sys.exit(main())
