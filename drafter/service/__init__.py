"""The drafter's network service: one core behind a gRPC and a ZMQ transport.

    drafter serve --method eagle3 --model DIR/head --target-model DIR/target --device cuda:0
    (or DRAFTER_METHOD=eagle3 DRAFTER_MODEL=... drafter serve; see `drafter serve --help`)

Files, one concept each (what both ends speak is drafter.wire):
    sessions.py     the session table: layout checks, a contiguous KV block range per session
    batching/       the engine thread: queue.py (EngineThread, Batcher), checks.py, stage.py (HostStager),
                    fuse.py, runner.py (EngineRunner: one engine call for several sessions), deliver.py
    core.py         attach / propose / detach / info, epochs, loading / serving / draining
    grpc_server.py  grpc.aio server, grpc.health.v1, reflection, limits, keepalive, mTLS
    zmq_server.py   ROUTER sockets (tcp://, ipc://), zero-copy tensor frames, CURVE, replies from the
                    engine thread
    cuda_ipc.py     opening references in the engine thread: torch's IPC, driver extent check, LRU per session
    cuda_support.py who may share: host boot id, GPU uuids, --allow-cuda-ipc, what Attach/Info advertise
    metrics.py      Prometheus metrics on /metrics
    server.py       process wiring, ready line, SIGTERM drain;  config.py / serve_cli.py: settings
Clients (target side): coordinator/transport/{grpc_client,zmq_client}.py (cuda_share.py: share_cuda=True).
"""
