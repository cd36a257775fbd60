"""Where the plugin sends drafting: the environment, or vLLM's `additional_config`.

Environment (the names the k8s target-wiring overlay sets):
    DRAFTER_ENDPOINTS    drafter addresses, host:port[,host:port] (a scheme prefix such as tcp:// is
                         ignored); one host name (a Kubernetes headless Service) is re-resolved through
                         DNS, one drafter per address
    DRAFTER_TRANSPORT    zmq (default) | grpc | inprocess (the engine inside vLLM's process: tests, debugging)
    DRAFTER_DEADLINE_MS  one step's budget for the drafter (default 50); past it the step has no drafts
    DRAFTER_BOUND        auto (default): over ZMQ, a bound session where the drafter can serve one
                         (coordinator/transport/bound_transport.py) | off: every step unbound
vLLM's speculative_config rejects unknown keys, so a per-engine setting goes into
`additional_config={"drafter": {"endpoints": ..., "transport": ..., "deadline_ms": ...}}`
(`--additional-config` on the CLI), which wins over the environment key by key.
Remote drafting is on when an endpoint is given, or the transport is inprocess.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

TRANSPORTS = ("zmq", "grpc", "inprocess")
BOUND_MODES = ("auto", "off")
DEFAULT_DEADLINE_MS = 50.0


@dataclass(frozen=True)
class PluginSettings:
    endpoints: tuple[str, ...] = ()
    transport: str = "zmq"
    deadline_ms: float = DEFAULT_DEADLINE_MS
    bound: str = "auto"

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"DRAFTER_TRANSPORT must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.bound not in BOUND_MODES:
            raise ValueError(f"DRAFTER_BOUND must be one of {BOUND_MODES}, got {self.bound!r}")
        if not self.deadline_ms > 0:
            raise ValueError(f"DRAFTER_DEADLINE_MS must be positive, got {self.deadline_ms}")
        if self.transport != "inprocess":
            object.__setattr__(self, "endpoints", tuple(_address(e) for e in self.endpoints))

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
        return cls(tuple(str(e) for e in endpoints), str(values["transport"]).lower(), deadline,
                   str(values["bound"]).lower())

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
