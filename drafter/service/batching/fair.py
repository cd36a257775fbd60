"""Fair queueing between clients: the requests that wait for the engine, one FIFO per client, and
batches formed round-robin across clients, so one client's backlog never holds another's request
behind it.

A client is what drafter.wire.records.Caller.client names (the authenticated peer, else the
connection).  Each client's own requests keep their arrival order; between clients, each batch
takes one request per client per round, starting with the client that has waited longest since it
was last served.  Engine-thread only: nothing here is locked.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drafter.service.batching.queue import Pending


class FairQueue:
    """Per-client FIFOs served round-robin (see the module docstring)."""

    def __init__(self):
        # rotation order: the first client is served first; a client served moves to the back.  Each entry
        # is (request, its batch rows, its tokens), read once when it is pushed.
        self._clients: OrderedDict[str, deque[tuple[Pending, int, int]]] = OrderedDict()
        self.rows = 0  # batch rows waiting, over every client
        self.tokens = 0  # tokens waiting, over every client

    def __len__(self) -> int:
        return sum(len(q) for q in self._clients.values())

    def __bool__(self) -> bool:
        return bool(self._clients)

    def push(self, it: Pending) -> None:
        b, n = it.call.batch_size, it.call.num_tokens
        q = self._clients.get(it.client)
        if q is None:
            q = self._clients[it.client] = deque()  # a new client joins at the back of the rotation
        q.append((it, b, n))
        self.rows += b
        self.tokens += n

    def take(self, max_batch: int, max_tokens: int) -> list[Pending]:
        """The next batch: one request per client per round, in rotation order, while the batch stays
        within max_batch rows and max_tokens tokens.  A client whose next request does not fit is
        skipped for this batch and stays at the front of the rotation; the first request is always
        taken (the runner refuses what no batch can hold)."""
        if len(self._clients) == 1:
            return self._take_one(max_batch, max_tokens)
        items: list[Pending] = []
        rows = tokens = 0
        skipped: set[str] = set()
        while self._clients and rows < max_batch and tokens < max_tokens:
            served = False
            for key in list(self._clients):
                if key in skipped:
                    continue
                q = self._clients[key]
                it, b, n = q[0]
                if items and (rows + b > max_batch or tokens + n > max_tokens):
                    skipped.add(key)
                    continue
                q.popleft()
                items.append(it)
                rows, tokens, served = rows + b, tokens + n, True
                if q:
                    self._clients.move_to_end(key)
                else:
                    del self._clients[key]
                if rows >= max_batch or tokens >= max_tokens:
                    break
            if not served:
                break
        self.rows -= rows
        self.tokens -= tokens
        return items

    def _take_one(self, max_batch: int, max_tokens: int) -> list[Pending]:
        """take() when one client waits: its requests in order, while they fit."""
        key, q = next(iter(self._clients.items()))
        items: list[Pending] = []
        rows = tokens = 0
        while q:
            it, b, n = q[0]
            if items and (rows + b > max_batch or tokens + n > max_tokens):
                break
            q.popleft()
            items.append(it)
            rows, tokens = rows + b, tokens + n
            if rows >= max_batch or tokens >= max_tokens:
                break
        if not q:
            del self._clients[key]
        self.rows -= rows
        self.tokens -= tokens
        return items

    def drain(self) -> list[Pending]:
        """Everything waiting, taken out (to abandon it)."""
        out = [it for q in self._clients.values() for it, _, _ in q]
        self._clients.clear()
        self.rows = self.tokens = 0
        return out
