#!/usr/bin/env bash
# The end-to-end demo on an input every machine has: the local Python installation.
#   1. set-up (.venv, project installed)
#   2. dataprep: export pydoc topics + stdlib sources, train a tokenizer, pack with Beam
#   3. reference MoE trainer: train a few dozen steps on the packed rows, logging fingerprints
#   4. replay: rerun a step range on good devices and diff fingerprints; canary on every device;
#      scan the run's logs (replica norms, canaries, router health: the board must be clean)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=build/demo   # configs/runs/demo.yaml reads the dataset from here
STEPS=${DEMO_STEPS:-40}
bash scripts/setup.sh
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
PY=.venv/bin/python
$PY -m dataprep.demo --out "$OUT"
rm -rf "$OUT/run"
$PY -m replay.reference.train --run "$OUT/run" --config configs/runs/demo.yaml --steps "$STEPS"
.venv/bin/replay --run "$OUT/run" --steps "$((STEPS - 10)):$STEPS" --devices good --json "$OUT/replay.json" --plot "$OUT/replay.png"
.venv/bin/replay canary --run "$OUT/run" --devices all
.venv/bin/replay scan --run "$OUT/run" --json "$OUT/scan.json" --plot "$OUT/scan.png"   # exit 8 (suspects) stops the demo
echo "demo done: dataset in $OUT/dataset, run in $OUT/run, replay report in $OUT/replay.json"
