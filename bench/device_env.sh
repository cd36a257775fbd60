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
