"""Tensor-parallel serving: `drafter serve --tensor-parallel-size N`.

    leader.py   rank 0, inside the server: spawns ranks 1 .. N-1, loads its shard, stands in for
                the engine (TPEngine): validates each call, sends it to the workers, runs it too
    worker.py   ranks 1 .. N-1: load their shard, run each step the leader sends, never serve
    channel.py  a step's header over a pipe per worker, its tensors in one broadcast
    steps.py    a draft step's message and its rebuilding on a worker

The model side (which rank holds which heads, columns and vocabulary rows, and the collectives
between them) is drafter.models.sharding / llama_shard / deepseek_shard.
"""
