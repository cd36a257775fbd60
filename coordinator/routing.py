"""Which drafter serves which DP rank: rendezvous (highest-random-weight) hashing.

Every (session key, endpoint) pair gets a score from a fixed hash; a key goes to its
highest-scoring endpoint.  Hence, with no shared state and no coordination:
  * stable: the same key and endpoint set give the same endpoint, in every process and after
    every client restart;
  * minimal movement: when an endpoint disappears only its keys move (each to its runner-up);
    when one appears it takes only the keys it now wins;
  * fail-over order for free: the ranking is the list of endpoints to try next.
Endpoints come from a static list or from DNS A records (a Kubernetes headless Service resolves
to one record per ready drafter pod), re-read at most every `refresh_s`; if a lookup fails the
last good list stays in use, so a DNS hiccup moves nobody.
"""

from __future__ import annotations

import hashlib
import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

SCHEMES = ("grpc", "zmq", "inprocess")


@dataclass(frozen=True, order=True)
class Endpoint:
    scheme: str  # grpc | zmq | inprocess
    host: str
    port: int

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"endpoint scheme must be one of {SCHEMES}, got {self.scheme!r}")

    @classmethod
    def parse(cls, text: str) -> "Endpoint":
        """'grpc://127.0.0.1:50051', 'zmq://localhost:5555' or 'inprocess://name:0'."""
        scheme, sep, rest = text.partition("://")
        host, colon, port = rest.rpartition(":")
        if not sep or not colon or not host or not port.isdigit():
            raise ValueError(f"endpoint {text!r} is not scheme://host:port")
        return cls(scheme, host.strip("[]"), int(port))

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.address}"


def score(key: str, endpoint: Endpoint) -> int:
    digest = hashlib.blake2b(f"{key}\x00{endpoint}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, endpoints: Iterable[Endpoint]) -> list[Endpoint]:
    """Endpoints in the order `key` prefers them (best first); ties broken by name."""
    return sorted(set(endpoints), key=lambda e: (-score(key, e), str(e)))


def assign(keys: Iterable[str], endpoints: Sequence[Endpoint]) -> dict[str, Endpoint]:
    if not endpoints:
        raise ValueError("no drafter endpoints")
    return {k: rank(k, endpoints)[0] for k in keys}


def session_key(target: str, dp_rank: int) -> str:
    return f"{target}/dp{dp_rank}"


class StaticEndpoints:
    def __init__(self, endpoints: Sequence[Endpoint | str]):
        self._endpoints = tuple(sorted({e if isinstance(e, Endpoint) else Endpoint.parse(e) for e in endpoints}))
        if not self._endpoints:
            raise ValueError("a static endpoint list needs at least one endpoint")

    def resolve(self) -> tuple[Endpoint, ...]:
        return self._endpoints


Resolver = Callable[..., list]  # socket.getaddrinfo's signature


class DnsEndpoints:
    """All A/AAAA records of `name` (e.g. a headless Service: drafter.ns.svc.cluster.local),
    each at `port` with `scheme`."""

    def __init__(self, name: str, port: int, scheme: str = "grpc", resolver: Resolver = socket.getaddrinfo):
        self.name, self.port, self.scheme = name, port, scheme
        self.resolver = resolver

    def resolve(self) -> tuple[Endpoint, ...]:
        infos = self.resolver(self.name, self.port, type=socket.SOCK_STREAM)
        return tuple(sorted({Endpoint(self.scheme, info[4][0], self.port) for info in infos}))


class Router:
    def __init__(self, source, *, refresh_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.source = source
        self.refresh_s = refresh_s
        self.clock = clock
        self._endpoints: tuple[Endpoint, ...] = ()
        self._resolved_at: float | None = None
        self.last_error: Exception | None = None

    def endpoints(self) -> tuple[Endpoint, ...]:
        now = self.clock()
        if self._resolved_at is None or now - self._resolved_at >= self.refresh_s:
            self._resolved_at = now
            try:
                found = self.source.resolve()
            except OSError as e:  # socket.gaierror included: keep the last good list
                self.last_error = e
            else:
                if found:
                    self._endpoints = tuple(found)
                self.last_error = None
        return self._endpoints

    def rank(self, key: str) -> list[Endpoint]:
        return rank(key, self.endpoints())
