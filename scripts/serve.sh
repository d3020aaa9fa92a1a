#!/usr/bin/env bash
# What `make serve` runs: set up what is missing, then run tritonserver in the foreground
# with model_repository/ on 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002; override with
# HTTP_PORT, GRPC_PORT, METRICS_PORT). Ready when /v2/health/ready answers 200; Ctrl-C stops
# it (the v4flash model's finalize() stops its rank group).
#
#   scripts/serve.sh [extra tritonserver args]
#
# Setup (each step is skipped when already done):
#   1. .venv and the package (make venv), tritonserver + clients + backend dir (make triton);
#   2. the checkpoint: the v4flash model's checkpoint_dir parameter when set, else
#      $V4FLASH_CHECKPOINT_DIR, else the embedded default models/v4flash-tiny, else the golden
#      tiny checkpoint ../shared/golden/v41-tiny (random weights: serves, but the text is
#      noise). The choice is printed, and exported as V4FLASH_CHECKPOINT_DIR so that the
#      preprocessing/postprocessing models load the same tokenizer.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export MODEL_REPOSITORY=${MODEL_REPOSITORY:-$ROOT/model_repository}

# Setup is skipped when everything it makes is there (a quick check, so a running CI or a
# second `make serve` does not touch pip); otherwise the Makefile's own targets do it.
ready() {
    [[ -x .venv/bin/python ]] && PYTHONPATH=src .venv/bin/python -c 'import v4flash_backend, tritonclient, tokenizers, torch' 2>/dev/null &&
        [[ -e .triton/backends/python/triton_python_backend_stub && -x .triton/stub-venv/bin/python ]]
}
if ! ready; then
    if command -v make >/dev/null; then
        make --no-print-directory venv triton
    else
        [[ -x .venv/bin/python ]] || { echo "[serve] no .venv and no make: python3.11 -m venv .venv && .venv/bin/pip install -e ." >&2; exit 1; }
        bash scripts/setup_triton.sh
    fi
fi

# The checkpoint the v4flash model will serve (same rules as serving/settings.py).
ckpt=$(PYTHONPATH=src .venv/bin/python - "$MODEL_REPOSITORY" <<'EOF'
import sys
from v4flash_backend.serving.settings import repository_checkpoint_dir
path, why = repository_checkpoint_dir(sys.argv[1])
print(f"[serve] checkpoint {path} ({why})", file=sys.stderr)
print(path)
EOF
)
export V4FLASH_CHECKPOINT_DIR=$ckpt

echo "[serve] tritonserver on 127.0.0.1: http ${HTTP_PORT:-8000}, grpc ${GRPC_PORT:-8001}, metrics ${METRICS_PORT:-8002}; ready when http://127.0.0.1:${HTTP_PORT:-8000}/v2/health/ready answers 200" >&2
exec bash scripts/run_tritonserver.sh "$@"
