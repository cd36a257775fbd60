"""`drafter serve` settings: every one a flag and a DRAFTER_* environment variable.

The container passes no arguments (Kubernetes sets the environment); a flag, when given,
wins over the variable.  Port 0 means "pick a free port"; the ready line reports the choice.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

MiB = 1024 * 1024
MAX_SWITCH_INTERVAL_US = 100_000  # --gil-switch-interval-us: longer hand-offs only stall the engine thread more


def _bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)


def _tree(text: str):
    return None if not text else tuple(tuple(int(i) for i in p) for p in json.loads(text))


def _opt(kind, default, help, env=None, choices=None):
    return field(default=default, metadata={"kind": kind, "help": help, "env": env, "choices": choices})


@dataclass
class ServerConfig:
    # ---- what to serve
    method: str = _opt(str, "", "draft head: eagle | eagle3 | mtp | deepseek_mtp | extract_hidden_states",
                       choices=("eagle", "eagle3", "mtp", "deepseek_mtp", "extract_hidden_states"))
    model: str = _opt(str, "", "draft head checkpoint directory")
    target_model: str = _opt(str, "", "target checkpoint directory (embeddings / lm_head the head shares)")
    device: str = _opt(str, "auto", "cpu | cuda:N | auto (cuda:0 when available)")
    dtype: str = _opt(str, "auto", "float32 | float16 | bfloat16 | auto (bfloat16 on a GPU, float32 on CPU)")
    num_speculative_tokens: int = _opt(int, 3, "k: drafts per step (chain)")
    speculative_token_tree: str = _opt(str, "", "tree drafting: JSON list of paths, e.g. [[0],[1],[0,0]]")
    max_model_len: int = _opt(int, 2048, "the target's max_model_len (attaching targets must match)")
    max_num_seqs: int = _opt(int, 64, "most requests in one engine call (over all fused sessions)")
    max_num_batched_tokens: int = _opt(int, 2048, "most tokens in one engine call")
    kv_blocks: str = _opt(str, "4096", "KV pool blocks per group (one value, or one per group: 4096,2048)")
    block_sizes: str = _opt(str, "16", "KV block size per group (one value, or one per group)")
    capture_sizes: str = _opt(str, "", "batch sizes to pad to / capture (default: powers of two)")
    token_capture_sizes: str = _opt(str, "", "token counts to pad the first pass to")
    padded_drafter_batch: bool = _opt(_bool, True, "keep rejected tokens in the batch (vLLM's default)")
    mtp_layer_schedule: str = _opt(str, "", "mtp / deepseek_mtp heads of several layers: first_layer (layer 0 at every "
                                            "draft step, as vLLM 0.32's V1 runner; deepseek_mtp's default) or per_step "
                                            "(step s runs layer s mod n; mtp's default)")
    attention_backend: str = _opt(str, "auto", "auto | reference | triton", choices=("auto", "reference", "triton"))
    use_cuda_graphs: bool = _opt(_bool, True, "capture the draft loop in CUDA graphs on a GPU")
    skinny_gemm: str = _opt(str, "auto", "step GEMMs of <= 64 rows: drafter's skinny kernel where timed faster "
                            "at start-up (auto), always (on) or cuBLAS (off)", choices=("auto", "on", "off"))
    weights: str = _opt(str, "bf16", "the head's GEMM weights: bf16 (as the checkpoint has them, in --dtype) or fp8 "
                                     "(per-output-channel e4m3, quantised at load: half the weight bytes, drafts "
                                     "no longer vLLM's; docs/fp8.md)", choices=("bf16", "fp8"))
    seed: int = _opt(int, 0, "seed of the sampling generator")
    predraft_outcomes: int = _opt(int, 0, "after each ZMQ call that asks, pre-draft the next step for this many "
                                          "likeliest verification outcomes per request and push them (0 = off; "
                                          "docs/predraft.md)")
    predraft_k: int = _opt(int, 0, "drafts per pre-draft (k'; 0 = the drafter's k): deeper than k, the target "
                                   "verifies k' drafts on a hit; max_num_seqs x (k' + 1) must fit "
                                   "--max-num-batched-tokens (docs/predraft.md)")
    tensor_parallel_size: int = _opt(int, 1, "ranks the head is split over by attention head, MLP column and "
                                             "vocabulary row (one process and GPU each, from --device on; gloo "
                                             "on CPU); must divide the head's sizes")
    torch_threads: int = _opt(int, 0, "torch CPU threads (0 = torch's default); on a small CPU host 1 avoids "
                                      "OpenMP threads spinning against the transports")
    gil_switch_interval_us: int = _opt(int, 5000, "microseconds a thread waiting for Python's interpreter lock waits "
                                                  "before the holder is made to hand it over (sys.setswitchinterval; "
                                                  "5000 is Python's own): how long the engine thread may wait behind "
                                                  "the transports' event loop at each torch call")
    # ---- network
    host: str = _opt(str, "127.0.0.1", "address every port binds to (loopback unless told otherwise)")
    grpc_port: int = _opt(int, 50051, "gRPC port (0 = a free one)")
    zmq_port: int = _opt(int, 5555, "ZMQ ROUTER port (0 = a free one)")
    zmq_ipc: str = _opt(str, "", "also serve ZMQ on ipc://PATH for targets on this host (an absolute path in a "
                                 "directory others cannot write, e.g. /run/drafter/zmq.sock); empty = tcp only")
    zmq_ipc_mode: str = _opt(str, "0600", "permissions of the ipc socket file (octal; 0660 lets the group connect)")
    allow_cuda_ipc: str = _opt(str, "auto", "accept hidden states as CUDA IPC references from targets on this host "
                                            "(auto: only when --host is loopback; never on a CPU device)",
                               choices=("auto", "true", "false"))
    health_port: int = _opt(int, 50052, "plaintext grpc.health.v1-only port for probes (0 = a free one)")
    metrics_port: int = _opt(int, 9400, "Prometheus /metrics port (0 = a free one)")
    max_message_bytes: int = _opt(int, 256 * MiB, "largest request or reply on either transport")
    keepalive_time_s: float = _opt(float, 30.0, "gRPC keepalive ping / ZMQ heartbeat interval")
    keepalive_timeout_s: float = _opt(float, 10.0, "drop a peer whose ping is not answered within this")
    # ---- service behaviour
    max_sessions: int = _opt(int, 16, "most attached sessions")
    max_sessions_per_client: int = _opt(int, 0, "most sessions one client may hold (0 = no limit). A client is the "
                                                "authenticated peer (mTLS certificate CN, CURVE key), else the "
                                                "connection")
    max_kv_blocks_per_client: str = _opt(str, "0", "most KV blocks one client's sessions may reserve, per group (one "
                                                   "value, or one per group; 0 = no limit)")
    max_inflight_per_client: int = _opt(int, 128, "most calls one client may have queued or running; past it a call "
                                                  "is refused at once with RESOURCE_EXHAUSTED (0 = no limit)")
    replace_idle_s: float = _opt(float, 30.0, "an attach by the same authenticated client under the same client name "
                                              "replaces its session that has had no call for this long, freeing its "
                                              "blocks at once (0 = even a session in use)")
    batch_window_us: int = _opt(int, 100, "how long to collect requests of several sessions for one engine call")
    session_idle_timeout_s: float = _opt(float, 900.0, "detach a session unused this long (0 = never)")
    drain_timeout_s: float = _opt(float, 20.0, "on SIGTERM, how long in-flight calls may take before exit")
    liveness_stall_s: float = _opt(float, 120.0, "health 'liveness' turns NOT_SERVING when one engine call "
                                                 "runs longer than this")
    # ---- security
    tls_cert: str = _opt(str, "", "gRPC server certificate (PEM); enables TLS")
    tls_key: str = _opt(str, "", "gRPC server key (PEM)")
    tls_client_ca: str = _opt(str, "", "CA (PEM) that client certificates must chain to; enables mTLS")
    curve_server_cert: str = _opt(str, "", "ZMQ CURVE secret certificate (zmq.auth .key_secret file); enables CURVE")
    curve_clients_dir: str = _opt(str, "", "directory of authorised client public certificates (zmq.auth); "
                                         "required with --curve-server-cert")
    transports: str = _opt(str, "grpc,zmq", "which call transports listen: grpc,zmq | grpc | zmq (the health and "
                                            "metrics ports always do)")
    insecure_grpc: bool = _opt(_bool, False, "serve gRPC without mTLS although ZMQ requires CURVE (anyone who can "
                                             "reach the gRPC port may call; logged as a warning at start)")
    insecure_zmq: bool = _opt(_bool, False, "serve ZMQ without CURVE although gRPC requires mTLS (anyone who can "
                                            "reach the ZMQ port may call; logged as a warning at start)")
    insecure_bound_planes: bool = _opt(_bool, False, "with auth configured, still serve the bound planes that "
                                                      "cannot be authenticated: the ring stream over tcp and the "
                                                      "gloo/nccl channels (anyone who can reach their ports and has "
                                                      "a bind id may send steps; logged as a warning at start)")
    front_processes: bool = _opt(_bool, False, "receive in processes apart from the engine's: one child process per "
                                               "listening transport binds the public port, decodes and refuses, and "
                                               "forwards admitted calls to the engine process over a private ipc "
                                               "socket (Bind, the bound sessions, is not served)")
    # ---- logs
    log_format: str = _opt(str, "json", "json | text", choices=("json", "text"))
    log_level: str = _opt(str, "info", "debug | info | warning | error")
    # hidden, for the integration tests: SIGUSR1 pauses and SIGUSR2 resumes the engine thread (to hold
    # calls in flight); with test_hold_loading, loading waits for a first SIGUSR1
    test_hooks: bool = _opt(_bool, False, argparse.SUPPRESS)
    test_hold_loading: bool = _opt(_bool, False, argparse.SUPPRESS)
    # hidden, for the abuse probe's A/B (issue 19): frames of a refused oversized ZMQ message released under
    # the socket's lock at a time, and how long one turn of the loop goes on releasing them (0: one slice a
    # turn); zmq_server.DROP_BURST and DROP_BUDGET_S
    zmq_drop_burst: int = _opt(int, 256, argparse.SUPPRESS)
    zmq_drop_budget_us: int = _opt(int, 2000, argparse.SUPPRESS)

    # ------------------------------------------------------------------ derived
    @property
    def tree(self):
        return _tree(self.speculative_token_tree)

    def kv_blocks_per_group(self, groups: int) -> tuple[int, ...]:
        return _per_group("kv_blocks", _ints(self.kv_blocks), groups)

    def block_sizes_per_group(self, groups: int) -> tuple[int, ...]:
        return _per_group("block_sizes", _ints(self.block_sizes), groups)

    def client_quotas(self):
        """The per-client limits, as the service core takes them (drafter.service.sessions.ClientQuotas)."""
        from drafter.service.sessions import ClientQuotas

        return ClientQuotas(max_sessions=self.max_sessions_per_client,
                            max_kv_blocks=_ints(self.max_kv_blocks_per_client),
                            max_inflight=self.max_inflight_per_client, replace_idle_s=self.replace_idle_s)

    def check_quotas(self) -> None:
        for name in ("max_sessions_per_client", "max_inflight_per_client", "replace_idle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 0")
        try:
            blocks = _ints(self.max_kv_blocks_per_client)
        except ValueError:
            blocks = ()
        if not blocks or min(blocks) < 0:
            raise ValueError(f"--max-kv-blocks-per-client {self.max_kv_blocks_per_client!r}: one count >= 0, or one "
                             f"per KV group (0 = no limit)")

    @property
    def ipc_mode(self) -> int:
        try:
            return int(str(self.zmq_ipc_mode), 8)
        except ValueError:
            raise ValueError(f"--zmq-ipc-mode {self.zmq_ipc_mode!r} is not an octal mode") from None

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda:0" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device() == "cpu" else "bfloat16"

    @property
    def transport_set(self) -> frozenset[str]:
        names = frozenset(t for t in self.transports.replace(" ", "").split(",") if t)
        if not names or names - {"grpc", "zmq"}:
            raise ValueError(f"--transports {self.transports!r}: a comma list of grpc and zmq (at least one)")
        return names

    @property
    def serves_grpc(self) -> bool:
        return "grpc" in self.transport_set

    @property
    def serves_zmq(self) -> bool:
        return "zmq" in self.transport_set

    def insecure_transports(self) -> list[str]:
        """The listening transports left without client authentication by an explicit opt-out flag."""
        if not (self.tls_client_ca or self.curve_server_cert):
            return []
        out = []
        if self.serves_grpc and not self.tls_client_ca:
            out.append("grpc")
        if self.serves_zmq and not self.curve_server_cert:
            out.append("zmq")
        return out

    def check_auth(self) -> None:
        """All or nothing: once any transport authenticates its clients, every listening transport must,
        unless an --insecure-* flag says otherwise; CURVE always needs its client allow list."""
        if self.curve_server_cert and not self.curve_clients_dir:
            raise ValueError("--curve-server-cert needs --curve-clients-dir (without an allow list CURVE accepts "
                             "any client key)")
        if not (self.tls_client_ca or self.curve_server_cert):
            return
        if self.serves_grpc and not self.tls_client_ca and not self.insecure_grpc:
            raise ValueError("ZMQ requires CURVE but gRPC would serve anyone: pass --tls-client-ca (mTLS), "
                             "--transports zmq (no gRPC), or --insecure-grpc")
        if self.serves_zmq and not self.curve_server_cert and not self.insecure_zmq:
            raise ValueError("gRPC requires mTLS but ZMQ would serve anyone: pass --curve-server-cert with "
                             "--curve-clients-dir, --transports grpc (no ZMQ), or --insecure-zmq")

    def check(self) -> None:
        if not self.method:
            raise ValueError("--method (DRAFTER_METHOD) is required")
        if not self.model:
            raise ValueError("--model (DRAFTER_MODEL) is required")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert/--tls-key")
        if self.curve_clients_dir and not self.curve_server_cert:
            raise ValueError("--curve-clients-dir needs --curve-server-cert")
        self.transport_set  # noqa: B018 - raises on an unknown name
        self.check_auth()
        self.check_quotas()
        if self.zmq_ipc and not self.serves_zmq:
            raise ValueError("--zmq-ipc needs zmq in --transports")
        if self.front_processes and self.insecure_bound_planes:
            raise ValueError("--insecure-bound-planes: the front processes serve no bound sessions (Bind is refused); "
                             "drop it or --front-processes")
        if self.zmq_ipc:
            from drafter.wire.ipc import _check_syntax

            _check_syntax(self.zmq_ipc[len("ipc://"):] if self.zmq_ipc.startswith("ipc://") else self.zmq_ipc)
        mode = self.ipc_mode
        if mode & ~0o770 or mode & 0o007:
            raise ValueError(f"--zmq-ipc-mode {self.zmq_ipc_mode}: grant nothing to others (e.g. 0600 or 0660)")
        _tree(self.speculative_token_tree)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: must be at least 1")
        if self.tensor_parallel_size > 1 and self.method == "extract_hidden_states":
            raise ValueError("--tensor-parallel-size: extract_hidden_states has no head to split; use 1")
        if self.tensor_parallel_size > 1 and self.weights == "fp8":
            raise ValueError("--weights fp8: per-channel FP8 runs on a single-process head; use "
                             "--tensor-parallel-size 1 or --weights bf16")
        if self.zmq_drop_burst < 1:
            raise ValueError(f"--zmq-drop-burst {self.zmq_drop_burst}: must be at least 1")
        if self.zmq_drop_budget_us < 0:
            raise ValueError(f"--zmq-drop-budget-us {self.zmq_drop_budget_us}: must be >= 0")
        if not 1 <= self.gil_switch_interval_us <= MAX_SWITCH_INTERVAL_US:
            raise ValueError(f"--gil-switch-interval-us {self.gil_switch_interval_us}: must be 1 to "
                             f"{MAX_SWITCH_INTERVAL_US} (Python's own is 5000)")
        if self.predraft_outcomes < 0:
            raise ValueError(f"--predraft-outcomes {self.predraft_outcomes}: must be >= 0 (0 = off)")
        if self.predraft_outcomes and self.tensor_parallel_size > 1:
            raise ValueError("--predraft-outcomes: pre-drafting runs on a single-process head; "
                             "use --tensor-parallel-size 1 or --predraft-outcomes 0")
        _check_predraft_k(self)


def _check_predraft_k(cfg) -> None:
    """--predraft-k: 0 (= k) or 1 .. what the engine's token buffers hold after hits (k' + 1 a row)."""
    kp = cfg.predraft_k
    if kp < 0:
        raise ValueError(f"--predraft-k {kp}: must be >= 1 (or 0 = the drafter's k)")
    if kp and not cfg.predraft_outcomes:
        raise ValueError(f"--predraft-k {kp}: pre-drafting is off; set --predraft-outcomes too")
    if kp > cfg.num_speculative_tokens and cfg.max_num_seqs * (kp + 1) > cfg.max_num_batched_tokens:
        raise ValueError(f"--predraft-k {kp}: a call after hits carries --max-num-seqs x (k' + 1) = "
                         f"{cfg.max_num_seqs * (kp + 1)} tokens, above --max-num-batched-tokens "
                         f"{cfg.max_num_batched_tokens}")
    if kp >= cfg.max_model_len:
        raise ValueError(f"--predraft-k {kp}: must be below --max-model-len {cfg.max_model_len}")


def _per_group(name: str, values: tuple[int, ...], groups: int) -> tuple[int, ...]:
    if len(values) == 1:
        return values * groups
    if len(values) != groups:
        raise ValueError(f"--{name.replace('_', '-')}: {len(values)} values for a head with {groups} KV groups")
    return values


def env_name(name: str) -> str:
    return "DRAFTER_" + name.upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(ServerConfig):
        meta = f.metadata
        env = env_name(f.name)
        help_text = meta["help"] if meta["help"] == argparse.SUPPRESS else f"{meta['help']} [env {env}; default {f.default!r}]"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None, help=help_text,
                            choices=meta["choices"], type=meta["kind"])


def from_args(ns: argparse.Namespace, environ=None) -> ServerConfig:
    """Flags win over DRAFTER_* variables, which win over the defaults."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields(ServerConfig):
        given = getattr(ns, f.name, None)
        if given is not None:
            values[f.name] = given
            continue
        raw = environ.get(env_name(f.name))
        if raw is None or raw == "":
            continue
        kind = f.metadata["kind"]
        try:
            value = kind(raw)
        except ValueError as exc:
            raise ValueError(f"{env_name(f.name)}={raw!r}: {exc}") from None
        choices = f.metadata["choices"]
        if choices and value not in choices:
            raise ValueError(f"{env_name(f.name)}={raw!r}: choose from {choices}")
        values[f.name] = value
    cfg = ServerConfig(**values)
    cfg.log_level = cfg.log_level.lower()
    return cfg
