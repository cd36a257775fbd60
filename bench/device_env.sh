# Sourced by the device scripts (run_on_gpu.sh, run_tp.sh, run_predraft.sh): the environment every
# device call starts from.  OUT (default /tmp/drafter-out) exists afterwards; the carried wheels in
# .whl/ (pyzmq, msgspec, grpcio... the device host lacks) are installed into /tmp/site, which leads
# PYTHONPATH after the checkout itself.
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
OUT=${OUT:-/tmp/drafter-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

# describe_device: the machine each record was measured on, into $OUT/gpu.txt and onto stdout (the GPUs,
# their link matrix when there are several, the date, torch and Triton).
describe_device() {
  { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
    [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 1 ] && nvidia-smi topo -m
    date -u +%FT%TZ
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt" 2>&1
  cat "$OUT/gpu.txt"
}
