#!/usr/bin/env bash
# The prepared GPU check (see benchmarks/gpu/check.py): one run, under 8 minutes on one GPU,
# writing OUT/report.md and OUT/report.json. No network needed.
#
#   bash benchmarks/gpu/check.sh [OUT]            # on the GPU machine (default OUT: gpu-report)
#   bash benchmarks/gpu/check.sh OUT --dry-run    # anywhere: CPU, tiny sizes
#
# vescale must be importable. Where it is not installed and nothing can be fetched (the lent
# GPU machine), build its wheels beforehand with `bash benchmarks/gpu/wheels.sh` (into .whl/):
# this script then installs them into a private directory first.
set -u
cd "$(dirname "$0")/../.."
OUT="${1:-gpu-report}"
shift || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if ! "$PY" -c "import vescale.dmodule, vescale.ragged, vescale.optim, vescale.checkpoint, jsonargparse" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/vescale-site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/vescale-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "vescale is not importable and there are no wheels in .whl/ (bash benchmarks/gpu/wheels.sh)" >&2
    exit 2
  fi
fi
# 475 s for the sections (their own limits sum to 460 s on a GPU) and the report
timeout 475 "$PY" benchmarks/gpu/check.py --out "$OUT" "$@"
rc=$?
echo "GPU check exit code $rc; report: $OUT/report.md"
exit $rc
