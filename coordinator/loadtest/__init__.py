"""`drafter loadtest`: an RPC load generator for the drafter service.

One concept per module:
  workload  simulated target sessions (DP ranks): realistic batches, prefill/decode mix, valid KV layout
  schedule  open loop (Poisson / constant send times, fixed up front) and closed loop (N in flight)
  clients   the coordinator's transport clients, also measuring message sizes
  runner    threads driving the sessions; deadlines, errors by code, warm-up, bounds
  stats     percentiles and throughput from the recorded samples
  report    JSON report + PNG (latency over time and its distribution)
  progress  the progress bar
  spawn     --spawn-server: a local `drafter serve` on loopback
  shapes    --shape: random-weight heads of real shapes (e.g. an EAGLE-3 head for Llama-3.1-8B)
  cli       the `loadtest` subcommand and the `drafter-loadtest` script
"""
