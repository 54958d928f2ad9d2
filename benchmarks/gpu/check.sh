#!/usr/bin/env bash
# The prepared GPU check (see benchmarks/gpu/check.py): one run, under 8 minutes on one GPU,
# writing OUT/report.md and OUT/report.json. No network needed.
#
#   bash benchmarks/gpu/check.sh [OUT]            # on the GPU machine (default OUT: gpu-report)
#   bash benchmarks/gpu/check.sh OUT --dry-run    # anywhere: CPU, tiny sizes
set -u
cd "$(dirname "$0")/../.."
OUT="${1:-gpu-report}"
shift || true
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
PY="${PYTHON:-python}"
# 470 s for the sections (their own limits sum to 460 s on a GPU) + a margin for the report
timeout 480 "$PY" benchmarks/gpu/check.py --out "$OUT" "$@"
rc=$?
echo "GPU check exit code $rc; report: $OUT/report.md"
exit $rc
