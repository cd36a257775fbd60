#!/usr/bin/env bash
# Run every example command of README.md and docs/*.md as written (bounded, loopback only) and
# say which ones this machine skips and why (tests/e2e/docs_commands.py has the rules; a block
# opts out with `<!-- docs-check: skip REASON -->` on the line before its fence).  CI runs the
# same check as part of the test suite (tests/e2e/test_docs_commands.py).
#   bash scripts/check_docs.sh            # run them
#   bash scripts/check_docs.sh --list     # only list them
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--list" ]; then
  exec python3 -m tests.e2e.docs_commands
fi
exec python3 -m pytest -q -p no:cacheprovider -rs tests/e2e/test_docs_commands.py "$@"
