"""Every example command of README.md and docs/*.md runs as written and does what the text says
(tests/e2e/docs_commands.py finds them and says which are skipped here, and why).

The README's first command is the demo: it must end "OK in ..." (output identical to plain
decoding); the load test's fresh-machine line must report its knee; `drafter serve` must become
ready, then drain on SIGTERM and exit 0.
"""

from __future__ import annotations

import shutil

import pytest

from tests.e2e import docs_commands

COMMANDS = docs_commands.all_commands()


def test_the_readme_and_docs_have_runnable_commands():
    ran = {c.doc for c in COMMANDS if not c.skip}
    assert "README.md" in ran and "docs/loadtest.md" in ran, [c.id for c in COMMANDS]
    assert any(c.run == "drafter demo" for c in COMMANDS), "the README's first command is the demo"


def test_a_served_example_binds_free_ports_and_the_ready_line_must_name_each():
    """A port written in the docs (50051 is in the ephemeral range) is bound as 0 here."""
    cmd, keys = docs_commands.free_ports("drafter serve --x 1 --grpc-port 50051 --zmq-port=5555 --health-port  50052 "
                                         "--metrics-port 9400 --max-inflight-per-client 128")
    assert cmd == "drafter serve --x 1 --grpc-port 0 --zmq-port=0 --health-port  0 --metrics-port 0 " \
                  "--max-inflight-per-client 128"
    assert keys == ("grpc_port", "zmq_port", "health_port", "metrics_port")
    served = [c for c in COMMANDS if c.run.startswith("drafter serve") and not c.skip]
    assert served and all(docs_commands.free_ports(c.run)[1] for c in served), [c.id for c in served]


@pytest.fixture(scope="module")
def workdirs():
    """One working directory per document: its commands run in order there, so a later example may
    use what an earlier one wrote (relative paths included)."""
    made: dict[str, object] = {}

    def of(doc: str):
        if doc not in made:
            made[doc] = docs_commands.fresh_workdir()
        return made[doc]
    yield of
    for d in made.values():
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(cmd, workdirs):
    if cmd.skip:
        pytest.skip(f"{cmd.id} `{cmd.text[:60]}`: {cmd.skip}")
    passed, what = docs_commands.run(cmd, workdirs(cmd.doc))
    assert passed, f"{cmd.id}: `{cmd.run}`: {what}"
