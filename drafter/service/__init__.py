"""The drafter's network service: one core behind a gRPC and a ZMQ transport.

    drafter serve --method eagle3 --model DIR/head --target-model DIR/target --device cuda:0
    (or DRAFTER_METHOD=eagle3 DRAFTER_MODEL=... drafter serve; see `drafter serve --help`)

Files, one concept each:
    schema.py       msgspec Structs mirroring proto/drafter/v1/drafter.proto (the ZMQ headers)
    wire.py         tensors {dtype, shape, raw bytes} <-> torch with strict checks; proto/Struct codecs
    errors.py       DrafterError(code, field, message); codes = gRPC status codes
    sessions.py     the session table: layout checks, a contiguous KV block range per session
    batcher.py      fusing requests of several sessions into one engine call, in one engine thread
    core.py         attach / propose / detach / info, epochs, loading / serving / draining
    grpc_server.py  grpc.aio server, grpc.health.v1, reflection, limits, keepalive, mTLS
    zmq_server.py   ROUTER socket, zero-copy tensor frames, CURVE
    metrics.py      Prometheus metrics on /metrics
    server.py       process wiring, ready line, SIGTERM drain;  config.py / serve_cli.py: settings
Clients (target side): coordinator/transport/{grpc_client,zmq_client}.py.
"""
