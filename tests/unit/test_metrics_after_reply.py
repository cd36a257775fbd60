"""A scrape right after a reply counts that call (issue 20, item 5).

The ZMQ transport sends a Propose reply from the engine thread and records the call's metrics
afterwards in the event loop.  Here that recording is held back (the reply's bookkeeping is
deferred) and released only when a scrape has started: the scrape must still count the call.
Before the ReplyLedger the scrape returned at once without it (the 1-in-8 `2.0 == 3` of
test_metrics_during_a_run under load); with it, the scrape waits for the bookkeeping.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.transport import ZmqDrafterClient
from drafter.service import zmq_server
from drafter.wire import schema
from drafter.service.metrics import ReplyLedger
from tests.support.core import run_with_core
from tests.support.engines import build_engine
from tests.support.scenario import Scenario

MML, BLOCKS = 96, 24


@pytest.fixture(scope="module")
def engine(tiny_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(tiny_root, "eagle3", k=3, max_model_len=MML, num_blocks=2 * BLOCKS)
    torch.set_num_threads(threads)


def _latency_count(url: str) -> float:
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "drafter_propose_latency_seconds_count" and s.labels.get("transport") == "zmq")


def _layout(core):
    d = core.desc
    return schema.AttachRequest(protocol_version=1, method="eagle3", num_speculative_tokens=3, hidden_dtype="float32",
                                hidden_size=d.hidden_size, num_aux_layers=d.num_aux_layers, max_model_len=MML,
                                max_num_seqs=4, max_num_batched_tokens=128,
                                kv_groups=[schema.KVGroup(block_size=16, num_blocks=BLOCKS)])


def test_scrape_after_a_zmq_reply_counts_the_call(engine, monkeypatch):
    held = []  # (reply state, result): bookkeeping held back until a scrape waits for it
    released = threading.Event()
    account = zmq_server._ProposeReply.done

    def done(state, result):  # event loop
        if released.is_set():
            account(state, result)
        else:
            held.append((state, result))
    monkeypatch.setattr(zmq_server._ProposeReply, "done", done)

    async def body(core):
        loop = asyncio.get_running_loop()
        url = f"http://127.0.0.1:{core.metrics.serve_http('127.0.0.1', 0)}/metrics"
        server = zmq_server.ZmqServer(core, host="127.0.0.1", port=0, max_message_bytes=1 << 26)
        server.start()
        client = ZmqDrafterClient(f"tcp://127.0.0.1:{server.port}", timeout_s=30)

        def release_in_loop():
            released.set()
            for st, r in held:
                account(st, r)

        def release():  # the scrape is waiting: now the event loop records the held calls
            loop.call_soon_threadsafe(release_in_loop)
        core.metrics.replies.on_wait = release
        try:
            await loop.run_in_executor(None, client.attach, _layout(core))
            s = Scenario(block_sizes=(16,), num_blocks=(BLOCKS,), vocab_size=engine.spec.vocab_size,
                         hidden_width=engine.spec.hidden_input_width, k=3, max_model_len=MML, seed=3)
            s.add_request(0)
            kwargs = s.call([(0, 12, 0)]).kwargs
            out = await loop.run_in_executor(None, lambda: client.propose(**kwargs))
            assert out.draft_token_ids.shape == (1, 3)  # the reply is here, its metrics are held back
            count = await loop.run_in_executor(None, _latency_count, url)
            assert released.is_set(), "the scrape did not wait for the reply's bookkeeping"
            assert count == 1
            assert await loop.run_in_executor(None, _latency_count, url) == 1  # nothing left open: no wait
        finally:
            client.close()
            await server.close()
            core.metrics.shutdown_http()
    run_with_core(engine, body)


def test_ledger_waits_only_for_tickets_taken_before_the_scrape():
    ledger = ReplyLedger(wait_s=30)
    waits = []
    ledger.on_wait = lambda: waits.append(1)
    assert ledger.settle() and not waits  # nothing open
    first = ledger.sent()
    ledger.on_wait = lambda: (waits.append(1), ledger.recorded(first))  # returned while the scrape waits
    assert ledger.settle() and waits == [1]
    ledger.recorded(first)  # returning twice is harmless
    assert ledger.settle()
    short = ReplyLedger(wait_s=0.0)
    short.sent()  # never returned: a wedged loop
    assert short.settle() is False  # the scrape goes ahead without it
