"""The learner's persistent compilation cache (train.enable_compilation_cache, --compilation-cache-dir).

Each case runs fresh interpreters (JAX reads the cache at compile time, once per process), counts
JAX's own cache events, and checks that a cached program computes the same loss as a compiled one.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from services.learner import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# What a learner compiles at start: the jitted init (services/learner/__main__._initial_fragments),
# the optimizer init and one inner step of the tiny model.
_CHILD = """
import json, sys
import jax, numpy as np
from jax import monitoring
from services.learner import train as train_lib
train_lib.enable_compilation_cache(sys.argv[1])
events = {"hits": 0, "misses": 0}
def on_event(name, **kwargs):
    if name == "/jax/compilation_cache/cache_hits":
        events["hits"] += 1
    elif name == "/jax/compilation_cache/cache_misses":
        events["misses"] += 1
monitoring.register_event_listener(on_event)
from ddiloco import models
model = models.get_model("transformer", {"preset": "tiny"})
params = {k: np.asarray(v) for k, v in jax.jit(model.init)(jax.random.PRNGKey(1)).items()}
step = train_lib.TrainStep(model, train_lib.make_inner_optimizer(train_lib.InnerOptConfig(learning_rate=1e-3)))
batch = np.random.default_rng(0).integers(0, 200, size=(4, model.seq_len + 1), dtype=np.int32)
_, _, loss = step(params, step.init_opt_state(params), batch)
print(json.dumps({**events, "loss": float(loss)}))
"""


def _start(cache_dir: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(cache_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_start_loads_every_program_and_computes_the_same_loss(tmp_path):
    cold = _result(_start(tmp_path))
    assert cold["hits"] == 0 and cold["misses"] >= 3  # init, optimizer init, the step
    assert any(tmp_path.iterdir()), "nothing was written to the cache"
    warm = _result(_start(tmp_path))
    assert warm["misses"] == 0
    assert warm["hits"] >= cold["misses"]
    assert warm["loss"] == cold["loss"]


def test_learners_starting_together_share_a_cold_directory(tmp_path):
    # Two processes compile and write the same entries at once (the file lock orders them); both
    # work, and a third start finds everything.
    first, second = _start(tmp_path), _start(tmp_path)
    results = [_result(first), _result(second)]
    assert results[0]["loss"] == results[1]["loss"]
    third = _result(_start(tmp_path))
    assert third["misses"] == 0 and third["loss"] == results[0]["loss"]


def test_the_flag_and_its_environment_variable():
    parse = config_lib.parse_learner_config
    assert parse([], {}, "host").compilation_cache_dir == ""
    assert parse(["--compilation-cache-dir", "/var/cache/x"], {}, "host").compilation_cache_dir == "/var/cache/x"
    env = {"DDILOCO_LEARNER_COMPILATION_CACHE_DIR": "/cache"}
    assert parse([], env, "host").compilation_cache_dir == "/cache"


_NUMBA_CHILD = """
import sys
import numpy as np
import services.learner.__main__ as learner_main
from services.learner import config as config_lib
cfg = config_lib.parse_learner_config(["--learner-id", "l0", "--compilation-cache-dir", sys.argv[1],
                                      "--upload-encoder", "jax"], {})
encode = learner_main._upload_encoder(cfg)
encoded = encode(np.linspace(-1, 1, 1000, dtype=np.float32), "int4")
print(encode.__module__, "numba" in sys.modules, len(encoded.payload))
"""


def test_a_learner_with_a_compilation_cache_never_loads_numba(tmp_path):
    """With --upload-encoder jax the learner encodes uploads with jax_codec (same bytes, see
    tests/unit/test_jax_codec.py): numba's import and kernel loading (~0.5 CPU-s) leave a restart."""
    out = subprocess.run([sys.executable, "-c", _NUMBA_CHILD, str(tmp_path / "cache")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out[:2] == ["ddiloco.wire.jax_codec", "False"] and int(out[2]) > 0
