"""DP rank -> drafter endpoint: rendezvous hashing is stable and moves only what it must."""

from __future__ import annotations

import socket

import pytest

from coordinator.routing import (DnsEndpoints, Endpoint, Router, StaticEndpoints, assign, rank, score,
                                 session_key)

KEYS = [session_key("target", d) for d in range(64)]


def _eps(n, scheme="grpc"):
    return [Endpoint(scheme, f"10.0.0.{i}", 50051) for i in range(1, n + 1)]


def test_endpoint_parsing_round_trips():
    for text in ("grpc://127.0.0.1:50051", "zmq://localhost:5555", "grpc://[::1]:7"):
        assert str(Endpoint.parse(text)) == text
    for bad in ("127.0.0.1:5", "grpc://host", "http://h:1", "grpc://h:x"):
        with pytest.raises(ValueError):
            Endpoint.parse(bad)


def test_mapping_is_stable_across_client_restarts_and_input_order():
    eps = _eps(4)
    first = assign(KEYS, eps)
    # a "restarted client": new objects, shuffled list, a router over a static source
    again = {k: Router(StaticEndpoints(list(reversed([str(e) for e in eps])))).rank(k)[0] for k in KEYS}
    assert first == again
    assert score("target/dp0", eps[0]) == score("target/dp0", Endpoint.parse(str(eps[0])))


def test_load_spreads_over_endpoints():
    counts = {}
    for ep in assign(KEYS, _eps(4)).values():
        counts[ep] = counts.get(ep, 0) + 1
    assert len(counts) == 4 and min(counts.values()) >= 8  # 64 keys over 4: no endpoint starves


def test_only_the_sessions_of_a_vanished_endpoint_move():
    eps = _eps(4)
    before = assign(KEYS, eps)
    gone = eps[1]
    after = assign(KEYS, [e for e in eps if e != gone])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == gone} and moved
    for k in moved:  # each goes to its runner-up: the fail-over order is the ranking
        assert after[k] == rank(k, eps)[1]
    # when it comes back, exactly those keys return
    assert assign(KEYS, eps) == before


def test_a_new_endpoint_takes_only_keys_it_wins():
    eps = _eps(3)
    before = assign(KEYS, eps)
    new = Endpoint("grpc", "10.0.0.99", 50051)
    after = assign(KEYS, eps + [new])
    assert all(after[k] in (before[k], new) for k in KEYS)


def test_two_drafters_four_dp_ranks():
    """The issue's case: four DP ranks over two drafters; stable, and one drafter's loss moves only its own."""
    a, b = Endpoint("grpc", "127.0.0.1", 6001), Endpoint("zmq", "127.0.0.1", 6002)
    keys = [session_key("demo", d) for d in range(4)]
    m = assign(keys, [a, b])
    assert m == assign(keys, [b, a])
    without_a = assign(keys, [b])
    assert {k for k in keys if m[k] != without_a[k]} == {k for k in keys if m[k] == a}


def test_dns_source_with_an_injected_resolver_and_the_router_cache():
    answers = {"drafter.ns.svc": ["10.1.0.7", "10.1.0.5", "10.1.0.5"]}
    calls = []

    def resolver(name, port, type=None):
        calls.append(name)
        if name not in answers:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers[name]]

    now = [0.0]
    router = Router(DnsEndpoints("drafter.ns.svc", 50051, "grpc", resolver=resolver), refresh_s=5.0,
                    clock=lambda: now[0])
    assert router.endpoints() == (Endpoint("grpc", "10.1.0.5", 50051), Endpoint("grpc", "10.1.0.7", 50051))
    answers["drafter.ns.svc"] = ["10.1.0.5"]  # a pod went away ...
    assert len(router.endpoints()) == 2 and len(calls) == 1  # ... seen only after refresh_s
    now[0] = 5.0
    assert router.endpoints() == (Endpoint("grpc", "10.1.0.5", 50051),)
    del answers["drafter.ns.svc"]  # DNS hiccup: keep the last good list, move nobody
    now[0] = 10.0
    assert router.endpoints() == (Endpoint("grpc", "10.1.0.5", 50051),) and router.last_error is not None


def test_dns_source_resolves_localhost_for_real():
    eps = DnsEndpoints("localhost", 6000, "zmq").resolve()
    assert eps and all(e.host in ("127.0.0.1", "::1") and e.port == 6000 for e in eps)


def test_static_source_needs_an_endpoint():
    with pytest.raises(ValueError):
        StaticEndpoints([])
