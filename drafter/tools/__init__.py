"""Measurement beside the product: nothing in drafter.engine, service, models, attention, kernels
or wire imports this package.

    bench/      `drafter bench` (grid.py: the engine's latency grid) and the probes of the host and
                remote paths: peer, transport, remote, host, service_host (`python -m drafter.tools.bench.X`)
    loadtest/   `drafter loadtest` / `drafter-loadtest`: open-loop load against a drafter service
"""
