"""`ddiloco up` on the user's own data, as a user runs it (real processes, the tiny model, bounded):
a directory of plain-text files (not Python source) with a named held-out directory and a size cap
that truncates it, and a nanoGPT directory of uint32 tokens (train.bin / val.bin). Each run's
held-out loss falls; bad data is refused before any process starts."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]
_WORDS = ("the quick brown fox jumps over a lazy dog while seven old sailors sing about rain on green hills "
          "and every morning the baker sells warm bread to children who laugh near the river").split()
_VOCAB = 512
# Inner steps per learner: the global model lags the learners by the merges in flight, and at 60
# steps its held-out loss on text fell by 0.9 to 3.5 nats/byte between runs (40 steps: once 0.06).
_STEPS = 80


def _prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 12))]
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out) + "\n"


def _text_tree(root, count: int, seed: int) -> int:
    """Plain-text documents under nested folders with assorted extensions; returns their bytes."""
    rng = random.Random(seed)
    total = 0
    for i in range(count):
        folder = root / f"part{i % 3}" / ("notes" if i % 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        text = _prose(rng, rng.randint(15, 30))
        (folder / f"doc{i:03d}{('.txt', '.md', '')[i % 3]}").write_text(text)
        total += len(text)
    return total


def _up(tmp_path, cache, data_flags: list[str], name: str, cwd=None) -> tuple[subprocess.CompletedProcess, dict]:
    """`ddiloco up` to the end; its learners on the session's compilation cache (`cache`,
    tests/conftest.py) instead of one per test: the same programs, compiled once per session."""
    workdir = tmp_path / name
    result = subprocess.run(
        [*_DDILOCO, "up", "--preset", "tiny", "--learners", "2", "--steps", str(_STEPS), "--sync-period-steps", "4",
         "--no-live", "--eval-interval-s", "3", "--workdir", str(workdir), "--summary-json", str(tmp_path / "s.json"),
         "--compilation-cache-dir", str(cache), *data_flags],
        capture_output=True, text=True, timeout=280, cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((tmp_path / "s.json").read_text())


def test_up_trains_on_a_directory_of_plain_text_with_a_named_heldout_set(tmp_path, learner_compilation_cache):
    data, heldout = tmp_path / "my-texts", tmp_path / "my-heldout"
    data_bytes = _text_tree(data, 90, seed=1)
    _text_tree(heldout, 8, seed=2)
    (data / "part0" / "cover.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(range(256)) * 4)
    (data / ".git").mkdir()
    (data / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    cap = data_bytes * 2 // 3
    result, summary = _up(tmp_path, learner_compilation_cache, ["--data-dir", str(data), "--heldout-dir", str(heldout),
                                     "--max-corpus-bytes", str(cap)], "text")
    out = " ".join(result.stdout.split())  # rich wraps long lines
    assert f"data: {data} (held out: {heldout}): " in out
    assert "shard 0 of 2: " in out and "shard 1 of 2: " in out and "held out: 8 documents" in out
    assert "skipped 1 binary file (" in out and "part0/cover.jpg" in out
    assert f"max_corpus_bytes={cap:,} truncated the data" in out
    # The held-out loss of the global model falls (nats per byte: ln 256 = 5.5 at the start).
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"] - 0.5, summary
    assert summary["data"] == str(data) and summary["loss_unit"] == "nats/byte"
    assert [ls["steps"] for ls in summary["learners"]] == [_STEPS, _STEPS]
    # Every learner and the evaluator loaded the same data: each learner logs its own shard and the
    # truncation warning; the evaluator measures the named held-out directory.
    logs = tmp_path / "text" / "logs"
    for i in range(2):
        log = (logs / f"learner-{i}.log").read_text()
        assert f"shard {i} of 2: " in log and "(this learner's)" in log and "truncated the data" in log
    evaluator_log = (logs / "evaluator.log").read_text()
    assert f"(held out: {heldout})" in evaluator_log and "held out: 8 documents" in evaluator_log


def _token_stream(length: int, seed: int) -> np.ndarray:
    # A learnable sequence over 512 ids: a fixed random cycle of 97 tokens with 10% noise.
    rng = np.random.default_rng(0)
    cycle = rng.integers(0, _VOCAB, size=97)
    tokens = np.resize(cycle, length)
    noise = np.random.default_rng(seed).random(length) < 0.1
    tokens[noise] = rng.integers(0, _VOCAB, size=int(noise.sum()))
    tokens[0] = _VOCAB - 1  # the largest id: the model's vocabulary is sized from the data
    return tokens


def test_up_trains_on_uint32_token_files(tmp_path, learner_compilation_cache):
    data = tmp_path / "tokens"
    data.mkdir()
    _token_stream(200_000, seed=1).astype("<u4").tofile(data / "train.bin")
    _token_stream(20_000, seed=2).astype("<u4").tofile(data / "val.bin")
    result, summary = _up(tmp_path, learner_compilation_cache, ["--data-dir", str(data), "--token-dtype", "uint32"], "tokens")
    out = " ".join(result.stdout.split())
    assert f"data: {data} (held out: val.bin), uint32: 200,000 training tokens, 20,000 held out" in out
    assert "model vocab_size 512" in out  # from the data's largest id, 511
    assert "shard 0 of 2: 100,000 tokens" in out and "held out: 20,000 tokens" in out
    assert summary["loss_unit"] == "nats/token"
    assert summary["heldout_loss_start"] > math.log(_VOCAB) - 0.5, summary  # near ln 512 = 6.24 at the start
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"] - 1.0, summary


_FACTORY = """
import random

WORDS = {words!r}


def stories(seed=0):
    rng = random.Random(seed)
    for _ in range(200):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80))) + "."


def corpus():
    return {{"train": stories(1), "heldout": list(stories(2))[:10]}}
"""


def test_up_trains_on_what_a_data_source_factory_yields(tmp_path, learner_compilation_cache):
    # The module lives in the directory `ddiloco up` runs in; the services (which run in the
    # workdir) import it too.
    (tmp_path / "my_corpus.py").write_text(_FACTORY.format(words=_WORDS))
    result, summary = _up(tmp_path, learner_compilation_cache, ["--data-source", "my_corpus:corpus"], "run", cwd=tmp_path)
    assert "data: my_corpus:corpus: 200 files" in result.stdout and "held out: 10 documents" in result.stdout
    assert summary["heldout_loss_end"] < summary["heldout_loss_start"] - 0.5, summary
    assert [ls["steps"] for ls in summary["learners"]] == [_STEPS, _STEPS]
    assert "held out: 10 documents" in (tmp_path / "run" / "logs" / "evaluator.log").read_text()


def test_up_refuses_bad_data_before_starting_anything(tmp_path):
    data = tmp_path / "tokens"
    data.mkdir()
    _token_stream(5_000, seed=1).astype("<u4").tofile(data / "train.bin")
    cases = [
        ([], "every second uint16 value is 0, as when uint32 tokens are read as uint16: pass --token-dtype uint32"),
        (["--token-dtype", "uint32", "--vocab-size", "300"], "the model's vocab_size is 300"),
        (["--token-dtype", "int8"], "token_dtype='int8' is unknown"),
    ]
    for extra, message in cases:
        workdir = tmp_path / "never"
        result = subprocess.run([*_DDILOCO, "up", "--data-dir", str(data), "--workdir", str(workdir), *extra],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert message in " ".join(result.stdout.split()), result.stdout
        assert not workdir.exists()  # nothing was started
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run([*_DDILOCO, "up", "--data-dir", str(empty), "--workdir", str(tmp_path / "never")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "has no non-empty text files: add some text" in result.stdout
