#!/usr/bin/env bash
# What `make serve` runs: set up what is missing, then run tritonserver in the foreground
# with model_repository/ on 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002; override with
# HTTP_PORT, GRPC_PORT, METRICS_PORT). Ready when /v2/health/ready answers 200; Ctrl-C stops
# it (the v4flash model's finalize() stops its rank group).
#
# Beside it, the OpenAI-compatible API on 127.0.0.1:$OPENAI_PORT (9000; OPENAI_PORT=off: none):
# this script runs itself under scripts/serve_openai.sh, which starts the frontend and supervises
# the two together (a dead frontend is restarted, a server that exits takes the frontend with it,
# Ctrl-C stops both). V4FLASH_OPENAI_KEY_FILE=<file, mode 600>: clients must send its key
# (Authorization: Bearer <key>).
#
#   scripts/serve.sh [extra tritonserver args]
#
# Supervision: when tritonserver dies of a signal (a crash: SIGSEGV, SIGABRT, SIGKILL by hand or
# by the OOM killer), it is started again after a back-off of 1, 2, 4, ... 30 s, each restart
# logged as "[serve] tritonserver ... restarting"; at most SERVE_MAX_RESTARTS times (default 5;
# the count starts again after a run of 10 minutes; 0: no supervision, the script becomes
# tritonserver as before). An exit with a code (a model that fails to load, a bad flag) is not
# retried: it would fail the same way. Ctrl-C or SIGTERM stops the server and the loop. The
# crashed server's rank group does not outlive it (its ranks watch the Triton stub that launched
# them and the server), so the new server's group finds the cores free; whatever else is left of
# the dead server's session (a hung stub) is killed before the restart. In production a container
# orchestrator restarts the container instead: set SERVE_MAX_RESTARTS=0 there.
#
# Setup (each step is skipped when already done):
#   1. .venv and the package (make venv), tritonserver + clients + backend dir (make triton);
#   2. the checkpoint: the v4flash model's checkpoint_dir parameter when set, else
#      $V4FLASH_CHECKPOINT_DIR, else the embedded default models/v4flash-tiny, else the golden
#      tiny checkpoint ../shared/golden/v41-tiny (random weights: serves, but the text is
#      noise). The choice is printed, and exported as V4FLASH_CHECKPOINT_DIR so that the
#      preprocessing/postprocessing models load the same tokenizer.
#
# Opt-in: V4FLASH_RESTRICT_ADMIN=1 with V4FLASH_ADMIN_KEY_FILE=<file, mode 600> puts Triton's
# shared-memory, model-repository, trace and logging protocols (HTTP and gRPC) behind the header
# v4flash-admin-key: <the file's key> (scripts/triton_restrict.sh); inference, health, metadata,
# model-config, statistics and metrics stay open. The Neuron image does this by default.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export MODEL_REPOSITORY=${MODEL_REPOSITORY:-$ROOT/model_repository}

# (checked before anything starts: a missing or open key file stops here, frontend or not)
restrict=()
if [[ ${V4FLASH_RESTRICT_ADMIN:-0} == 1 ]]; then
    # shellcheck source=scripts/triton_restrict.sh
    source scripts/triton_restrict.sh
    restrict_args "${V4FLASH_ADMIN_KEY_FILE:-}" || exit 1
    restrict=("${RESTRICT_ARGS[@]}")
fi

# Under serve_openai.sh (below) this script runs a second time, for tritonserver alone: the setup,
# the checkpoint and the environment are the first run's.
if [[ -z ${V4FLASH_OPENAI_SUPERVISED:-} ]]; then
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

# The checkpoint the v4flash model will serve (same rules as serving/triton_settings.py).
ckpt=$(PYTHONPATH=src .venv/bin/python - "$MODEL_REPOSITORY" <<'EOF'
import sys
from v4flash_backend.serving.triton_settings import repository_checkpoint_dir
path, why = repository_checkpoint_dir(sys.argv[1])
print(f"[serve] checkpoint {path} ({why})", file=sys.stderr)
print(path)
EOF
)
export V4FLASH_CHECKPOINT_DIR=$ckpt
# The engine's own files (the step-cost profiles of the eager steps and of the compiled rounds), so
# that a restart loads them instead of timing them again (ready sooner): .cache/state unless the
# variable is set (the images set /var/lib/v4flash; set and empty: nothing is written).
export V4FLASH_STATE_DIR=${V4FLASH_STATE_DIR-$ROOT/.cache/state}
# inductor's compiled graphs (the CPU default decode path) beside them, where a reboot keeps them
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/inductor}

if [[ ${OPENAI_PORT:-9000} != off ]]; then
    export V4FLASH_OPENAI_SUPERVISED=1
    exec bash scripts/serve_openai.sh bash "$ROOT/scripts/serve.sh" "$@"
fi
fi

if ((${#restrict[@]})); then
    echo "[serve] $RESTRICT_APIS restricted to requests with the header $RESTRICT_HEADER" >&2
fi
echo "[serve] tritonserver on 127.0.0.1: http ${HTTP_PORT:-8000}, grpc ${GRPC_PORT:-8001}, metrics ${METRICS_PORT:-8002}; ready when http://127.0.0.1:${HTTP_PORT:-8000}/v2/health/ready answers 200" >&2
max_restarts=${SERVE_MAX_RESTARTS:-5}
if ((max_restarts <= 0)); then
    exec bash scripts/run_tritonserver.sh "${restrict[@]}" "$@"
fi

stopping=0
pid=
on_stop() {
    stopping=1
    [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null
}
trap on_stop INT TERM
restarts=0
backoff=1
while :; do
    started=$SECONDS
    # its own session (setsid, same pid: a background job here leads no process group), so that
    # what a crashed server leaves behind can be killed with it; run_tritonserver.sh's foreground
    # mode then execs tritonserver, so $pid is the server's
    setsid bash scripts/run_tritonserver.sh "${restrict[@]}" "$@" &
    pid=$!
    rc=0
    while :; do  # a trapped signal ends `wait` early: wait again until the server is gone
        wait "$pid" && rc=0 || rc=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    ran=$((SECONDS - started))
    # the python-backend stubs of a crashed server can hang instead of exiting (a stub waiting on
    # the dead server), holding memory and their rank group's watch: end whatever is left of it
    kill -KILL -- "-$pid" 2>/dev/null || true
    if ((stopping)); then
        exit "$rc"
    fi
    if ((rc <= 128)); then  # a clean exit or an error exit: not a crash
        echo "[serve] tritonserver exited with code $rc after ${ran} s" >&2
        exit "$rc"
    fi
    ((ran >= 600)) && restarts=0 && backoff=1
    if ((restarts >= max_restarts)); then
        echo "[serve] tritonserver (pid $pid) died of signal $((rc - 128)) after ${ran} s; $restarts restart(s) already, giving up (SERVE_MAX_RESTARTS=$max_restarts)" >&2
        exit "$rc"
    fi
    restarts=$((restarts + 1))
    echo "[serve] tritonserver (pid $pid) died of signal $((rc - 128)) after ${ran} s; restarting in ${backoff} s (restart $restarts of at most $max_restarts)" >&2
    sleep "$backoff" &
    wait $! || true
    ((stopping)) && exit "$rc"
    backoff=$((backoff * 2 > 30 ? 30 : backoff * 2))
done
