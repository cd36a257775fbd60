"""Where a RemoteEagleProposer gets its drafts: the coordinator's RemoteProposer.

    source = make_source(settings, facts)
    source.start()                              # attach now, so the first step's KV reaches the drafter
    drafts = source.propose(**engine_kwargs)    # DraftEngine.propose's keywords; [batch, k] or None
    source.close()

The coordinator (coordinator/remote_proposer.py) owns the policy: one deadline per step (attach
included), fail closed (None) on anything, a circuit breaker per endpoint whose backoff is also the
reconnect schedule, re-attach after a drafter restart, rendezvous routing over several drafters.
This module only says who the vLLM worker is (TargetFacts -> SessionSpec) and where its drafters
are (settings -> endpoints and transports).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

from drafter_vllm.compat import INSTALL_CPU, INSTALL_GPU
from drafter_vllm.settings import PluginSettings

log = logging.getLogger("vllm.drafter_vllm")  # under "vllm": shows in vLLM's log


@dataclass(frozen=True)
class TargetFacts:
    """What one vLLM worker tells the drafter about itself when it attaches."""

    method: str  # eagle | eagle3
    num_speculative_tokens: int
    hidden_size: int  # the target's hidden size (width of one hidden state)
    num_aux_layers: int  # 0: EAGLE-1's final-normed state; n: EAGLE-3's n aux states concatenated
    dtype: str  # of the hidden states, e.g. "bfloat16"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int  # of the KV group whose block table / slot mapping the drafter mirrors
    num_blocks: int
    padded_drafter_batch: bool
    head_dir: str  # the speculative model vLLM was given (the drafter serves the same head)
    target_dir: str
    device: str  # vLLM's device (where drafts must end up)
    client: str  # session key and name in the drafter's logs, e.g. "/models/llama/dp0"


def serve_flags(facts: TargetFacts) -> str:
    """The `drafter serve` flags whose values this engine attaches with (what the drafter checks at
    attach): one engine's KV block count; a drafter serving several engines (DP ranks, replicas) needs
    their sum in --kv-blocks, and --max-num-seqs / --max-num-batched-tokens at least the largest."""
    return (f"--method {facts.method} --model {facts.head_dir} --target-model {facts.target_dir} "
            f"--num-speculative-tokens {facts.num_speculative_tokens} --max-model-len {facts.max_model_len} "
            f"--block-sizes {facts.block_size} --kv-blocks {facts.num_blocks} --max-num-seqs {facts.max_num_seqs} "
            f"--max-num-batched-tokens {facts.max_num_batched_tokens}"
            + ("" if facts.padded_drafter_batch else " --padded-drafter-batch false"))


def check_transport(settings: PluginSettings) -> None:
    """At engine start: a transport whose client cannot even be imported is a set-up error, not a
    drafter outage, so it stops vLLM with a clear message instead of failing closed forever."""
    try:
        import coordinator.remote_proposer  # noqa: F401

        if settings.transport == "inprocess":
            import coordinator.inprocess  # noqa: F401
        else:
            import coordinator.clients  # noqa: F401
            import coordinator.transport  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"drafter plugin: the {settings.transport} client cannot be imported ({exc}); "
                           f"install the plugin with {INSTALL_GPU} ({INSTALL_CPU} on a CPU host)") from exc


def endpoint_source(settings: PluginSettings):
    """DRAFTER_ENDPOINTS -> the router's endpoint source.  One name (a Kubernetes headless Service)
    is re-resolved through DNS, one endpoint per ready drafter pod; a list, or IP literals, is static."""
    from coordinator.routing import DnsEndpoints, Endpoint, StaticEndpoints

    if settings.transport == "inprocess":
        return StaticEndpoints([Endpoint("inprocess", "vllm", 0)])
    parsed = []
    for text in settings.endpoints:  # host:port (settings.py)
        host, _, port = text.rpartition(":")
        parsed.append((host.strip("[]"), int(port)))
    if len(parsed) == 1 and not _is_ip(parsed[0][0]):
        return DnsEndpoints(parsed[0][0], parsed[0][1], settings.transport)
    return StaticEndpoints([Endpoint(settings.transport, h, p) for h, p in parsed])


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def make_source(settings: PluginSettings, facts: TargetFacts):
    from coordinator.remote_proposer import ProposerConfig, RemoteProposer
    from coordinator.routing import Router
    from coordinator.transport.bound_transport import BoundConfig
    from coordinator.session import SessionSpec
    from drafter.engine.config import KVGroupSpec

    _share_vllm_log_handlers()
    spec = SessionSpec(
        method=facts.method, num_speculative_tokens=facts.num_speculative_tokens, hidden_size=facts.hidden_size,
        num_aux_layers=facts.num_aux_layers, max_model_len=facts.max_model_len, max_num_seqs=facts.max_num_seqs,
        max_num_batched_tokens=facts.max_num_batched_tokens,
        kv_groups=(KVGroupSpec(facts.block_size, facts.num_blocks),), dtype=facts.dtype, client=facts.client)
    return RemoteProposer(spec, router=Router(endpoint_source(settings)), key=facts.client,
                          connect=_connector(settings, facts),
                          config=ProposerConfig(deadline_s=settings.deadline_s, bound=BoundConfig(mode=settings.bound)))


def _connector(settings: PluginSettings, facts: TargetFacts):
    if settings.transport == "inprocess":
        cache = {}

        def connect_inprocess(ep):
            # the drafter's engine inside vLLM's process (no network; tests and debugging: the head
            # is loaded next to the target again); loaded once, sessions come and go
            if ep not in cache:
                from coordinator.inprocess import InProcessTransport

                cache[ep] = InProcessTransport(facts.head_dir, facts.target_dir, facts.method,
                                               device=facts.device)
            return cache[ep]

        return connect_inprocess

    curve, tls = settings.curve_config(), settings.tls_config()  # None unless set (validated in settings)

    def connect(ep):
        from coordinator.clients import ServiceTransport

        return ServiceTransport(ep, timeout_s=settings.deadline_s, curve=curve, tls=tls)

    return connect


def _share_vllm_log_handlers() -> None:
    """The coordinator logs session events (attached, session lost, circuit open/closed) under
    "coordinator"; inside vLLM they belong in vLLM's log, next to the plugin's own lines."""
    coordinator_log, vllm_log = logging.getLogger("coordinator"), logging.getLogger("vllm")
    if coordinator_log.handlers or not vllm_log.handlers:
        return
    for handler in vllm_log.handlers:
        coordinator_log.addHandler(handler)
    coordinator_log.setLevel(logging.INFO)
    coordinator_log.propagate = False
