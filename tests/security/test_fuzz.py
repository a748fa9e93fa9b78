"""The atheris fuzz target of the fragment decoder: a short run in CI (about 10 s), a longer one on
demand (`make fuzz FUZZ_SECONDS=3600`). A crash, an unexpected exception, a hang (-timeout) or
runaway memory (-rss_limit_mb) fails the run."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

TARGET = pathlib.Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_codec.py"

pytestmark = pytest.mark.timeout(180)


def _load_target():
    spec = importlib.util.spec_from_file_location("fuzz_codec", TARGET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed_inputs_decode_and_mutants_fail_cleanly():
    target = _load_target()
    seeds = target.seed_inputs()
    assert len(seeds) >= 40
    for seed in seeds:
        target.test_one_input(seed)
        for cut in (len(seed) // 2, len(seed) - 1):
            target.test_one_input(seed[:cut])
        flipped = bytearray(seed)
        flipped[-1] ^= 0x55
        target.test_one_input(bytes(flipped))


def test_short_fuzzing_run_finds_nothing(tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    subprocess.run([sys.executable, str(TARGET), "--make-seeds", str(corpus)], check=True, timeout=60)
    result = subprocess.run(
        [sys.executable, str(TARGET), "-max_total_time=10", "-timeout=10", "-rss_limit_mb=2048",
         f"-artifact_prefix={tmp_path}/", str(corpus)],
        capture_output=True, text=True, timeout=150, cwd=tmp_path,
    )
    tail = "\n".join((result.stdout + result.stderr).splitlines()[-30:])
    assert result.returncode == 0, tail
    assert "Done" in result.stderr, tail
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*")), tail
