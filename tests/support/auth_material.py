"""Auth material for the tests that run a drafter under mTLS and CURVE, written in one place.

Each test that needs auth asks for a directory of throwaway material and gets back typed records:
a CA with the server's certificate (`write_mtls`), zmq.auth CURVE key pairs with a client allow list
(`write_curve`), or both (`write_auth`).  The records name the files, give the `drafter serve` settings
that require them (DrafterServer keywords, or command-line flags via `as_flags`), and build the
client configs (TlsConfig, CurveConfig) that present them; `zmq_exchange` sends one message
from a socket presenting a CurveConfig (or none) and returns the reply, if any.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.transport import CurveConfig, TlsConfig

CURVE_NAMES = ("server", "client", "intruder")  # the key pairs write_curve makes; "intruder" is never allowed


# ---------------------------------------------------------------------------------------------- x509
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> tuple[str, str]:
    """PEM files path.crt and path.key; returns (certificate file, key file)."""
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def _builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
    """A certificate valid from five minutes ago for a day (clock skew between processes is harmless)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


class CA:
    """A self-signed EC P-256 certificate authority whose files live in `directory` as name.crt / name.key."""

    def __init__(self, directory: Path, name: str):
        self.dir = Path(directory)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (_builder(name, _name(name), self.key)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.cert_path, self.key_path = _write(self.dir / name, self.key, self.cert)

    def issue(self, name: str, *, server: bool) -> tuple[str, str]:
        """(certificate, key) files for a server (127.0.0.1, localhost) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (_builder(name, self.cert.subject, key)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return _write(self.dir / name, key, builder.sign(self.key, hashes.SHA256()))


@dataclass(frozen=True)
class Mtls:
    """A CA and the server certificate it signed; every client certificate comes from the same CA."""

    ca: CA
    cert: str  # the server's certificate file (127.0.0.1, localhost)
    key: str  # its key file

    def client(self, name: str) -> TlsConfig:
        """A TlsConfig presenting a fresh client certificate for `name` (the peer the server sees)."""
        return TlsConfig(self.ca.cert_path, *self.ca.issue(name, server=False))

    def serve(self) -> dict[str, str]:
        """`drafter serve` settings that serve gRPC with this certificate and require client certificates."""
        return {"tls_cert": self.cert, "tls_key": self.key, "tls_client_ca": self.ca.cert_path}


def write_mtls(directory: Path, ca_name: str = "drafter-ca") -> Mtls:
    """A CA named ca_name and a server certificate "drafter" signed by it, as files in directory."""
    ca = CA(Path(directory), ca_name)
    return Mtls(ca, *ca.issue("drafter", server=True))


# ---------------------------------------------------------------------------------------------- CURVE
def curve_certificates(directory: Path) -> dict[str, tuple[str, str]]:
    """zmq.auth certificates: name -> (public file, secret file) for each of CURVE_NAMES."""
    import zmq.auth

    return {name: tuple(str(p) for p in zmq.auth.create_certificates(str(directory), name))
            for name in CURVE_NAMES}


@dataclass(frozen=True)
class Curve:
    """CURVE key pairs and the allow list a server reads (the public keys of the allowed clients)."""

    keys: dict[str, tuple[str, str]]  # curve_certificates: name -> (public file, secret file)
    clients_dir: str  # the allow list: a directory of allowed clients' public files

    def config(self, client: str = "client") -> CurveConfig:
        """A CurveConfig presenting `client`'s key pair to this server (whether or not it is allowed)."""
        return CurveConfig(server_public=self.keys["server"][0], client_secret=self.keys[client][1])

    def serve(self) -> dict[str, str]:
        """`drafter serve` settings that require CURVE on ZMQ with this allow list."""
        return {"curve_server_cert": self.keys["server"][1], "curve_clients_dir": self.clients_dir}


def write_curve(directory: Path, allowed: tuple[str, ...] = ("client",)) -> Curve:
    """The key pairs of CURVE_NAMES in directory and an allow list directory/curve-clients holding the
    public files of `allowed` only."""
    keys = curve_certificates(directory)
    clients = Path(directory) / "curve-clients"
    clients.mkdir()
    for name in allowed:
        shutil.copy(keys[name][0], clients)
    return Curve(keys, str(clients))


# ---------------------------------------------------------------------------------------------- both
@dataclass(frozen=True)
class AuthMaterial:
    """mTLS on gRPC and CURVE on ZMQ for one server."""

    mtls: Mtls
    curve: Curve

    def serve(self) -> dict[str, str]:
        """`drafter serve` settings that require client auth on both transports."""
        return {**self.mtls.serve(), **self.curve.serve()}


def write_auth(directory: Path, allowed: tuple[str, ...] = ("client",)) -> AuthMaterial:
    """write_mtls and write_curve into one directory."""
    return AuthMaterial(write_mtls(directory), write_curve(directory, allowed))


def zmq_exchange(endpoint: str, parts: list[bytes], curve: CurveConfig | None, wait_s: float) -> list[bytes] | None:
    """Send one multipart message from a fresh DEALER presenting curve (None: plaintext) and return the
    first reply within wait_s, or None.  A message whose handshake never completes stays queued: None."""
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
        sock.send_multipart(parts)
        return sock.recv_multipart() if sock.poll(int(wait_s * 1000)) else None
    finally:
        ctx.destroy(linger=0)


def as_flags(settings: dict[str, str]) -> list[str]:
    """Command-line flags for settings keywords, spelt as DrafterServer spells them (tls_cert: --tls-cert)."""
    return [arg for key, value in settings.items() for arg in ("--" + key.replace("_", "-"), str(value))]
