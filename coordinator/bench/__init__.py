"""Client-side benchmarks: what the target's side of the remote path costs (run as
`python -m coordinator.bench.<name>`).  Measurement only: the client library never imports it."""
