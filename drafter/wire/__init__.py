"""What a target's client and the drafter's server both speak; imports neither side.

Files, one concept each:
    schema.py    msgspec Structs mirroring proto/drafter/v1/drafter.proto (the ZMQ headers)
    tensors.py   tensors {dtype, shape, raw bytes} <-> torch with strict checks; proto/Struct codecs
    pbwire.py    ProposeRequest on the gRPC wire without protobuf copying the payloads
    errors.py    DrafterError(code, field, message), the engine's InvalidInput; codes = gRPC status codes
    cuda_ref.py  a CUDA IPC reference to a target's GPU hidden states: decode, checks; host / GPU identity
    zmqio.py     multipart send / receive on pyzmq's Cython socket methods
    ipc.py       ipc:// path rules both ends apply
    probes.py    opt-in per-stage timing of propose calls on both ends (the transport benches)
The server is drafter.service; the client library is coordinator (coordinator.transport).
"""
