#!/usr/bin/env bash
# Wheels for a GPU machine without network (run here, where pip reaches its index):
# vescale's five packages (pure Python) and the trainer's config parser, into .whl/
# (git-ignored through .git/info/exclude). `check.sh` installs them when vescale is missing.
set -eu
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PY="${PYTHON:-python3}"
for pkg in packages/vescale-*/; do
  "$PY" -m pip wheel -q --no-deps -w .whl "$pkg"
done
# jsonargparse: pure Python; its needs (PyYAML, typing-extensions) are on the GPU image
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "jsonargparse>=4.49"
ls -l .whl
