"""Fused batching (the engine thread of the service): requests of several sessions, collected within a window, run as ONE engine call.

Everything that touches the engine runs in one dedicated thread (EngineThread: the engine is not
thread-safe, and the event loop must stay free for the transports).  The event loop posts each
checked request straight into that thread's queue (no asyncio task or executor future between
them); the engine thread collects what arrives within the window, runs it, copies the drafts to
the host, and hands every result of the batch back with ONE loop.call_soon_threadsafe, whose
callback answers first (a ZMQ reply is sent from it) and does the bookkeeping after.  Plain jobs
(loading the engine, wiping a detached session's blocks) run on the same thread, in arrival order.

In the engine thread each request is checked on its own first (session still alive, deadline,
finite hidden states, the engine's full validation of its shifted block ids), so a bad one is
refused alone and never reaches the fused call; the good ones are concatenated, padded to
common block-table widths, run, and their drafts split back.  On a GPU the hidden states are
staged through one pinned host buffer that the engine thread reuses (never pinned per call), so
their host-to-device copy is a real asynchronous DMA.

Files, one concern each:
    queue.py    Pending requests, the engine's one thread (EngineThread) and the window that collects
                a batch (Batcher)
    fair.py     FairQueue: the collected requests, one FIFO per client, batches formed round-robin
    checks.py   what each request passes in the engine thread before it may join a batch
    stage.py    HostStager: the one reusable (pinned) host buffer a call is copied into
    fuse.py     several sessions' requests concatenated into one engine call
    runner.py   EngineRunner: check, plan, fuse, run one engine call, split the drafts
    deliver.py  results back to the event loop(s), one wake-up per loop and batch
"""
