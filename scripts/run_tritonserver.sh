#!/usr/bin/env bash
# Runs the tritonserver installed by scripts/setup_triton.sh on loopback only.
#
#   scripts/run_tritonserver.sh [options] [-- extra tritonserver args]
#     (no option)          run in the foreground (exec), Ctrl-C stops it
#     --wait [SECONDS]     start in the background (own session), wait until
#                          /v2/health/ready answers 200 (default 300 s), then exit 0
#                          leaving the server running; exit 1 if it dies or times out
#     --stop               stop the background server named by the pid file
#     --log FILE           background log (default .triton/tritonserver.log)
#     --pid-file FILE      background pid file (default .triton/tritonserver.pid)
#
#   Environment: MODEL_REPOSITORY (default <repo>/model_repository), HTTP_PORT (8000),
#   GRPC_PORT (8001), METRICS_PORT (8002). The address is always 127.0.0.1: the
#   server's default is 0.0.0.0, and nothing here is meant to be reachable from
#   other hosts.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL_REPOSITORY=${MODEL_REPOSITORY:-$ROOT/model_repository}
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
ADDRESS=127.0.0.1

mode=foreground
wait_s=300
log_file=$ROOT/.triton/tritonserver.log
pid_file=$ROOT/.triton/tritonserver.pid
extra=()
while (($#)); do
    case $1 in
        --wait)
            mode=background
            if [[ ${2:-} =~ ^[0-9]+$ ]]; then wait_s=$2; shift; fi ;;
        --stop) mode=stop ;;
        --log) log_file=$2; shift ;;
        --pid-file) pid_file=$2; shift ;;
        --) shift; extra+=("$@"); break ;;
        *) extra+=("$1") ;;
    esac
    shift
done

if [[ $mode == stop ]]; then
    [[ -f $pid_file ]] || { echo "[run_tritonserver] no pid file $pid_file" >&2; exit 1; }
    pid=$(cat "$pid_file")
    if kill -0 "$pid" 2>/dev/null; then
        # SIGTERM lets the server unload models (their finalize() runs); SIGKILL the
        # whole session (the server and its python stubs) if that takes too long.
        kill -TERM "$pid"
        for _ in $(seq 1 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "[run_tritonserver] server $pid still running after 60 s, killing its session" >&2
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
        fi
    fi
    rm -f "$pid_file"
    exit 0
fi

# shellcheck source=scripts/triton_env.sh
source "$ROOT/scripts/triton_env.sh"
[[ -e $TRITON_BACKEND_DIR/python/triton_python_backend_stub ]] || {
    echo "[run_tritonserver] no backend directory at $TRITON_BACKEND_DIR: run scripts/setup_triton.sh" >&2
    exit 1
}

# The python backend stub's embedded interpreter takes sys.prefix from the first
# `python` on PATH: the stub venv (numpy 1.26 + the project venv; see
# setup_triton.sh for why numpy 2 cannot be used there).
[[ -x $TRITON_STUB_VENV/bin/python ]] || {
    echo "[run_tritonserver] no stub venv at $TRITON_STUB_VENV: run scripts/setup_triton.sh" >&2
    exit 1
}
export PATH=$TRITON_STUB_VENV/bin:$PATH

# --allow-gpu-metrics=false and --pinned-memory-pool-byte-size=0 silence the NVML,
# DCGM and pinned-memory errors on hosts without a GPU (the CPU and Trainium case).
cmd=(tritonserver
    --model-repository "$MODEL_REPOSITORY"
    --backend-directory "$TRITON_BACKEND_DIR"
    --cache-directory "$TRITON_CACHE_DIR"
    --http-address "$ADDRESS" --http-port "$HTTP_PORT"
    --grpc-address "$ADDRESS" --grpc-port "$GRPC_PORT"
    --metrics-address "$ADDRESS" --metrics-port "$METRICS_PORT"
    --allow-gpu-metrics=false --pinned-memory-pool-byte-size=0
    "${extra[@]}")

if [[ $mode == foreground ]]; then
    exec "${cmd[@]}"
fi

if [[ -f $pid_file ]] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
    echo "[run_tritonserver] a server from $pid_file is already running (pid $(cat "$pid_file"))" >&2
    exit 1
fi
mkdir -p "$(dirname "$log_file")" "$(dirname "$pid_file")"
# setsid: the server and its stub processes form their own session, so --stop can
# take them all down without touching anything else.
setsid "${cmd[@]}" >"$log_file" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$pid_file"

show_errors() {  # the server's error lines (model load failures), else its last lines
    local errors
    errors=$(grep -E '^E[0-9]{4} |^error:' "$log_file" | grep -v 'CudaDriverHelper\|unable to create stream' | cut -c1-400 || true)
    if [[ -n $errors ]]; then echo "$errors" | tail -n 20 >&2; else tail -n 20 "$log_file" >&2; fi
}
url=http://$ADDRESS:$HTTP_PORT/v2/health/ready
ready() {  # curl where present, else the venv's Python
    if command -v curl >/dev/null; then
        [[ $(curl -s -o /dev/null -w '%{http_code}' "$url" 2>/dev/null || true) == 200 ]]
    else
        python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$url" 2>/dev/null
    fi
}
deadline=$((SECONDS + wait_s))
while ((SECONDS < deadline)); do
    if ! kill -0 "$pid" 2>/dev/null; then
        echo "[run_tritonserver] tritonserver exited during startup; errors from $log_file:" >&2
        show_errors
        rm -f "$pid_file"
        exit 1
    fi
    if ready; then
        echo "[run_tritonserver] ready: pid $pid, http $ADDRESS:$HTTP_PORT, grpc $ADDRESS:$GRPC_PORT, metrics $ADDRESS:$METRICS_PORT, log $log_file"
        exit 0
    fi
    sleep 0.5
done
echo "[run_tritonserver] not ready after ${wait_s}s; stopping it. Errors from $log_file:" >&2
show_errors
kill -TERM "$pid" 2>/dev/null || true
sleep 2
kill -KILL -- "-$pid" 2>/dev/null || true
rm -f "$pid_file"
exit 1
