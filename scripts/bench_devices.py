"""Inner-step throughput of one learner over 1, 2, 4 ... (virtual) devices, as JSON.

    python scripts/bench_devices.py [--devices 1,2,4] [--preset small] [--batch 16] [--steps 20]
                                    [--repeat 5] [--xla-flags=--xla_cpu_multi_thread_eigen=false]
                                    [--out bench_devices.json]

Each device count runs in its own process (JAX fixes the device count at start) on CPU with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`, through the learner's own `TrainStep`
over a data-parallel mesh (N = 1: the plain single-device jit). The global batch is the same for
every N, so the numbers compare the same work. On a CPU the virtual devices share the same cores:
expect no speed-up (the point there is correctness); on GPUs run it with real devices
(`--platform cuda --devices 1,2,4,8`: the first N GPUs) to see the scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def child(devices: int, preset: str, batch: int, steps: int, warmup: int) -> dict:
    import jax
    import numpy as np

    from ddiloco.data import BatchSampler
    from ddiloco.models import get_model
    from services.learner import distributed
    from services.learner import train as train_lib

    unit = distributed.init_unit(num_devices=devices, batch_size=batch)
    model = get_model("transformer", {"preset": preset})
    step = train_lib.TrainStep(model, train_lib.make_inner_optimizer(train_lib.InnerOptConfig()), unit.mesh)
    params = step.place_params({k: np.asarray(v) for k, v in model.init(jax.random.key(0)).items()})
    opt_state = step.init_opt_state(params)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, size=1 << 20).astype(np.int32)
    sampler = BatchSampler(tokens, batch, model.seq_len, seed=0)
    compile_started = time.perf_counter()
    for _ in range(warmup):
        params, opt_state, _ = step(params, opt_state, sampler.next())
    compile_s = time.perf_counter() - compile_started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, sampler.next())  # float(loss) waits
        times.append(time.perf_counter() - started)
    median = float(np.median(times))
    return {
        "devices": unit.num_devices, "platform": unit.devices[0].platform, "preset": preset, "global_batch": batch,
        "tokens_per_step": sampler.tokens_per_batch, "steps": steps, "median_step_s": round(median, 5),
        "mean_step_s": round(float(np.mean(times)), 5), "tokens_per_s": round(sampler.tokens_per_batch / median, 1),
        "warmup_s": round(compile_s, 2), "final_loss": round(float(loss), 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="1,2,4")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS: cpu (virtual devices via XLA_FLAGS) or cuda, tpu (the first N real devices)")
    parser.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for every run")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the device counts this many times, interleaved; report the median run")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.preset, args.batch, args.steps, args.warmup)))
        return 0
    runs: dict[int, list[dict]] = {}
    for _ in range(args.repeat):
        for n in (int(x) for x in args.devices.split(",")):
            env = dict(os.environ)
            env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
            env["JAX_PLATFORMS"] = args.platform
            if args.platform == "cpu":
                # The device count first: XLA stops reading XLA_FLAGS at a token that is not a flag.
                env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n} {args.xla_flags}".strip()
            elif args.xla_flags:
                env["XLA_FLAGS"] = args.xla_flags
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(n), "--preset", args.preset, "--batch", str(args.batch),
                 "--steps", str(args.steps), "--warmup", str(args.warmup)],
                env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT,
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            result["xla_flags"] = env.get("XLA_FLAGS", "")
            result["load_avg_1m"] = round(os.getloadavg()[0], 2)
            runs.setdefault(n, []).append(result)
            print(json.dumps(result), file=sys.stderr)
    results = []
    for attempts in runs.values():
        best = sorted(attempts, key=lambda r: r["median_step_s"])[len(attempts) // 2]
        results.append({**best, "runs_tokens_per_s": [r["tokens_per_s"] for r in attempts]})
    report = {"cpu_count": os.cpu_count(), "results": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
