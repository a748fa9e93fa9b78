"""What every section of `ddiloco bench perf` shares: timing (best of interleaved repeats,
percentiles), the processes it measures or hands work to, and readings of them from /proc.

Every process is started by the launcher of `ddiloco up` (`ddiloco.cli.cluster.ServiceProcess`:
`python -m <module>` in the benchmark's working directory, its output in logs/<name>.log, stopped
by PID). Servers (a syncer, the bare gRPC sink, proxies) announce their address in a ready file;
a worker of `ddiloco.bench.perf_workers` runs one job and writes its JSON result to a file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ddiloco.cli import cluster as cluster_lib
from ddiloco.cli import processes as processes_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def now() -> float:
    return time.perf_counter()


def interleaved_best(fns: dict[str, Callable[[], object]], repeats: int, min_time_s: float = 0.0) -> dict[str, float]:
    """Best wall time of each function, run interleaved (a, b, a, b, ...) so that both see the
    same machine load; at least `repeats` rounds and, if given, at least `min_time_s` in total."""
    best = {k: math.inf for k in fns}
    started = now()
    rounds = 0
    while rounds < repeats or (now() - started < min_time_s and rounds < repeats * 10):
        for key, fn in fns.items():
            t0 = now()
            fn()
            best[key] = min(best[key], now() - t0)
        rounds += 1
    return best


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


def process_env() -> dict[str, str]:
    """The environment of every process the benchmark starts: plaintext on loopback, one XLA
    compute thread (a user-set XLA_FLAGS is kept), this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["DDILOCO_INSECURE"] = "1"
    return env


def start_server(workdir: pathlib.Path, name: str, module: str, args: Sequence[str],
                 timeout_s: float) -> cluster_lib.ServiceProcess:
    """Starts `python -m module *args` and waits for its ready file (`<workdir>/<name>.ready.json`,
    the path the caller passes it in `args`); stops it if it never gets ready."""
    svc = cluster_lib.ServiceProcess(name=name, module=module, args=list(args), workdir=workdir, env=process_env())
    svc.start()
    try:
        svc.wait_ready(timeout_s)
    except BaseException:
        svc.stop()
        raise
    return svc


def ready_path(workdir: pathlib.Path, name: str) -> str:
    """Where the process `name` announces itself (ServiceProcess.ready_file)."""
    return str(workdir / f"{name}.ready.json")


@contextlib.contextmanager
def running(svc: cluster_lib.ServiceProcess) -> Iterator[cluster_lib.ServiceProcess]:
    try:
        yield svc
    finally:
        svc.stop()


def start_syncer(workdir: pathlib.Path, name: str, model: dict, extra: Sequence[str] = (),
                 timeout_s: float = 180.0) -> cluster_lib.ServiceProcess:
    return start_server(workdir, name, "services.syncer", [
        "--bind", "127.0.0.1:0", "--run-id", f"bench-{name}", "--ready-file", ready_path(workdir, name),
        "--model-config", json.dumps(model), "--log-level", "WARNING", *extra,
    ], timeout_s)


@contextlib.contextmanager
def running_syncer(workdir: pathlib.Path, name: str, model: dict,
                   extra: Sequence[str] = ()) -> Iterator[cluster_lib.ServiceProcess]:
    with running(start_syncer(workdir, name, model, extra)) as svc:
        yield svc


@contextlib.contextmanager
def running_syncer_shards(workdir: pathlib.Path, name: str, model: dict, shards: int, extra: Sequence[str] = (),
                          one_at_a_time: bool = False) -> Iterator[list[cluster_lib.ServiceProcess]]:
    """`shards` syncer processes splitting the fragments (fragment shards: the same run id and
    shard map, `--fragment-shard I`), in shard order; shard 0 is where learners are pointed. One
    shard is a plain syncer. `one_at_a_time`: each shard is ready before the next starts (every
    shard builds the whole model's initial parameters: at 1B parameters, several GB each at once)."""
    if shards <= 1:
        with running_syncer(workdir, name, model, extra) as svc:
            yield [svc]
        return
    addresses = [f"127.0.0.1:{processes_lib.preset_port()}" for _ in range(shards)]
    started: list[cluster_lib.ServiceProcess] = []
    try:
        for index, address in enumerate(addresses):
            shard_name = f"{name}-shard{index}"
            svc = cluster_lib.ServiceProcess(name=shard_name, module="services.syncer", workdir=workdir,
                                             env=process_env(), args=[
                "--bind", address, "--run-id", f"bench-{name}", "--ready-file", ready_path(workdir, shard_name),
                "--model-config", json.dumps(model), "--log-level", "WARNING",
                "--fragment-shard", str(index), "--fragment-shards", ",".join(addresses), *extra])
            svc.start()
            started.append(svc)
            if one_at_a_time:
                svc.wait_ready(600.0)
        for svc in started:
            svc.wait_ready(600.0 if one_at_a_time else 180.0)
        yield started
    finally:
        for svc in started:
            svc.stop()


def _result_path(workdir: pathlib.Path, name: str) -> pathlib.Path:
    return workdir / f"{name}.result.json"


def start_worker(workdir: pathlib.Path, name: str, module: str, spec: dict) -> cluster_lib.ServiceProcess:
    """Starts a worker of ddiloco.bench.perf_workers on `spec`; `worker_result` collects it."""
    result = _result_path(workdir, name)
    result.unlink(missing_ok=True)
    svc = cluster_lib.ServiceProcess(name=name, module=module, args=[json.dumps(spec), str(result)], workdir=workdir,
                                     env=process_env())
    svc.start()
    return svc


def worker_result(svc: cluster_lib.ServiceProcess, timeout_s: float) -> dict:
    """The JSON result of a worker once it exits; stops it if it runs over `timeout_s`."""
    code = svc.wait(timeout_s)
    if code is None:
        svc.stop(5.0)
        raise RuntimeError(f"benchmark worker {svc.name} did not finish within {timeout_s:.0f} s:\n{svc.log_tail()}")
    if code != 0:
        raise RuntimeError(f"benchmark worker {svc.name} failed ({code}):\n{svc.log_tail(60)}")
    return json.loads(_result_path(svc.workdir, svc.name).read_text())


def run_worker(workdir: pathlib.Path, name: str, module: str, spec: dict, timeout_s: float) -> dict:
    return worker_result(start_worker(workdir, name, module, spec), timeout_s)


def vm_hwm_bytes(pid: int) -> int:
    """Peak resident set size of a process (VmHWM), in bytes."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
