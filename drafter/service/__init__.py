"""The drafter's network service: one core behind a gRPC and a ZMQ transport.

    drafter serve --method eagle3 --model DIR/head --target-model DIR/target --device cuda:0
    (or DRAFTER_METHOD=eagle3 DRAFTER_MODEL=... drafter serve; see `drafter serve --help`)

Files, one concept each:
    schema.py       msgspec Structs mirroring proto/drafter/v1/drafter.proto (the ZMQ headers)
    wire.py         tensors {dtype, shape, raw bytes} <-> torch with strict checks; proto/Struct codecs
    pbwire.py       ProposeRequest on the gRPC wire without protobuf copying the payloads
    errors.py       DrafterError(code, field, message); codes = gRPC status codes
    sessions.py     the session table: layout checks, a contiguous KV block range per session
    batcher.py      the engine thread: fusing requests of several sessions into one engine call, jobs
    core.py         attach / propose / detach / info, epochs, loading / serving / draining
    grpc_server.py  grpc.aio server, grpc.health.v1, reflection, limits, keepalive, mTLS
    zmq_server.py   ROUTER sockets (tcp://, ipc://), zero-copy tensor frames, CURVE, replies from the
                    engine thread;  zmqio.py: multipart send/recv;  ipc.py: ipc:// path rules
    cuda_ref.py     a CUDA IPC reference to a target's GPU hidden states: decode, field-by-field checks
    cuda_ipc.py     opening references in the engine thread: torch's IPC, driver extent check, LRU per session
    cuda_support.py who may share: host boot id, GPU uuids, --allow-cuda-ipc, what Attach/Info advertise
    probes.py       opt-in per-stage timing of propose calls (drafter.bench_transport, bench_remote)
    metrics.py      Prometheus metrics on /metrics
    server.py       process wiring, ready line, SIGTERM drain;  config.py / serve_cli.py: settings
Clients (target side): coordinator/transport/{grpc_client,zmq_client}.py (cuda_share.py: share_cuda=True).
"""
