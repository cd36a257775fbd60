"""Where the plugin sends drafting: the environment, or vLLM's `additional_config`.

Environment (the names the k8s target-wiring overlay sets):
    DRAFTER_ENDPOINTS    drafter addresses, host:port[,host:port] (a scheme prefix such as tcp:// is
                         ignored); one host name (a Kubernetes headless Service) is re-resolved through
                         DNS, one drafter per address
    DRAFTER_TRANSPORT    zmq (default) | grpc | inprocess (the engine inside vLLM's process: tests, debugging)
    DRAFTER_DEADLINE_MS  one step's budget for the drafter (default 50); past it the step has no drafts
    DRAFTER_BOUND        auto (default): over ZMQ, a bound session where the drafter can serve one
                         (coordinator/transport/bound_transport.py) | off: every step unbound
    Client auth, each a file path (docs/security.md; the drafter requires what it was started with):
    DRAFTER_CURVE_SERVER_PUBLIC  zmq: the drafter's public CURVE certificate (zmq.auth .key file)
    DRAFTER_CURVE_CLIENT_SECRET  zmq: this client's secret CURVE certificate (.key_secret), whose
                                 public key is in the drafter's --curve-clients-dir; the two go together
    DRAFTER_TLS_ROOT_CA          grpc: the CA (PEM) that verifies the drafter's certificate; turns TLS on
    DRAFTER_TLS_CERT, DRAFTER_TLS_KEY  grpc: this client's certificate and key (PEM) for mTLS; together,
                                 and only with DRAFTER_TLS_ROOT_CA
    DRAFTER_TLS_SERVER_NAME      grpc: the name the drafter's certificate carries, where the address differs
    A setting of the other transport's scheme (or of inprocess) is refused, naming it.
vLLM's speculative_config rejects unknown keys, so a per-engine setting goes into
`additional_config={"drafter": {"endpoints": ..., "transport": ..., "deadline_ms": ...}}`
(`--additional-config` on the CLI), which wins over the environment key by key; the auth settings'
keys are their names in lower case without DRAFTER_, e.g. "tls_root_ca".
Remote drafting is on when an endpoint is given, or the transport is inprocess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

TRANSPORTS = ("zmq", "grpc", "inprocess")
BOUND_MODES = ("auto", "off")
DEFAULT_DEADLINE_MS = 50.0
CURVE_FIELDS = ("curve_server_public", "curve_client_secret")  # the zmq transport's auth
TLS_FIELDS = ("tls_root_ca", "tls_cert", "tls_key", "tls_server_name")  # the grpc transport's auth
AUTH_FIELDS = CURVE_FIELDS + TLS_FIELDS


@dataclass(frozen=True)
class PluginSettings:
    endpoints: tuple[str, ...] = ()
    transport: str = "zmq"
    deadline_ms: float = DEFAULT_DEADLINE_MS
    bound: str = "auto"
    curve_server_public: str = ""  # paths ("" = not set); see the module docstring
    curve_client_secret: str = ""
    tls_root_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""  # a host name, not a path

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"DRAFTER_TRANSPORT must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.bound not in BOUND_MODES:
            raise ValueError(f"DRAFTER_BOUND must be one of {BOUND_MODES}, got {self.bound!r}")
        if not self.deadline_ms > 0:
            raise ValueError(f"DRAFTER_DEADLINE_MS must be positive, got {self.deadline_ms}")
        if self.transport != "inprocess":
            object.__setattr__(self, "endpoints", tuple(_address(e) for e in self.endpoints))
        _check_auth(self)

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints) or self.transport == "inprocess"

    @property
    def copies_inputs(self) -> bool:
        """Whether the transport copies each step's tensors (so the plugin need not): the ZMQ
        transport with bound sessions on copies them into its ring, or into private host copies
        for a step it sends unbound (coordinator/transport/bound_transport.py)."""
        return self.transport == "inprocess" or (self.transport == "zmq" and self.bound == "auto")

    @property
    def deadline_s(self) -> float:
        return self.deadline_ms / 1000.0

    def curve_config(self):
        """The zmq client's CurveConfig (coordinator.transport), or None without CURVE."""
        if not self.curve_server_public:
            return None
        from coordinator.transport.zmq_client import CurveConfig

        return CurveConfig(server_public=self.curve_server_public, client_secret=self.curve_client_secret)

    def tls_config(self):
        """The grpc client's TlsConfig (coordinator.transport), or None without TLS."""
        if not self.tls_root_ca:
            return None
        from coordinator.transport.grpc_client import TlsConfig

        return TlsConfig(self.tls_root_ca, self.tls_cert or None, self.tls_key or None, self.tls_server_name or None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PluginSettings":
        return cls.from_sources(os.environ if environ is None else environ, None)

    @classmethod
    def from_sources(cls, environ: Mapping[str, str], additional_config) -> "PluginSettings":
        values = {
            "endpoints": environ.get("DRAFTER_ENDPOINTS", ""),
            "transport": environ.get("DRAFTER_TRANSPORT", "") or "zmq",
            "deadline_ms": environ.get("DRAFTER_DEADLINE_MS", "") or DEFAULT_DEADLINE_MS,
            "bound": environ.get("DRAFTER_BOUND", "") or "auto",
            **{name: environ.get(_env_name(name), "") for name in AUTH_FIELDS},
        }
        extra = additional_config.get("drafter") if isinstance(additional_config, dict) else None
        if extra is not None:
            if not isinstance(extra, dict):
                raise ValueError(f"additional_config['drafter'] must be a dict, got {type(extra).__name__}")
            unknown = set(extra) - set(values)
            if unknown:
                raise ValueError(f"additional_config['drafter']: unknown keys {sorted(unknown)}; "
                                 f"known: {sorted(values)}")
            values.update({k: v for k, v in extra.items() if v is not None})
        endpoints = values["endpoints"]
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.replace(" ", "").split(",") if e]
        try:
            deadline = float(values["deadline_ms"])
        except (TypeError, ValueError):
            raise ValueError(f"DRAFTER_DEADLINE_MS must be a number, got {values['deadline_ms']!r}") from None
        for name in AUTH_FIELDS:
            if not isinstance(values[name], str):
                raise ValueError(f"{setting_name(name)} must be a string, got {type(values[name]).__name__}")
        return cls(tuple(str(e) for e in endpoints), str(values["transport"]).lower(), deadline,
                   str(values["bound"]).lower(), **{name: values[name].strip() for name in AUTH_FIELDS})

    @classmethod
    def from_vllm_config(cls, vllm_config, environ: Mapping[str, str] | None = None) -> "PluginSettings":
        return cls.from_sources(os.environ if environ is None else environ,
                                getattr(vllm_config, "additional_config", None))


def _address(endpoint: str) -> str:
    """host:port, whatever scheme the user wrote in front (tcp://, grpc://, zmq://)."""
    bare = endpoint.strip().split("://", 1)[-1]
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"drafter endpoint {endpoint!r}: expected host:port")
    return bare


def _env_name(field: str) -> str:
    return f"DRAFTER_{field.upper()}"


def setting_name(field: str) -> str:
    """How an error names a setting: its environment variable and its additional_config key."""
    return f"{_env_name(field)} (additional_config drafter.{field})"


def _check_auth(s: PluginSettings) -> None:
    """Exact or refused: a setting of the other transport is refused, a half-configured pair is
    refused naming the missing half, and every file must be there (read when the client connects)."""
    given = [f for f in AUTH_FIELDS if getattr(s, f)]
    own = {"zmq": CURVE_FIELDS, "grpc": TLS_FIELDS}.get(s.transport, ())
    for f in given:
        if f not in own:
            raise ValueError(f"{setting_name(f)} is a setting of the {'zmq' if f in CURVE_FIELDS else 'grpc'} "
                             f"transport; DRAFTER_TRANSPORT is {s.transport}")
    _needs(s, "curve_server_public", "curve_client_secret")
    _needs(s, "curve_client_secret", "curve_server_public")
    _needs(s, "tls_cert", "tls_key")
    _needs(s, "tls_key", "tls_cert")
    for f in ("tls_cert", "tls_server_name"):
        _needs(s, f, "tls_root_ca")
    for f in given:
        if f != "tls_server_name" and not os.path.isfile(getattr(s, f)):
            raise ValueError(f"{setting_name(f)}: no such file {getattr(s, f)!r}")
    if s.curve_server_public:
        _check_curve_files(s)


def _needs(s: PluginSettings, field: str, other: str) -> None:
    if getattr(s, field) and not getattr(s, other):
        raise ValueError(f"{setting_name(field)} needs {setting_name(other)} too")


def _check_curve_files(s: PluginSettings) -> None:
    """Both CURVE files are zmq.auth certificates, and the client's holds its secret key (a public
    certificate in its place would fail only at the first connection)."""
    import zmq.auth

    for f in CURVE_FIELDS:
        try:
            public, secret = zmq.auth.load_certificate(getattr(s, f))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{setting_name(f)}: not a zmq.auth certificate ({exc})") from None
        if f == "curve_client_secret" and not secret:
            raise ValueError(f"{setting_name(f)}: {getattr(s, f)!r} holds no secret key (the .key_secret file "
                             f"is needed, not the public .key)")
