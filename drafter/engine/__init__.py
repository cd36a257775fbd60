"""The draft engine and what it drives, in process (no network).

    engine.py       DraftEngine: load a head, own its paged KV pool, draft for one batch (propose / draft)
    config.py       EngineConfig (one frozen config, validated at the edge), KVGroupSpec, capture sizes
    inputs.py       the checks of one call's tensors (validate), Limits
    buffers.py      static input buffers the eager path and the graphs read
    proposer.py     the draft loop: first pass, k - 1 steps, sampling (sampling.py)
    kv_cache.py     paged KV pools per group, the hidden-state store
    graphs.py       CUDA graphs: capture and replay of the whole draft step
    bound.py        bound buffers: a trusted caller's persistent inputs read in place
The tensors of one call are drafter.wire.records.ProposeInputs; the kernels are drafter.kernels.
"""
