#!/usr/bin/env bash
# The end-to-end demo on an input every machine has: the local Python installation.
#   1. set-up (.venv, project installed)
#   2. dataprep: export pydoc topics + stdlib sources, train a tokenizer, pack with Beam
#   3. reference MoE trainer: train 30 steps on the packed rows (crossing the mixture's phase
#      change at step 25), logging fingerprints and screening signals
#   4. replay: rerun steps 20:30 on good devices and diff fingerprints; canary on every device;
#      scan the run's logs (replica norms, canaries, router health: the board must be clean)
# Stages 2-4 are scripts/demo.py: each prints its command, its progress and its wall time, and
# the demo ends with a table of stages and the files written. DEMO_STEPS changes the step count.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
export DEMO_SETUP_S=$(( $(date +%s) - start ))
exec .venv/bin/python scripts/demo.py "$@"
