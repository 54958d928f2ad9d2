"""Print a success marker, then exit non-zero (exercises ``run_torchrun(expect_marker=...)``)."""

import sys

print("MARKER-OK", flush=True)
sys.exit(3)
