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
