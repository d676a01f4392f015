#!/usr/bin/env bash
# Creates .venv-maxtext (Python 3.12) with MaxText and the toolkit in one environment. Idempotent.
#
# MaxText 0.2.5 needs Python >= 3.12 and jax >= 0.11.1, while the main .venv (scripts/setup.sh) stays on
# Python 3.11 and the `train` extra's jax 0.10.2, whose bit patterns the tests and figures were measured on.
# MaxText's base install declares no dependency (its `tpu` extra resolves 239 packages, libtpu included),
# so it is installed with --no-deps beside the `maxtext` extra (the set it imports on CPU), every package
# pinned by integrations/maxtext/constraints.txt (which keeps Beam's numpy<2.5, protobuf<7, pyarrow<26).
# The installer is uv (pinned in the constraints, installed by pip into the environment itself): it
# resolves and installs the same pinned set as pip, in seconds rather than minutes (docs/trainer.md).
# uv reads its own settings (UV_DEFAULT_INDEX, UV_INDEX, UV_CACHE_DIR), not pip's configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON312:-python3.12}
if ! "$PY" -c '' >/dev/null 2>&1; then  # absent, or a pyenv shim with no 3.12 selected
  for cand in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -x "$cand" ] && PY=$cand && break
  done
fi
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
  echo "setup_maxtext.sh: needs Python 3.12 (MaxText 0.2.5 requires it); set PYTHON312=/path/to/python3.12" >&2; exit 2; }
if [ ! -x .venv-maxtext/bin/python ]; then
  "$PY" -m venv .venv-maxtext
fi
C=integrations/maxtext/constraints.txt
UV_VERSION=$(sed -n 's/^uv==//p' "$C")
.venv-maxtext/bin/python -m pip install -q "uv==$UV_VERSION"
UV=(.venv-maxtext/bin/uv pip install --quiet --python .venv-maxtext/bin/python)
"${UV[@]}" -c "$C" -e ".[maxtext]"
"${UV[@]}" --no-deps maxtext==0.2.5
