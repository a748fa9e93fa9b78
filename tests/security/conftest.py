"""Fixtures for the security tests: a development PKI, and an in-process syncer + checkpoint store.

`Harness` runs a real SyncerCore, SyncerServicer, AuthInterceptor, checkpoint store and the
syncer's own checkpointer on an asyncio loop in a background thread, served by real gRPC servers
on 127.0.0.1:0 (plaintext, mutual TLS or bearer tokens). Tests talk to it with ordinary blocking
stubs, as a learner across the WAN would, and read state through `harness.call(...)` (run on the
server's loop). The model is a small synthetic fragment plan, so no JAX model is built.
`hostile_core` is the same plan in a SyncerCore without gRPC, for the hostile-learner checks.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import pathlib
import threading
from collections.abc import Callable, Sequence

import grpc
import numpy as np
import pytest
import zstandard

from ddiloco import checkpoint_client as checkpoint_client_lib
from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.cli import certs as certs_lib
from ddiloco.rpc import channel as channel_lib
from ddiloco.rpc import security
from ddiloco.rpc import server as server_lib
from ddiloco.v1 import checkpoint_pb2_grpc, common_pb2, syncer_pb2, syncer_pb2_grpc
from ddiloco.wire import codec as codec_lib
from ddiloco.wire import serde
from services.checkpoint import servicer as store_servicer_lib
from services.checkpoint import store as store_lib
from services.syncer import config as syncer_config_lib
from services.syncer import core as core_lib
from services.syncer import servicer as servicer_lib
from services.syncer import wire_views
from tests import fakes, waits

LEARNERS = ("learner-0", "learner-1", "learner-2", "learner-3")
SERVICES = ("syncer", "checkpoint", "evaluator", "operator")

# Fragment 0: a 128x256 matrix (32 768 values, 128 KiB in fp32); fragment 1: an embedding, a
# 32x64 matrix and a bias (4 352 values).
SPECS = [
    fragments_lib.TensorSpec("w", (128, 256)),
    fragments_lib.TensorSpec("b", (256,)),
    fragments_lib.TensorSpec("emb", (64, 32), is_embedding=True),
    fragments_lib.TensorSpec("v", (32, 64)),
]
CHUNK = 16 * 1024


# ------------------------------------------------------------------------------------ PKI


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> pathlib.Path:
    """ca.pem + a certificate per learner and service, tokens.json, plus hostile extras:
    `expired.*` (learner-0, expired), `rogue.*` (learner-0 signed by another CA), `nobody.*`
    (signed by our CA but without a ddiloco identity)."""
    d = tmp_path_factory.mktemp("pki")
    certs_lib.write_dev_certs(d, learners=LEARNERS, services=SERVICES, tokens=True)
    ca_pem, ca_key = (d / "ca.pem").read_bytes(), (d / "ca.key").read_bytes()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert, key = certs_lib.issue_cert(ca_pem, ca_key, security.Identity("learner", "learner-0"),
                                     not_before=now - datetime.timedelta(days=30),
                                     not_after=now - datetime.timedelta(days=1))
    (d / "expired.pem").write_bytes(cert)
    (d / "expired.key").write_bytes(key)
    other_ca, other_key = certs_lib.make_ca("not the ddiloco CA")
    cert, key = certs_lib.issue_cert(other_ca, other_key, security.Identity("learner", "learner-0"))
    (d / "rogue.pem").write_bytes(cert)
    (d / "rogue.key").write_bytes(key)
    _write_cert_without_identity(d, ca_pem, ca_key)
    return d


def _write_cert_without_identity(d: pathlib.Path, ca_pem: bytes, ca_key: bytes) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca = x509.load_pem_x509_certificate(ca_pem)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "learner-0")]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    (d / "nobody.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "nobody.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))


def client_security(pki: pathlib.Path, name: str | None, *, token: str | None = None,
                    tls: bool = True) -> security.ClientSecurity:
    """mTLS as `name` (None: TLS without a client certificate), or plaintext with a token file."""
    if not tls:
        return security.ClientSecurity(insecure=True, auth_token_file=str(pki / f"{token}.token") if token else "")
    return security.ClientSecurity(
        tls_ca=str(pki / "ca.pem"),
        tls_cert=str(pki / f"{name}.pem") if name else "", tls_key=str(pki / f"{name}.key") if name else "",
    )


# ------------------------------------------------------------------------------- harness


class Harness:
    """See the module docstring. `mode`: "plaintext" (anonymous), "mtls" or "tokens"."""

    def __init__(self, root: pathlib.Path, *, mode: str = "plaintext", pki: pathlib.Path | None = None,
                 core_kwargs: dict | None = None, servicer_kwargs: dict | None = None, max_staleness: int = 2,
                 upload_codec: str = "fp32") -> None:
        self.root = root
        self.mode = mode
        self.pki = pki
        self._core_kwargs = core_kwargs or {}
        self._servicer_kwargs = servicer_kwargs or {}
        self._max_staleness = max_staleness
        self._upload_codec = upload_codec
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="harness", daemon=True)
        self.plan = fragments_lib.plan_fragments(SPECS, 2, 2)

    # -- lifecycle
    def __enter__(self) -> Harness:
        self._thread.start()
        self.call(self._start)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call(self._stop, timeout_s=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def call(self, fn: Callable, *args, timeout_s: float = 60.0):
        """Runs `fn(*args)` on the harness loop (awaited if it is a coroutine function)."""

        async def run():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout_s)

    def _server_security(self, name: str) -> security.ServerSecurity:
        if self.mode == "mtls":
            return security.ServerSecurity(tls_ca=str(self.pki / "ca.pem"), tls_cert=str(self.pki / f"{name}.pem"),
                                           tls_key=str(self.pki / f"{name}.key"))
        if self.mode == "tokens":
            return security.ServerSecurity(insecure=True, auth_tokens_file=str(self.pki / "tokens.json"))
        return security.ServerSecurity(insecure=True)

    async def _start(self) -> None:
        # The checkpoint store.
        self.store = store_lib.BlobStore(self.root / "store", retention=store_lib.LatestN(5))
        store_servicer = store_servicer_lib.CheckpointStoreServicer(self.store, chunk_size_bytes=64 * 1024)
        store_sec = self._server_security("checkpoint")
        self.store_handle = await server_lib.start_server(
            "127.0.0.1:0", ["ddiloco.v1.CheckpointStore"],
            [lambda s: checkpoint_pb2_grpc.add_CheckpointStoreServicer_to_server(store_servicer, s)],
            interceptors=[security.AuthInterceptor(store_sec.authenticator(), security.CHECKPOINT_POLICY)],
            credentials=store_sec.credentials(), health_bind="127.0.0.1:0" if self.mode == "mtls" else "",
        )
        # The syncer.
        cfg = syncer_config_lib.SyncerConfig(
            run_id="security", insecure=self.mode != "mtls", num_fragments=2, sync_period_steps=2,
            upload_codec=self._upload_codec, max_staleness_versions=self._max_staleness,
            chunk_size_bytes=CHUNK, checkpoint_every_merges=1_000_000,
            **({"tls_ca": str(self.pki / "ca.pem"), "tls_cert": str(self.pki / "syncer.pem"),
                "tls_key": str(self.pki / "syncer.key")} if self.mode == "mtls" else {}),
            **({"checkpoint_auth_token_file": str(self.pki / "syncer.token")} if self.mode == "tokens" else {}),
        )
        kwargs = {"norm_bound": robust_lib.NormBoundPolicy(), "quarantine_after": 3, **self._core_kwargs}
        self.core = fakes.make_core(config=cfg, specs=SPECS, initial_std=0.02, grace_gamma=0.8, max_grace_s=1.0,
                                    merge_history=64, **kwargs)
        self.store_channel = channel_lib.aio_channel(self.store_handle.address, cfg.checkpoint_security())
        client = checkpoint_client_lib.CheckpointClient(
            self.store_channel, timeout=datetime.timedelta(seconds=5), retry_timeout=datetime.timedelta(seconds=5))
        from services.syncer.__main__ import _Checkpointer

        self.checkpointer = _Checkpointer(self.core, client, cfg)
        self.servicer = servicer_lib.SyncerServicer(
            self.core, max_concurrent_uploads=self._servicer_kwargs.pop("max_concurrent_uploads", 16),
            **{"upload_idle_timeout_s": 2.0, **self._servicer_kwargs})
        sec = self._server_security("syncer")
        self.auth = security.AuthInterceptor(sec.authenticator(), security.SYNCER_POLICY,
                                             on_reject=self.servicer.record_interceptor_refusal)
        self.handle = await server_lib.start_server(
            "127.0.0.1:0", ["ddiloco.v1.Syncer"],
            [lambda s: syncer_pb2_grpc.add_SyncerServicer_to_server(self.servicer, s)],
            interceptors=[self.auth], credentials=sec.credentials(),
            health_bind="127.0.0.1:0" if self.mode == "mtls" else "",
        )
        self.address = self.handle.address
        self.store_address = self.store_handle.address

    async def _stop(self) -> None:
        await self.handle.stop(0)
        await self.store_handle.stop(0)
        await self.store_channel.close()

    # -- observation
    def state(self, merges: int = 0) -> syncer_pb2.TrainingState:
        return self.call(lambda: wire_views.training_state(self.core, merges))

    def model(self) -> dict[int, tuple[int, str]]:
        """{fragment: (version, params sha256)}: the global model's identity."""
        return self.call(lambda: {s.fragment.fragment_id: (s.version, s.params_sha256) for s in self.core.slots})

    def published(self) -> dict[int, tuple[int, str]]:
        """{fragment: (version, published sha256)}: what learners hold (with lossy delta downloads,
        their reconstruction of the global fragment; with fp32 downloads the same as model())."""
        return self.call(lambda: {s.fragment.fragment_id: (s.version, s.published_sha256) for s in self.core.slots})

    def checkpoint(self) -> bool:
        """Commits a checkpoint now if anything merged since the last one (the syncer's own code)."""
        return self.call(self.checkpointer.save)

    def committed(self) -> list[tuple[int, tuple]]:
        """Every committed manifest: (step, ((blob name, digest), ...)), read from the store itself."""
        return [(m["step"], tuple(sorted((b["name"], b["digest"]) for b in m["blobs"])))
                for m in self.store.list_manifests("security")]

    def frozen(self) -> tuple:
        """The global model plus the committed checkpoints; bad input must leave both unchanged."""
        return self.model(), self.committed(), self.call(lambda: all(np.isfinite(s.params).all() for s in self.core.slots))

    def numel(self, fid: int) -> int:
        return self.plan.fragments[fid].numel


# -------------------------------------------------------------------------------- clients


class Learner:
    """Speaks the wire protocol directly (blocking stubs), so tests can send what real learners never would."""

    def __init__(self, address: str, learner_id: str, *, sec: security.ClientSecurity | None = None,
                 incarnation: int = 1, join: bool = True, channel: grpc.Channel | None = None) -> None:
        self.channel = channel or channel_lib.sync_channel(address, sec)
        self.stub = syncer_pb2_grpc.SyncerStub(self.channel)
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.instance = ""
        if join:
            self.join()

    def join(self, *, learner_id: str | None = None, incarnation: int | None = None,
             protocol_version: int = serde.PROTOCOL_VERSION) -> syncer_pb2.JoinResponse:
        response = self.stub.Join(syncer_pb2.JoinRequest(
            protocol_version=protocol_version, learner_id=learner_id or self.learner_id,
            incarnation=self.incarnation if incarnation is None else incarnation, region="test"), timeout=10)
        self.instance = response.syncer_instance
        return response

    def header(self, fid: int, base: int, info: common_pb2.PayloadInfo, **overrides) -> syncer_pb2.UploadHeader:
        fields = dict(protocol_version=serde.PROTOCOL_VERSION, learner_id=self.learner_id,
                      incarnation=self.incarnation, fragment_id=fid, base_version=base, syncer_instance=self.instance,
                      steps=2, tokens=2 * 512, payload=info)
        fields.update(overrides)
        return syncer_pb2.UploadHeader(**fields)

    def upload_messages(self, messages: Sequence[syncer_pb2.UploadFragmentRequest], timeout_s: float = 10.0):
        return self.stub.UploadFragment(iter(messages), timeout=timeout_s)

    def upload(self, fid: int, base: int, payload: bytes, info: common_pb2.PayloadInfo, *, chunk: int = CHUNK,
               **overrides) -> syncer_pb2.UploadFragmentResponse:
        return self.upload_messages(upload_stream(self.header(fid, base, info, **overrides), payload, chunk))

    def close(self) -> None:
        self.channel.close()


def upload_stream(header: syncer_pb2.UploadHeader, payload: bytes, chunk: int = CHUNK) -> list:
    return [syncer_pb2.UploadFragmentRequest(header=header)] + [
        syncer_pb2.UploadFragmentRequest(chunk=c) for c in serde.payload_chunks(payload, chunk)]


def encoded(values: np.ndarray, codec: str = "fp32") -> tuple[bytes, common_pb2.PayloadInfo]:
    enc = codec_lib.encode(np.asarray(values, dtype=np.float32), codec)
    return enc.payload, serde.payload_info_to_proto(enc)


def raw_payload(raw: bytes, *, codec: int = common_pb2.CODEC_FP32, numel: int, block_size: int = 0,
                content_size: bool = True) -> tuple[bytes, common_pb2.PayloadInfo]:
    """A payload built by hand around arbitrary raw bytes (bypassing the learner-side checks)."""
    payload = zstandard.ZstdCompressor(write_content_size=content_size).compress(raw)
    info = common_pb2.PayloadInfo(codec=codec, numel=numel, block_size=block_size, raw_size_bytes=len(raw),
                                  payload_size_bytes=len(payload), checksum=hashlib.sha256(payload).digest())
    return payload, info


def code_of(fn) -> grpc.StatusCode:
    """The status code `fn()` fails with (fails the test if it succeeds)."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def error_of(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def honest_delta(numel: int, seed: int, scale: float = 1e-3) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(numel)).astype(np.float32)


def merge_once(h: Harness, learner: Learner) -> None:
    """`learner` contributes to fragment 0 at version 0; waits for the merge (version 1) and commits
    a checkpoint."""
    payload, info = encoded(honest_delta(h.numel(0), 0))
    assert learner.upload(0, 0, payload, info).result == syncer_pb2.UploadFragmentResponse.RESULT_ACCEPTED
    waits.wait_until(lambda: h.model()[0][0] == 1, timeout_s=10, what="the first merge")
    assert h.checkpoint()


def hostile_core(clock, *, action: str = "reject", factor: float = 20.0, quarantine_after: int = 3,
                 quarantine_s: float = 600.0, min_quorum: int = 1) -> core_lib.SyncerCore:
    """A SyncerCore without gRPC for the hostile-learner checks: the norm bound (k = `factor`,
    reject or clip) and quarantine after `quarantine_after` strikes within 300 s; nobody goes silent."""
    return fakes.make_core(
        clock, specs=SPECS, model_name="t", initial_std=0.02, min_quorum=min_quorum, max_staleness_versions=4,
        overlap_steps=4, insecure=True, liveness_timeout_s=1e9, merge_history=64,
        norm_bound=robust_lib.NormBoundPolicy(factor=factor, action=action), quarantine_after=quarantine_after,
        quarantine_window_s=300.0, quarantine_s=quarantine_s)


@pytest.fixture(scope="module")
def mtls_syncer(tmp_path_factory, pki):
    """A syncer under mutual TLS for the CLI clients' credential tests (one per test module)."""
    with Harness(tmp_path_factory.mktemp("mtls-syncer"), mode="mtls", pki=pki) as harness:
        yield harness


def reader_flags(pki: pathlib.Path, name: str = "operator") -> list[str]:
    """The CLI flags of `name`'s certificate (the operator's is a reader identity)."""
    return ["--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / f"{name}.pem"), "--tls-key", str(pki / f"{name}.key")]
