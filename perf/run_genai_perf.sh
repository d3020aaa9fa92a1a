#!/usr/bin/env bash
# genai-perf 0.0.16 in vllm mode against `make serve` (the command of issue 15), then a check that
# its export shows the requested output sequence length.
#
#   make serve &                       # wait for http://127.0.0.1:8000/v2/health/ready = 200
#   perf/run_genai_perf.sh             # URL=127.0.0.1:8001 by default; extra args go to genai-perf
#
# genai-perf lives in its own venv ($GENAI_VENV, default /tmp/genai-venv; created on first use
# with `pip install genai-perf==0.0.16`), never in the project's .venv: it pulls transformers,
# pandas, plotly... Its `perf-analyzer` 0.1.0 dependency ships no binary, so the perf_analyzer
# 2.51 binary of tritonclient in .venv is put first on PATH (scripts/triton_env.sh).
#
# --warmup-request-count: perf_analyzer 2.51 (r24.10) sends warm-up requests forever when the
# count is below the concurrency (a worker thread gets a request budget of 0, which its
# load_worker.cc reads as "unlimited"); fixed upstream in perf_analyzer 11583244 (#112, r24.11).
# Give a count >= --concurrency, or none.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GENAI_VENV=${GENAI_VENV:-/tmp/genai-venv}
URL=${URL:-127.0.0.1:8001}
OUT=${OUT:-$ROOT/artifacts/genai-perf}
export COLUMNS=${COLUMNS:-150}  # rich prints genai-perf's table this wide (80 wraps every label)

if [[ ! -x $GENAI_VENV/bin/genai-perf ]]; then
    python3 -m venv "$GENAI_VENV"
    "$GENAI_VENV/bin/pip" install -q genai-perf==0.0.16
fi
# shellcheck source=/dev/null
source "$ROOT/scripts/triton_env.sh"
mkdir -p "$OUT"
cd "$OUT"
"$GENAI_VENV/bin/genai-perf" profile -m v4flash_text --backend vllm --streaming -u "$URL" \
    --tokenizer "$ROOT/models/v4flash-tiny" --synthetic-input-tokens-mean 32 \
    --output-tokens-mean 32 --output-tokens-mean-deterministic --concurrency 2 --request-count 12 "$@"
export_json=$(ls -t artifacts/*/profile_export_genai_perf.json | head -1)
python3 - "$export_json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
osl, ttft, itl = d["output_sequence_length"], d["time_to_first_token"], d["inter_token_latency"]
print(f"genai-perf: export={sys.argv[1]} osl_avg={osl['avg']:.1f} osl_min={osl['min']:.0f} "
      f"osl_max={osl['max']:.0f} ttft_p50_ms={ttft['p50']:.1f} itl_p50_ms={itl['p50']:.1f} "
      f"output_tok_s={d['output_token_throughput']['avg']:.2f}")
PY
