#!/usr/bin/env bash
# make demo: the real pyproxy daemon, one per node of a three-node, two-zone cluster built
# from network namespaces, with real backends and clients (demo/run.py, run as
# `python -m demo.run`). Everything kernel-side lives in pyproxy-demo-* namespaces, removed on
# exit (also on Ctrl-C).
#   scripts/demo.sh           run, show, clean up
#   scripts/demo.sh --keep    leave the cluster running until Enter / Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=.venv/bin/python
if [ ! -x "$PYTHON" ]; then
  echo "demo: $PYTHON missing; run 'make demo' (it builds the virtualenv first)" >&2
  exit 1
fi
exec "$PYTHON" -m demo.run "$@"  # from the repository root: it imports the test kit
