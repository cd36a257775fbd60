"""Client auth flags for the tools that act as a target against a served drafter (`drafter loadtest`).

    --curve-server-public FILE   zmq: the drafter's public CURVE certificate (zmq.auth .key file)
    --curve-client-secret FILE   zmq: this client's secret CURVE certificate (.key_secret), whose
                                 public key is in the drafter's --curve-clients-dir; with the one above
    --tls-root-ca FILE           grpc: the CA (PEM) that verifies the drafter's certificate; turns TLS on
    --tls-cert FILE, --tls-key FILE  grpc: this client's certificate and key (PEM) for mTLS (the
                                 drafter's --tls-client-ca signed it); together, with --tls-root-ca
    --tls-server-name NAME       grpc: the name the drafter's certificate carries, where the address differs

They are the `drafter serve` auth flags' other side and the vLLM plugin's DRAFTER_CURVE_* /
DRAFTER_TLS_* settings under flag names.  ClientAuth.from_args validates them once, at the edge:
a file that is not there, half of a pair, a CURVE certificate without its key, or a setting of a
transport the run does not use is a ValueError naming the flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from coordinator.transport.grpc_client import TlsConfig
from coordinator.transport.zmq_client import CurveConfig

CURVE_FLAGS = ("curve_server_public", "curve_client_secret")
TLS_FLAGS = ("tls_root_ca", "tls_cert", "tls_key", "tls_server_name")


def flag(dest: str) -> str:
    """The flag of an argparse dest ("tls_root_ca" -> "--tls-root-ca")."""
    return "--" + dest.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The six client auth flags (module docstring), each defaulting to "" (not set)."""
    p.add_argument("--curve-server-public", default="", metavar="FILE",
                   help="zmq: the drafter's public CURVE certificate (zmq.auth .key file)")
    p.add_argument("--curve-client-secret", default="", metavar="FILE",
                   help="zmq: this client's secret CURVE certificate (.key_secret) whose public key is in the "
                        "drafter's --curve-clients-dir (with --curve-server-public)")
    p.add_argument("--tls-root-ca", default="", metavar="FILE",
                   help="grpc: the CA (PEM) that verifies the drafter's certificate; turns TLS on")
    p.add_argument("--tls-cert", default="", metavar="FILE",
                   help="grpc: this client's certificate (PEM) for mTLS (with --tls-key and --tls-root-ca)")
    p.add_argument("--tls-key", default="", metavar="FILE", help="grpc: this client's key (PEM) for mTLS")
    p.add_argument("--tls-server-name", default="", metavar="NAME",
                   help="grpc: the name the drafter's certificate carries, where the address differs")


@dataclass(frozen=True)
class ClientAuth:
    """A client's auth, one setting per scheme: curve for zmq, tls for grpc (None: plaintext)."""

    curve: CurveConfig | None = None
    tls: TlsConfig | None = None

    @classmethod
    def from_args(cls, ns: argparse.Namespace, schemes: set[str]) -> "ClientAuth":
        """The flags of add_arguments, checked; schemes: the transports the run uses ("zmq", "grpc")."""
        given = {d: getattr(ns, d, "") or "" for d in CURVE_FLAGS + TLS_FLAGS}
        for dests, scheme in ((CURVE_FLAGS, "zmq"), (TLS_FLAGS, "grpc")):
            used = [d for d in dests if given[d]]
            if used and scheme not in schemes:
                raise ValueError(f"{flag(used[0])} is a setting of the {scheme} transport, which this run does "
                                 f"not use ({', '.join(sorted(schemes)) or 'none'})")
        _pairs(given)
        for d in CURVE_FLAGS + TLS_FLAGS[:3]:
            if given[d] and not os.path.isfile(given[d]):
                raise ValueError(f"{flag(d)}: no such file: {given[d]}")
        curve = tls = None
        if given["curve_server_public"]:
            curve = CurveConfig(server_public=given["curve_server_public"],
                                client_secret=given["curve_client_secret"])
            _check_curve(curve)
        if given["tls_root_ca"]:
            tls = TlsConfig(given["tls_root_ca"], given["tls_cert"] or None, given["tls_key"] or None,
                            given["tls_server_name"] or None)
        return cls(curve=curve, tls=tls)

    def for_scheme(self, scheme: str) -> dict:
        """The client keyword for one transport: {"curve": ...} for zmq, {"tls": ...} for grpc, or {}."""
        if scheme == "zmq" and self.curve is not None:
            return {"curve": self.curve}
        if scheme == "grpc" and self.tls is not None:
            return {"tls": self.tls}
        return {}


def _pairs(given: dict) -> None:
    """Settings that only work together: the CURVE pair, mTLS's cert and key, both under --tls-root-ca."""
    needs = (("curve_server_public", "curve_client_secret"), ("curve_client_secret", "curve_server_public"),
             ("tls_cert", "tls_key"), ("tls_key", "tls_cert"), ("tls_cert", "tls_root_ca"),
             ("tls_server_name", "tls_root_ca"))
    for have, need in needs:
        if given[have] and not given[need]:
            raise ValueError(f"{flag(have)} needs {flag(need)}")


def _check_curve(curve: CurveConfig) -> None:
    """Both files are zmq.auth certificates and the client's holds its secret key."""
    import zmq.auth

    for name, path in (("curve_server_public", curve.server_public), ("curve_client_secret", curve.client_secret)):
        try:
            _, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{flag(name)}: {path} is not a zmq.auth certificate ({exc})") from None
        if name == "curve_client_secret" and not secret:
            raise ValueError(f"{flag(name)}: {path} holds no secret key (use the .key_secret file)")
