"""`drafter serve`: load the engine, serve gRPC + ZMQ + health + /metrics, drain on SIGTERM.

Lifecycle (each step is a JSON line on stdout):
  listening  every port is bound (health says NOT_SERVING, calls get UNAVAILABLE: loading)
  ready      the engine is loaded; health SERVING
  draining   SIGTERM/SIGINT: health NOT_SERVING, new calls UNAVAILABLE on both transports, open
             streams end with UNAVAILABLE after their current message, in-flight calls finish
  stopped    everything closed; exit 0 (within drain_timeout_s)
With --tensor-parallel-size N > 1 also (drafter.service.tp):
  ranks        every worker rank has loaded its shard (world, backend, worker_pids), before ready
  rank_failed  a worker rank exited: health NOT_SERVING (serving and liveness), calls UNAVAILABLE
With --front-processes (drafter.service.front) also:
  listening and ready name the front processes (front_pids, by transport)
  front_failed  a front process exited unasked: health NOT_SERVING (serving and liveness), calls UNAVAILABLE
The process is PID 1 in its container, so it installs its own signal handlers.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.service import cuda_support
from drafter.service.bound_sessions import BoundAuth
from drafter.service.config import ServerConfig
from drafter.service.core import ServiceCore
from drafter.service.grpc_server import DrafterGrpcService, HealthState, build_health_server, build_main_server
from drafter.service.logs import event
from drafter.service.metrics import Metrics
from drafter.service.startup import StartupError, bind_error, check_port_free, load_error, preflight
from drafter.service.zmq_server import ZmqServer

log = logging.getLogger("drafter.service.server")


def engine_config(cfg: ServerConfig) -> EngineConfig:
    from drafter.models.spec import parse_head, read_config

    groups = max(1, parse_head(read_config(cfg.model), cfg.method).num_kv_groups)
    return EngineConfig(
        method=cfg.method,
        num_speculative_tokens=1 if cfg.method == "extract_hidden_states" else cfg.num_speculative_tokens,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        kv_groups=tuple(KVGroupSpec(bs, n) for bs, n in zip(cfg.block_sizes_per_group(groups),
                                                             cfg.kv_blocks_per_group(groups))),
        speculative_token_tree=cfg.tree,
        capture_sizes=tuple(int(x) for x in cfg.capture_sizes.split(",") if x),
        token_capture_sizes=tuple(int(x) for x in cfg.token_capture_sizes.split(",") if x),
        padded_drafter_batch=cfg.padded_drafter_batch, device=cfg.resolved_device(), dtype=cfg.resolved_dtype(),
        use_cuda_graphs=cfg.use_cuda_graphs, attention_backend=cfg.attention_backend, skinny_gemm=cfg.skinny_gemm,
        predraft_outcomes=cfg.predraft_outcomes, predraft_tokens=cfg.predraft_k, weights=cfg.weights,
        mtp_layer_schedule=cfg.mtp_layer_schedule,
        seed=cfg.seed)


def load_engine(cfg: ServerConfig, engine_cfg: EngineConfig, hold: threading.Event | None = None):
    import torch

    from drafter.engine.engine import DraftEngine

    if hold is not None:
        hold.wait()
    if cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    device = torch.device(engine_cfg.device)
    if device.type == "cuda":
        # this runs on the engine thread, which launches every kernel after it: Triton launches on the
        # thread's current device, so --device cuda:1 must make cuda:1 current here (else "Pointer
        # argument cannot be accessed from Triton" at the first fused kernel)
        torch.cuda.set_device(device)
    t0 = time.monotonic()
    if cfg.tensor_parallel_size > 1:  # rank 0 here, ranks 1 .. N-1 spawned (drafter.service.tp)
        from drafter.service.tp.leader import load_tp_engine

        engine = load_tp_engine(cfg.tensor_parallel_size, cfg.model, cfg.target_model or None, engine_cfg,
                                timeout_s=cfg.liveness_stall_s, torch_threads=cfg.torch_threads)
    else:
        engine = DraftEngine.from_dirs(cfg.model, cfg.target_model or None, engine_cfg)
    if engine.graphs is not None:
        # every size now, before readiness: captured lazily, the first call would wait out all of it
        # (seen on an H100: a load test's first 13 s of calls all missed their 1 s deadline)
        engine.graphs.capture()
    log.info("engine loaded", extra={"event": "engine_loaded", "seconds": round(time.monotonic() - t0, 3),
                                     "method": engine_cfg.method, "device": engine_cfg.device,
                                     "dtype": engine_cfg.dtype, "kv_groups": [vars(g) for g in engine_cfg.kv_groups]})
    return engine


def set_switch_interval(us: int) -> int:
    """Make a thread that holds the interpreter lock hand it over after `us` microseconds when another
    thread waits for it (--gil-switch-interval-us); returns the interval now in force, in microseconds.

    Each torch call of the engine thread lets the lock go and takes it back after; while the event
    loop runs Python (refusing messages, decoding other calls), taking it back waits until the loop
    is made to let go, Python's 5 ms at most by default, several times a step."""
    sys.setswitchinterval(us / 1e6)
    return round(sys.getswitchinterval() * 1e6)


class _PauseGate:
    """Test hook (--test-hooks): SIGUSR1 pauses the engine thread before its next engine call, SIGUSR2
    resumes it; calls meanwhile stay in flight, which lets tests hold them without timing."""

    def __init__(self, core: ServiceCore):
        self.open = threading.Event()
        self.open.set()
        run_batch = core.runner.run_batch

        def gated(items):
            self.open.wait()
            return run_batch(items)
        core.runner.run_batch = gated

    def pause(self) -> None:
        self.open.clear()
        event("paused")

    def resume(self) -> None:
        self.open.set()
        event("resumed")


def _bind(flag: str, cfg: ServerConfig, port: int, start):
    """start() binds one port; a failure becomes the one-line StartupError naming `flag`."""
    import zmq

    try:
        return start()
    except (OSError, RuntimeError, zmq.ZMQError) as exc:
        log.debug("bind failed", exc_info=exc, extra={"event": "bind_failed", "flag": flag})
        raise bind_error(flag, cfg.host, port, exc, cfg) from None


async def _listen(cfg: ServerConfig, core: ServiceCore, metrics: Metrics, health_state: HealthState,
                  drain_event: asyncio.Event, opened: list):
    """Bind every port (metrics, health, gRPC, ZMQ); what is open goes into `opened` (to close on failure)."""
    metrics_port = _bind("metrics-port", cfg, cfg.metrics_port, lambda: metrics.serve_http(cfg.host, cfg.metrics_port))
    opened.append(metrics.shutdown_http)
    check_port_free("health-port", cfg.host, cfg.health_port)
    if cfg.serves_grpc:
        check_port_free("grpc-port", cfg.host, cfg.grpc_port)
    health_server, health_port = _bind("health-port", cfg, cfg.health_port,
                                       lambda: build_health_server(health_state, host=cfg.host, port=cfg.health_port))
    await health_server.start()
    opened.append(lambda: health_server.stop(0))
    ports = {"health_port": health_port, "metrics_port": metrics_port}
    grpc_server = zmq_server = None
    if cfg.front_processes:  # the public listeners in processes of their own (drafter.service.front)
        fronts = _start_fronts(cfg, core, health_state)
        opened.append(fronts.close)
        ports.update(await fronts.start())
        return ports, health_server, None, None, fronts
    if cfg.serves_grpc:
        grpc_server, ports["grpc_port"] = _bind("grpc-port", cfg, cfg.grpc_port, lambda: build_main_server(
            DrafterGrpcService(core, drain_event), health_state, host=cfg.host, port=cfg.grpc_port,
            max_message_bytes=cfg.max_message_bytes, keepalive_time_s=cfg.keepalive_time_s,
            keepalive_timeout_s=cfg.keepalive_timeout_s, tls_cert=cfg.tls_cert or None, tls_key=cfg.tls_key or None,
            tls_client_ca=cfg.tls_client_ca or None))
        await grpc_server.start()
        opened.append(lambda: grpc_server.stop(0))
    if cfg.serves_zmq:
        zmq_server = ZmqServer(core, host=cfg.host, port=cfg.zmq_port, max_message_bytes=cfg.max_message_bytes,
                               heartbeat_s=cfg.keepalive_time_s, heartbeat_timeout_s=cfg.keepalive_timeout_s,
                               curve_server_cert=cfg.curve_server_cert or None,
                               curve_clients_dir=cfg.curve_clients_dir or None, ipc_path=cfg.zmq_ipc or None,
                               ipc_mode=cfg.ipc_mode, drop_burst=cfg.zmq_drop_burst,
                               drop_budget_s=cfg.zmq_drop_budget_us / 1e6)
        zmq_server.bound_auth = BoundAuth(required=bool(cfg.tls_client_ca or cfg.curve_server_cert),
                                          insecure_planes=cfg.insecure_bound_planes)
        opened.append(lambda: zmq_server.close(timeout=0.1))
        # the tcp socket binds first: a failure after it is the ipc socket's
        ports["zmq_port"] = _bind("zmq-port", cfg, cfg.zmq_port, lambda: _start_zmq(zmq_server, cfg))
    return ports, health_server, grpc_server, zmq_server, None


def _start_fronts(cfg: ServerConfig, core: ServiceCore, health_state: HealthState):
    """The front processes' handle; a front that exits unasked takes the server out of service (fail closed:
    calls UNAVAILABLE, health and liveness NOT_SERVING, a "front_failed" event and error line)."""
    from drafter.service.front import Fronts

    loop = asyncio.get_running_loop()

    async def take_down(transport: str, code: int) -> None:
        core.start_draining()
        await health_state.set_serving(False)
        await health_state.set_live(False)
        event("front_failed", transport=transport, returncode=code)
        log.error(f"the {transport} front process exited (code {code}): out of service",
                  extra={"event": "front_failed", "transport": transport, "returncode": code})

    fronts = Fronts(cfg, core, lambda transport, code: loop.create_task(take_down(transport, code)))
    health_state.fronts = fronts
    return fronts


def _start_zmq(zmq_server: ZmqServer, cfg: ServerConfig) -> int:
    try:
        return zmq_server.start()
    except Exception as exc:
        if zmq_server.sock is not None and cfg.zmq_ipc:  # tcp is bound: the ipc path failed
            raise StartupError("zmq-ipc", cfg.zmq_ipc, f"cannot bind it ({exc})",
                               "pass a path in a directory this user may write, or leave --zmq-ipc empty") from None
        raise


async def _close_opened(opened: list) -> None:
    for close in reversed(opened):
        try:
            done = close()
            if asyncio.iscoroutine(done) or isinstance(done, asyncio.Future):
                await done
        except Exception as exc:  # noqa: BLE001 - closing after a failed start: keep closing the rest
            log.debug("close after failed start", exc_info=exc)


async def serve(cfg: ServerConfig) -> int:
    cfg.check()
    preflight(cfg)
    switch_us = set_switch_interval(cfg.gil_switch_interval_us)
    engine_cfg = engine_config(cfg)
    loop = asyncio.get_running_loop()
    metrics = Metrics(method=cfg.method)
    core = ServiceCore(metrics=metrics, max_sessions=cfg.max_sessions, batch_window_s=cfg.batch_window_us / 1e6,
                       max_message_bytes=cfg.max_message_bytes, session_idle_timeout_s=cfg.session_idle_timeout_s,
                       allow_cuda_ipc=cuda_support.allowed(cfg.allow_cuda_ipc, cfg.host),
                       quotas=cfg.client_quotas())
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    drain_event = asyncio.Event()
    if cfg.front_processes:
        from drafter.service.front import FanoutHealth

        health_state = FanoutHealth()
    else:
        health_state = HealthState()
    await health_state.set_serving(False)
    await health_state.set_live(True)
    opened: list = []
    try:
        ports, health_server, grpc_server, zmq_server, fronts = await _listen(cfg, core, metrics, health_state,
                                                                              drain_event, opened)
    except BaseException:
        await _close_opened(opened)
        await core.close()
        raise
    if zmq_server is not None and zmq_server.ipc_endpoint:
        ports["zmq_ipc"] = zmq_server.ipc_endpoint
    event("listening", host=cfg.host, gil_switch_interval_us=switch_us, **ports)
    for name in cfg.insecure_transports():  # only reachable through an explicit --insecure-* flag
        log.warning(f"{name} serves unauthenticated clients although the other transport requires auth",
                    extra={"event": "insecure_transport", "transport": name})
    if cfg.insecure_bound_planes and (cfg.tls_client_ca or cfg.curve_server_cert):
        log.warning("--insecure-bound-planes: the ring stream over tcp and the gloo/nccl channels serve anyone who "
                    "can reach their ports and holds a bind id, although the server requires auth",
                    extra={"event": "insecure_transport", "transport": "bound_planes"})
    log.info("listening", extra={"event": "listening", "host": cfg.host, **ports,
                                 "front_processes": cfg.front_processes,
                                 "grpc_tls": bool(cfg.tls_cert), "grpc_mtls": bool(cfg.tls_client_ca),
                                 "zmq_curve": bool(cfg.curve_server_cert), "gil_switch_interval_us": switch_us})

    code = 0
    watchdog = None
    hold = None
    if cfg.test_hold_loading:
        hold = threading.Event()
        loop.add_signal_handler(signal.SIGUSR1, lambda: (hold.set(), loop.remove_signal_handler(signal.SIGUSR1)))
    loading = loop.create_task(core.load(lambda: load_engine(cfg, engine_cfg, hold)))
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        exc = loading.exception()
        known = load_error(cfg, exc)
        if known is None:  # no user mistake we know: the traceback is the report
            log.error("engine failed to load", exc_info=exc, extra={"event": "load_failed"})
        else:
            log.debug("engine failed to load", exc_info=exc, extra={"event": "load_failed"})
            log.error(f"drafter serve: {known}", extra={"event": "load_failed", "flag": known.flag})
        event("failed", reason=str(known or exc))
        code = 1
    elif loading.done():
        if cfg.test_hooks:
            gate = _PauseGate(core)
            loop.add_signal_handler(signal.SIGUSR1, gate.pause)
            loop.add_signal_handler(signal.SIGUSR2, gate.resume)
        if cfg.tensor_parallel_size > 1:  # a lost rank takes the server out of service
            from drafter.service.tp.serving import on_rank_failure

            core.engine.watch(on_rank_failure(loop, core, health_state))
        await health_state.set_serving(True)
        watchdog = loop.create_task(_liveness(core, health_state, cfg.liveness_stall_s))
        event("ready", host=cfg.host, epoch=core.epoch, method=cfg.method, **ports)
        log.info("ready", extra={"event": "ready", "epoch": core.epoch})
        await stopping
    # ------------------------------------------------------------------ drain
    t0 = time.monotonic()
    deadline = t0 + cfg.drain_timeout_s
    core.start_draining()
    drain_event.set()
    await health_state.set_serving(False)
    event("draining", inflight=core.inflight)
    log.info("draining", extra={"event": "draining", "inflight": core.inflight})
    if fronts is not None:  # they refuse new calls and pass on the replies of open ones, then exit
        await fronts.drain(max(0.0, deadline - time.monotonic()))
    clean = await core.wait_idle(max(0.0, deadline - time.monotonic()))
    if fronts is not None:
        await fronts.close()
    if grpc_server is not None:
        await grpc_server.stop(max(0.0, deadline - time.monotonic()))
    if zmq_server is not None:
        await zmq_server.close(timeout=max(0.1, deadline - time.monotonic()))
    await health_server.stop(0)
    if watchdog is not None:
        watchdog.cancel()
    if not loading.done():
        loading.cancel()
    await core.close()
    metrics.shutdown_http()
    seconds = round(time.monotonic() - t0, 3)
    if not clean:
        log.error("drain timed out with calls in flight", extra={"event": "drain_timeout", "inflight": core.inflight})
    event("stopped", clean=clean, seconds=seconds)
    log.info("stopped", extra={"event": "stopped", "clean": clean, "seconds": seconds})
    return code


async def _liveness(core: ServiceCore, health_state: HealthState, stall_s: float) -> None:
    live = True
    while True:
        await asyncio.sleep(min(5.0, stall_s / 4))  # a periodic check, not synchronisation
        now_live = not core.engine_stalled(stall_s)
        if now_live != live:
            live = now_live
            await health_state.set_live(live)
            log.log(logging.INFO if live else logging.ERROR, "liveness changed",
                    extra={"event": "liveness", "live": live})
