"""A hostile learner for fault tests (fault-matrix row 21): the normal learner, every upload corrupted.

    python -m ddiloco.chaos.hostile_learner --hostile scale:1e4 <ddiloco learner flags>

runs services.learner's main with a `HostileSyncClient`: the learner trains as usual and its own
state stays honest, but each pseudo-gradient is multiplied by the factor on its way to the wire
("scale:<x>": x, "signflip": -1), before it is encoded. What the syncer must do with such a
learner is in docs/security.md; tests/security/test_hostile_run.py runs it against honest ones.
The production learner has no such knob: this module is the only way to get one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence

import numpy as np

from services.learner import __main__ as learner_main
from services.learner import client as client_lib

_USAGE = "python -m ddiloco.chaos.hostile_learner --hostile {signflip,scale:<x>} <ddiloco learner flags>"


def parse_hostile(spec: str) -> float:
    """The factor a hostile learner multiplies its pseudo-gradients by: "signflip" -> -1.0,
    "scale:<x>" -> x (finite, nonzero). ValueError otherwise."""
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


def corrupting(encode: Callable[..., object], factor: float) -> Callable[..., object]:
    """`encode` (codec.encode's signature) applied to `factor` x the values: the syncer decodes the
    corrupted values, and the client's record of what was sent (UploadJob.sent_values) holds them too."""
    scale = np.float32(factor)

    def encode_corrupted(values: np.ndarray, *args, **kwargs):
        return encode((np.asarray(values, np.float32) * scale).astype(np.float32), *args, **kwargs)

    return encode_corrupted


class HostileSyncClient(client_lib.SyncClient):
    """A SyncClient whose every upload carries `factor` x the pseudo-gradient the loop submitted."""

    def __init__(self, cfg: client_lib.ClientConfig, *, factor: float) -> None:
        super().__init__(dataclasses.replace(cfg, encode=corrupting(cfg.encode, factor)))
        self.factor = factor


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddiloco.chaos.hostile_learner", usage=_USAGE, add_help=False, allow_abbrev=False,
        description="TESTS AND CHAOS ONLY: a learner that corrupts every pseudo-gradient before upload. "
                    "Every other flag is the learner's (`ddiloco learner --help`).")
    parser.add_argument("--hostile", required=True, metavar="{signflip,scale:<x>}",
                        help="signflip negates each upload; scale:<x> multiplies it by x (e.g. scale:1e4)")
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
        factor = parse_hostile(args.hostile)
    except ValueError as exc:
        parser.error(str(exc))
    return learner_main.main(learner_argv, lambda cfg: HostileSyncClient(cfg, factor=factor))


if __name__ == "__main__":
    sys.exit(main())
