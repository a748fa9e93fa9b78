"""The processes `ddiloco bench perf` starts besides the services it measures, one module each,
run as `python -m ddiloco.bench.perf_workers.<name>` by the launcher of `ddiloco up`
(`ddiloco.bench.perf_common`):

* servers, which announce their address in the ready file named by their last argument and serve
  until stopped: `bare` (a gRPC sink of bytes, the transport's limit) and `proxies` (delay lines
  in front of other servers);
* jobs, which take a JSON spec and write a JSON result to a file (`run_job`): `micro` (codec and
  merge on one pinned core) and `replay` (lightweight learners against a syncer).
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Callable


def run_job(job: Callable[[dict], dict]) -> None:
    """`python -m <worker> SPEC_JSON RESULT_PATH`: writes job(spec) to RESULT_PATH as JSON."""
    spec, result_path = json.loads(sys.argv[1]), pathlib.Path(sys.argv[2])
    result_path.write_text(json.dumps(job(spec)))
