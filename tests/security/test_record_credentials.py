"""`ddiloco record` under mutual TLS: it records with a reader certificate, and without one (or with a
learner's) it stops at once, exit 2, with the message naming the flags to pass (the same
explanations as `ddiloco status`), no retries and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.security.conftest import reader_flags

pytestmark = pytest.mark.timeout(180)

_DDILOCO = [sys.executable, "-m", "ddiloco.cli.main"]




def _record(address: str, out, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_DDILOCO, "record", "--target", address, "--out", str(out), "--interval-s", "0.2",
                           "--duration-s", "2", "--retry-for-s", "30", *flags], capture_output=True, text=True,
                          timeout=60)


def test_record_reads_with_a_reader_certificate_and_explains_every_refusal(mtls_syncer, pki, tmp_path):
    ok = _record(mtls_syncer.address, tmp_path / "ok", *reader_flags(pki))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    records = [json.loads(line) for line in (tmp_path / "ok" / "state.jsonl").read_text().splitlines()]
    assert records and {r["run"] for r in records} == {"security"}
    assert (tmp_path / "ok" / "final_state.json").exists()
    for what, (flags, hint) in {
        "plaintext": ((), "probably serves mutual TLS"),
        "a learner's certificate": (reader_flags(pki, "learner-0"), "refused these credentials"),
    }.items():
        result = _record(mtls_syncer.address, tmp_path / what, *flags)
        out = result.stdout + result.stderr
        # --retry-for-s 30 and --duration-s 2: exit 2 with the hint means it did not retry.
        assert result.returncode == 2 and hint in out and "Traceback" not in out, (what, out)
        assert "retrying" not in out and not (tmp_path / what).exists(), (what, out)
