#!/usr/bin/env bash
# AIPerf 0.13 (NVIDIA's successor of genai-perf) against a running server: v4flash_text through
# AIPerf's generic template endpoint on Triton's HTTP generate_stream (SSE), or (--openai) the
# OpenAI frontend's /v1/chat/completions in AIPerf's OpenAI chat mode; streaming, fixed input and
# output lengths (ignore_eos, no spread), then one summary line:
#   aiperf: ttft_ms=<avg> itl_ms=<avg> output_tok_s=<avg> requests=<n> errors=<e>
#
#   make serve &                                   # wait for /v2/health/ready = 200
#   perf/run_aiperf.sh --url http://127.0.0.1:8000 [extra aiperf profile args]
#   perf/run_aiperf.sh --openai --url http://127.0.0.1:9000 [--api-key-file F] [extra args]
#
# In --openai mode the output tokens are the server's (usage, --use-server-token-count) and the key
# (if the frontend asks for one: V4FLASH_OPENAI_KEY_FILE) is read from --api-key-file.
#
#   ISL (32) / OSL (32): prompt and output tokens per request; CONCURRENCY (2); REQUESTS (12);
#   OUT (artifacts/aiperf): the artifact directory; AIPERF_VENV (/tmp/aiperf-venv): AIPerf's own
#   venv, created on first use with `pip install aiperf==0.13.*` (it needs Python >= 3.11, found as
#   $AIPERF_PYTHON, else python3.11 or python3; never the project's .venv: it pulls transformers,
#   pandas, textual ...); TOKENIZER (models/v4flash-tiny): what AIPerf counts tokens with (the
#   served model's tokenizer; its prompts are synthesised from it too).
#
# The template renders Triton's generate-extension request ({"text_input", "max_tokens",
# "ignore_eos", "stream"}); response_field text_output picks each SSE event's text. AIPerf counts
# output tokens by re-tokenizing that text, so output_tok_s is in the tokenizer's tokens.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
URL=
OPENAI=0
KEY_FILE=
extra=()
while (($#)); do
    case $1 in
        --url) URL=$2; shift 2 ;;
        --url=*) URL=${1#--url=}; shift ;;
        --openai) OPENAI=1; shift ;;
        --api-key-file) KEY_FILE=$2; shift 2 ;;
        *) extra+=("$1"); shift ;;
    esac
done
[[ -n $URL ]] || { echo "usage: perf/run_aiperf.sh [--openai [--api-key-file F]] --url http://HOST:PORT [aiperf profile args]" >&2; exit 2; }
AIPERF_VENV=${AIPERF_VENV:-/tmp/aiperf-venv}
ISL=${ISL:-32}
OSL=${OSL:-32}
CONCURRENCY=${CONCURRENCY:-2}
REQUESTS=${REQUESTS:-12}
OUT=${OUT:-$ROOT/artifacts/aiperf}
TOKENIZER=${TOKENIZER:-$ROOT/models/v4flash-tiny}
MODEL=v4flash_text

if [[ ! -x $AIPERF_VENV/bin/aiperf ]]; then
    py=${AIPERF_PYTHON:-$(command -v python3.11 || command -v python3)}
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        { echo "[run_aiperf] AIPerf needs Python >= 3.11; set AIPERF_PYTHON" >&2; exit 1; }
    "$py" -m venv "$AIPERF_VENV"
    "$AIPERF_VENV/bin/pip" install -q "aiperf==0.13.*"
fi

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd -P)
if ((OPENAI)); then
    # the frontend's model name; ignore_eos (vLLM's extension) fixes the output length; usage counts it
    MODEL=v4flash
    endpoint=(--endpoint-type chat --streaming --extra-inputs ignore_eos:true --use-server-token-count)
    [[ -n $KEY_FILE ]] && endpoint+=(--api-key "$(tr -d ' \t\r\n' <"$KEY_FILE")")
else
    # the template goes in a file: --extra-inputs splits an inline value at its commas (AIPerf reads a
    # payload_template that names a regular file, reached through no symlink, as the template)
    template=$OUT/v4flash_text.template.json
    printf '{"text_input": {{ text|tojson }}, "max_tokens": %d, "ignore_eos": true, "stream": true}\n' "$OSL" >"$template"
    endpoint=(--endpoint-type template --custom-endpoint "/v2/models/$MODEL/generate_stream" --streaming
        --extra-inputs "payload_template:$template" --extra-inputs "response_field:text_output")
fi
"$AIPERF_VENV/bin/aiperf" profile --model "$MODEL" --url "$URL" "${endpoint[@]}" \
    --tokenizer "$TOKENIZER" --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OSL" --output-tokens-stddev 0 \
    --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --random-seed 7 \
    --ui-type none --artifact-dir "$OUT" "${extra[@]}"

export_json=$(find "$OUT" -name profile_export_aiperf.json -printf '%T@ %p\n' | sort -n | tail -1 | cut -d' ' -f2-)
[[ -n $export_json ]] || { echo "[run_aiperf] no profile_export_aiperf.json under $OUT" >&2; exit 1; }
"$AIPERF_VENV/bin/python" - "$export_json" <<'PY'
import json
import sys

d = json.load(open(sys.argv[1]))  # profile_export_aiperf.json: one {unit, avg, p50, ...} per metric


def avg(name, unit=None):
    m = d.get(name) or {}
    if unit and m.get("unit") not in (None, unit):
        sys.exit(f"[run_aiperf] {name} is in {m.get('unit')}, expected {unit}")
    return m.get("avg")


def num(v, fmt="{:.2f}"):
    return "nan" if v is None else fmt.format(v)


errors = avg("error_request_count")
if errors is None:  # no error metric: count the summary's entries
    errors = sum(int(e.get("count", 1)) for e in d.get("error_summary") or [])
print(f"[run_aiperf] export: {sys.argv[1]}")
# the last line, exactly as issue 34 gives it (other tools read it)
print(f"aiperf: ttft_ms={num(avg('time_to_first_token', 'ms'))} itl_ms={num(avg('inter_token_latency', 'ms'))} "
      f"output_tok_s={num(avg('output_token_throughput'))} requests={num(avg('request_count'), '{:.0f}')} "
      f"errors={int(errors)}")
PY
