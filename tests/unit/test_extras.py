"""Without the optional extras (ddiloco/extras.py): the kernels fall back to numpy and give the
compiled bytes, and every feature that needs an absent extra fails naming the extra to install.

A child interpreter refuses to import numba, matplotlib, cryptography and aetcd, as an install
of the bare wheel would."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import numpy as np

from ddiloco.algo import _kernels as algo_kernels
from ddiloco.wire import codec

BLOCKED = ("numba", "matplotlib", "cryptography", "aetcd")

CHILD = textwrap.dedent(f"""
    import hashlib, json, sys
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {BLOCKED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (refused by the test)", name=name)
    sys.meta_path.insert(0, Refuse())

    import numpy as np
    from ddiloco import _jit
    from ddiloco.algo import _kernels as algo_kernels
    from ddiloco.wire import _kernels as wire_kernels, codec
    from tests.unit.test_extras import fixed_inputs, step_digest

    values, step_args = fixed_inputs()
    out = {{"compiled": _jit.COMPILED, "modules": [algo_kernels.scaled_sgd_step.__module__,
                                                  wire_kernels.quantize_int4.__module__]}}
    out["payloads"] = [hashlib.sha256(codec.encode(values, c).payload).hexdigest() for c in ("int4", "int8")]
    encoded = codec.encode(values, "int4")
    decoded = codec.decode(encoded.payload, codec="int4", numel=values.size, raw_size_bytes=encoded.raw_size_bytes,
                           checksum=encoded.checksum, compression=encoded.compression,
                           checksum_kind=encoded.checksum_kind)
    out["decoded"] = hashlib.sha256(np.asarray(decoded).tobytes()).hexdigest()
    out["step"] = step_digest(algo_kernels)

    def error(call):
        try:
            call()
        except ImportError as exc:
            return str(exc)
        return "no error"

    from ddiloco import extras
    from ddiloco.cli import certs
    from ddiloco.coord import etcd
    out["plots"] = error(extras.pyplot)
    out["certificates"] = error(certs.make_ca)
    out["etcd"] = error(lambda: etcd.Etcd(["127.0.0.1:2379"]))
    from ddiloco.cli import main
    try:
        main.main(["--help"])  # the parser builds without cryptography
    except SystemExit as exc:
        out["help_exit"] = exc.code
    out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
    print(json.dumps(out))
""")


def fixed_inputs():
    rng = np.random.default_rng(11)
    values = (rng.standard_normal(200_003) * 0.01).astype(np.float32)
    n = 70_000
    step_args = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    return values, step_args


def step_digest(kernels) -> str:
    _, (sums, params, buf) = fixed_inputs()
    n = sums.size
    bounds = np.array([0, 1000, 40_000, n], np.int64)
    outs = [np.empty(n, np.float32) for _ in range(3)]
    rule = (np.float32(0.9), np.float32(-0.7), np.float32(0.9), np.float32(1.0))
    kernels.scaled_sgd_step(sums, bounds, np.array([0.5, 1.0, 2.0], np.float32), (params, buf), tuple(outs), rule,
                            True, True)
    return hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()


def test_without_the_extras(tmp_path):
    from tests.unit.test_layers import ROOT

    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["compiled"] is False and out["loaded"] == []
    assert out["modules"] == ["ddiloco.algo._kernels_numpy", "ddiloco.wire._kernels_numpy"]
    # The same bytes as this process's compiled kernels.
    values, _ = fixed_inputs()
    assert out["payloads"] == [hashlib.sha256(codec.encode(values, c).payload).hexdigest() for c in ("int4", "int8")]
    assert algo_kernels.scaled_sgd_step.__module__ == "ddiloco.algo._kernels"  # compiled here
    assert out["step"] == step_digest(algo_kernels)
    encoded = codec.encode(values, "int4")
    decoded = codec.decode(encoded.payload, codec="int4", numel=values.size, raw_size_bytes=encoded.raw_size_bytes,
                           checksum=encoded.checksum, compression=encoded.compression,
                           checksum_kind=encoded.checksum_kind)
    assert out["decoded"] == hashlib.sha256(np.asarray(decoded).tobytes()).hexdigest()
    # Each feature names its extra.
    for extra, package in (("plots", "matplotlib"), ("certificates", "cryptography"), ("etcd", "aetcd")):
        assert f"pip install 'ddiloco[{extra}]'" in out[extra] and repr(package) in out[extra], out[extra]
    assert out["help_exit"] == 0
