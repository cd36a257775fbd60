"""coordinator: the target side of the drafter.

The client library target engines import sits at this level: remote_proposer, circuit, routing,
session, dp_agreement, tp, inprocess, clients and transport/ (gRPC, ZMQ, CUDA IPC sharing); it
speaks drafter.wire and never imports drafter.service.  coordinator.target is the reference
target engine (with distillation), coordinator.demo the demo and the TP x DP fleet; the client
library imports neither.
"""
