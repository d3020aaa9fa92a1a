#!/usr/bin/env bash
# A server command with the OpenAI-compatible frontend beside it, the two supervised together:
#
#   scripts/serve_openai.sh SERVER_COMMAND [ARGS...]
#
# scripts/serve.sh runs itself under it (`make serve`), the Neuron image runs
# tritonserver_restricted.sh under it. The frontend is `python -m v4flash_backend.openai_api` on
# 127.0.0.1:$OPENAI_PORT (9000; OPENAI_HOST to bind elsewhere), talking to tritonserver's gRPC port
# $GRPC_PORT (8001), rendering chat prompts with $V4FLASH_CHECKPOINT_DIR's chat format, and asking
# clients for the key in $V4FLASH_OPENAI_KEY_FILE when that is set (a file of mode 600 holding one
# token of >= 16 characters of [A-Za-z0-9._~+/-], as the admin key file: scripts/triton_restrict.sh).
#
# Supervision:
#   - the server command exits (a clean stop, an error, or serve.sh giving up after crashes): the
#     frontend is stopped and this script exits with the server's code;
#   - the frontend dies: it is started again after 1, 2, 4 ... 30 s (it holds no state; tritonserver
#     keeps serving its own ports meanwhile, and while tritonserver restarts the frontend answers
#     503), at most OPENAI_MAX_RESTARTS times (5; the count starts again after 10 minutes up); then
#     the server is stopped too and the script exits non-zero;
#   - Ctrl-C / SIGTERM stops both (the server command gets SIGTERM: serve.sh forwards it to
#     tritonserver, whose v4flash model stops its rank group).
# V4FLASH_PYTHON: the interpreter of the frontend (default .venv/bin/python, else python3).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
(($#)) || { echo "usage: scripts/serve_openai.sh SERVER_COMMAND [ARGS...]" >&2; exit 2; }
PY=${V4FLASH_PYTHON:-}
if [[ -z $PY ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi
port=${OPENAI_PORT:-9000}
frontend=("$PY" -m v4flash_backend.openai_api --grpc-url "127.0.0.1:${GRPC_PORT:-8001}" --host "${OPENAI_HOST:-127.0.0.1}"
    --port "$port")
[[ -n ${V4FLASH_CHECKPOINT_DIR:-} ]] && frontend+=(--checkpoint "$V4FLASH_CHECKPOINT_DIR")
[[ -n ${V4FLASH_OPENAI_KEY_FILE:-} ]] && frontend+=(--api-key-file "$V4FLASH_OPENAI_KEY_FILE")
max_restarts=${OPENAI_MAX_RESTARTS:-5}

stopping=0
server= fe=
on_stop() {
    stopping=1
    [[ -n $server ]] && kill -TERM "$server" 2>/dev/null
    [[ -n $fe ]] && kill -TERM "$fe" 2>/dev/null
}
trap on_stop INT TERM

start_frontend() {
    (cd "$ROOT" && PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} exec "${frontend[@]}") &
    fe=$!
    fe_started=$SECONDS
    echo "[serve_openai] OpenAI API on http://${OPENAI_HOST:-127.0.0.1}:$port/v1 (pid $fe)" >&2
}

# a port already taken (another `make serve`?) would make the frontend die at every restart: say so now
if (exec 3<>"/dev/tcp/${OPENAI_HOST:-127.0.0.1}/$port") 2>/dev/null; then
    echo "[serve_openai] ${OPENAI_HOST:-127.0.0.1}:$port is already in use: set OPENAI_PORT to a free port (or off)" >&2
    exit 1
fi
"$@" &
server=$!
start_frontend
restarts=0
backoff=1
while :; do
    done_pid=
    wait -n -p done_pid "$server" "$fe"
    rc=$?
    if [[ -z ${done_pid:-} ]]; then  # a trapped signal ended the wait
        ((stopping)) || continue
        break
    fi
    if [[ $done_pid == "$server" ]]; then
        server=
        echo "[serve_openai] the server exited with code $rc; stopping the OpenAI frontend" >&2
        kill -TERM "$fe" 2>/dev/null
        wait "$fe" 2>/dev/null
        exit "$rc"
    fi
    fe=
    ((stopping)) && break
    ((SECONDS - fe_started >= 600)) && restarts=0 && backoff=1
    if ((restarts >= max_restarts)); then
        echo "[serve_openai] the OpenAI frontend exited with code $rc; $restarts restart(s) already, stopping" \
            "the server too (OPENAI_MAX_RESTARTS=$max_restarts)" >&2
        kill -TERM "$server" 2>/dev/null
        wait "$server" 2>/dev/null
        exit 1
    fi
    restarts=$((restarts + 1))
    echo "[serve_openai] the OpenAI frontend exited with code $rc; restarting it in ${backoff} s" \
        "(restart $restarts of at most $max_restarts)" >&2
    sleep "$backoff" &
    wait $! 2>/dev/null
    ((stopping)) && break
    backoff=$((backoff * 2 > 30 ? 30 : backoff * 2))
    start_frontend
done
# stopping: both were sent SIGTERM; wait for them (the server's rank group stops in its finalize)
rc=0
[[ -n $server ]] && { wait "$server"; rc=$?; }
[[ -n $fe ]] && wait "$fe" 2>/dev/null
exit "$rc"
