#!/usr/bin/env bash
# The project's test command (README and .ci/run both call it).  Two lanes, side by side:
#   vLLM lane (background): build the vLLM 0.32 CPU venv (.venv-vllm, inside the clone), record proposer
#            calls from a real vLLM engine on tiny checkpoints (.vllm-recordings), then run the tests
#            marked `vllm` (they need that venv or those recordings).  Its output is printed when it ends.
#   main lane (foreground): every other test, on two pytest-xdist workers (XDIST below).
# Why side by side: one pytest process alone keeps a core only ~3/4 busy (many tests wait on the servers
# and ranks they start), so the vLLM lane and two workers together fill CI's two cores.
# XDIST: a whole file to a worker (module fixtures start once, the docs' commands run in order in one
# directory), the slowest files first (tests/conftest.py's SLOW_FILES, not xdist's reordering by size);
# a -n of your own after it wins (-n 0: one process).
# Set DRAFTER_VLLM_RECORDINGS=DIR to reuse a recorded suite: no vLLM stage, one pytest run of every test.
# A -m/--markexpr of your own also gets one run of everything after the vLLM stage (no lanes).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTEST=(python3 -m pytest -q -p no:cacheprovider)
# (-p no:benchmark: a pytest-benchmark on the machine, which no test uses, would warn that xdist turns it off)
XDIST=(-n 2 --dist loadfile --no-loadscope-reorder -p no:benchmark)
if [ -n "${DRAFTER_VLLM_RECORDINGS:-}" ]; then
  exec "${PYTEST[@]}" "${XDIST[@]}" tests "$@"
fi
RECORDINGS="$PWD/.vllm-recordings"

vllm_stage() {
  # the venv (once), then the recordings; the venv build says itself when it starts from scratch
  local t0
  t0=$(date +%s)
  [ -x .venv-vllm/bin/python ] || echo "building the vLLM 0.32 CPU venv in .venv-vllm (once: 2-3 min, up to 3.5 GB)"
  # explicit returns: the lane calls this function in an || list, where set -e does not apply
  bash tests/vllm_parity/setup_venv.sh .venv-vllm || return $?
  VLLM_PY="$PWD/.venv-vllm/bin/python" PYTHON=python3 bash tests/vllm_parity/record_suite.sh "$RECORDINGS" || return $?
  echo "vLLM recording stage: $(( $(date +%s) - t0 ))s"
}

own_marker=0
for arg in "$@"; do
  case "$arg" in -m|-m*|--markexpr|--markexpr=*) own_marker=1 ;; esac
done
if [ "$own_marker" = 1 ]; then
  vllm_stage
  export DRAFTER_VLLM_RECORDINGS="$RECORDINGS"
  exec "${PYTEST[@]}" "${XDIST[@]}" tests "$@"
fi

mkdir -p "$RECORDINGS"
lane_log="$RECORDINGS/vllm-lane.log"
main_out="$(mktemp)"
t0=$(date +%s)
echo "vLLM lane (venv, recordings, the tests marked vllm) runs beside the other tests; its output follows theirs (log: ${lane_log#"$PWD/"})"
[ -x .venv-vllm/bin/python ] || echo "  (its first run builds the vLLM 0.32 CPU venv in .venv-vllm: 2-3 min, up to 3.5 GB)"
# in its own session (setsid: its own process group), so that an interrupted run stops all of it
export RECORDINGS
export -f vllm_stage
lane_cmd='rc=0; vllm_stage || rc=$?
if [ "$rc" = 0 ]; then
  DRAFTER_VLLM_RECORDINGS="$RECORDINGS" python3 -m pytest -q -p no:cacheprovider -m vllm tests "$@" || rc=$?
fi
exit "$rc"'
if command -v setsid >/dev/null 2>&1; then
  setsid bash -c "$lane_cmd" vllm-lane "$@" > "$lane_log" 2>&1 &
else
  bash -c "$lane_cmd" vllm-lane "$@" > "$lane_log" 2>&1 &
fi
lane=$!
trap 'kill -- -$lane 2>/dev/null || kill $lane 2>/dev/null; exit 130' INT TERM HUP

main_rc=0
"${PYTEST[@]}" "${XDIST[@]}" -m "not vllm" tests "$@" | tee "$main_out" || main_rc=${PIPESTATUS[0]}

# the vLLM lane usually ends first; while it has not, a line every 20 s says it is still going
bash -c 'while sleep 20 > /dev/null 2>&1; do echo "  ... waiting for the vLLM lane: $(( $(date +%s) - $1 ))s"; done' ticker "$t0" &
ticker=$!
lane_rc=0
wait "$lane" || lane_rc=$?
kill "$ticker" 2>/dev/null || true
trap - INT TERM HUP
echo
echo "==================== vLLM lane (${lane_log#"$PWD/"}) ===================="
cat "$lane_log"

# pytest's exit status 5 is "no test selected" (a -k of yours that selects no vllm test, or only those)
if [ "$main_rc" = 5 ] && [ "$lane_rc" = 5 ]; then
  rc=5
elif [ "$main_rc" != 0 ] && [ "$main_rc" != 5 ]; then
  rc=$main_rc
elif [ "$lane_rc" != 0 ] && [ "$lane_rc" != 5 ]; then
  rc=$lane_rc
else
  rc=0
fi
summary() { grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran' "$1" | tail -1 | tr -d '='; }
echo "scripts/test.sh: $(( $(date +%s) - t0 ))s; tests without vLLM (exit $main_rc):$(summary "$main_out");" \
     "vLLM lane (exit $lane_rc):$(summary "$lane_log")"
rm -f "$main_out"
exit "$rc"
