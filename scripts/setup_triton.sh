#!/usr/bin/env bash
# Installs a CPU-capable Triton Inference Server (2.51.0) and its clients into the
# repo's .venv and lays out the backend directory tritonserver needs.
#
#   - nvidia-pytriton==0.7.0 only as the carrier of the prebuilt tritonserver binary,
#     the python backend and its per-Python-version stubs; PyTriton's own Python API
#     is never imported, so the wheel goes in with --no-deps (its numpy<2 pin would
#     downgrade the numpy that torch and ml_dtypes use).
#   - tritonclient==2.51.0 (same release as the server; its wheel ships
#     bin/perf_analyzer built for glibc 2.34) with the dependencies of its [all]
#     extra, again without its numpy<2 pin (tritonclient's numpy use is plain
#     ndarray (de)serialisation) and without cuda-python (CUDA shared memory only).
#   - nvidia-cuda-runtime-cu12: perf_analyzer links libcudart.so.12 even on CPU.
#   - Debian libb64-0d: perf_analyzer links libb64.so.0d.
#   - .triton/stub-venv: the interpreter environment of the python backend stubs.
#     The 2.51 stub is built with pybind11 < 2.12 (internals v4), which reads numpy's
#     1.x C struct layout: under numpy 2 every tensor it hands to Python gets zero
#     strides (a BYTES input "你好" arrives as bytes 06 06 06 06 ..., failing with
#     "unpack_from requires a buffer of at least 101058058 bytes"). So the stubs run
#     in a venv of the same base Python holding only numpy 1.26.4, with a .pth that
#     appends the project venv's site-packages (tokenizers, torch, ml_dtypes, ... all
#     import fine on numpy 1.26). run_tritonserver.sh puts its bin/ first on PATH.
#   - .triton/backends/python/: SYMLINKS to the wheel's libtriton_python.so,
#     triton_python_backend_utils.py and the stub for this venv's Python. A copy
#     of the stub would break its relative RPATH; pointing --backend-directory at
#     the wheel's own backends/ fails ("triton_python_backend_stub is not found").
#     See /work/shared/notes/triton.md section 6.
#
# Idempotent: every step checks first and does nothing when already done.
# Usage: scripts/setup_triton.sh            (VENV=/path/to/venv to override)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
TRITON_DIR=${TRITON_DIR:-$ROOT/.triton}

STUB_NUMPY_VERSION=1.26.4
PYTRITON_VERSION=0.7.0
TRITONCLIENT_VERSION=2.51.0
CUDART_VERSION=12.9.79
# tritonclient[all] 2.51.0 requirements minus numpy<2 and cuda-python (see above).
CLIENT_DEPS=(
    "grpcio>=1.41.0"
    "protobuf>=3.5.0,<5"
    "python-rapidjson>=0.9.1"
    "urllib3>=2.0.7"
    "aiohttp>=3.8.1,<4.0.0"
    "geventhttpclient>=1.4.4,<=2.0.2"
    "packaging>=14.1"
)

log() { echo "[setup_triton] $*"; }
# --no-warn-conflicts: the numpy<2 and PyTriton-API pins above are knowingly unmet.
# The grep drops pip's notes about this machine's absent local index folders.
pip_install() {  # pip_install [--python TARGET_PYTHON] ARGS...: into the venv, or TARGET's
    local target=()
    if [[ $1 == --python ]]; then target=(--python "$2"); shift 2; fi
    "$PY" -m pip "${target[@]}" install -q --no-warn-conflicts "$@" \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}

if [[ ! -x $PY ]]; then
    echo "[setup_triton] no Python at $PY; create the venv first (python3.11 -m venv .venv)" >&2
    exit 1
fi

# --- Python packages -------------------------------------------------------
# Prints the requirements from the argument list that are not met in the venv.
missing_requirements() {
    "$PY" - "$@" <<'EOF'
import sys
from importlib import metadata
from packaging.requirements import Requirement  # pip vendors it; also a client dep
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        print(spec)
        continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        print(spec)
EOF
}

# packaging itself is needed by the check above.
if ! "$PY" -c 'import packaging.requirements' 2>/dev/null; then
    pip_install "packaging>=14.1"
fi

mapfile -t todo_nodeps < <(missing_requirements \
    "nvidia-pytriton==$PYTRITON_VERSION" "tritonclient==$TRITONCLIENT_VERSION" \
    "nvidia-cuda-runtime-cu12==$CUDART_VERSION")
if ((${#todo_nodeps[@]})); then
    log "pip install --no-deps ${todo_nodeps[*]}"
    pip_install --no-deps "${todo_nodeps[@]}"
fi
mapfile -t todo_deps < <(missing_requirements "${CLIENT_DEPS[@]}")
if ((${#todo_deps[@]})); then
    log "pip install ${todo_deps[*]}"
    pip_install "${todo_deps[@]}"
fi

# --- Debian packages (perf_analyzer) ---------------------------------------
if ! dpkg-query -W -f='${Status}' libb64-0d 2>/dev/null | grep -q 'install ok installed'; then
    SUDO=""
    if [[ $(id -u) != 0 ]]; then
        command -v sudo >/dev/null || { echo "[setup_triton] need root (or sudo) to apt-get install libb64-0d" >&2; exit 1; }
        SUDO=sudo
    fi
    log "apt-get install -y libb64-0d"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libb64-0d >/dev/null
fi

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PYVER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

# --- the stubs' environment: numpy 1.x + the project venv -----------------
STUB_VENV=$TRITON_DIR/stub-venv
BASE_PY=$("$PY" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
if [[ -x $STUB_VENV/bin/python ]] &&
    [[ $("$STUB_VENV/bin/python" -c 'import sys; print(sys.version)') != "$("$PY" -c 'import sys; print(sys.version)')" ]]; then
    log "stub venv Python differs from $PY; recreating it"
    rm -rf "$STUB_VENV"
fi
if [[ ! -x $STUB_VENV/bin/python ]]; then
    log "creating $STUB_VENV"
    "$BASE_PY" -m venv --without-pip "$STUB_VENV"
fi
STUB_SITE=$("$STUB_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ $("$STUB_VENV/bin/python" -c 'import numpy; print(numpy.__version__)' 2>/dev/null) != "$STUB_NUMPY_VERSION" ]]; then
    log "numpy==$STUB_NUMPY_VERSION into $STUB_VENV"
    pip_install --python "$STUB_VENV/bin/python" --no-deps "numpy==$STUB_NUMPY_VERSION"
fi
# site.addsitedir appends the project venv's site-packages after the stub venv's own
# (so numpy 1.26 wins) and also runs its .pth files (editable installs).
echo "import site; site.addsitedir('$SITE')" >"$STUB_SITE/zz_project_venv.pth"

# --- backend directory of symlinks ----------------------------------------
TS_HOME=$SITE/pytriton/tritonserver
STUB=$TS_HOME/python_backend_stubs/$PYVER/triton_python_backend_stub
[[ -x $TS_HOME/bin/tritonserver ]] || { echo "[setup_triton] $TS_HOME/bin/tritonserver missing" >&2; exit 1; }
[[ -x $STUB ]] || { echo "[setup_triton] the wheel has no python backend stub for Python $PYVER" >&2; exit 1; }

BACKENDS=$TRITON_DIR/backends
mkdir -p "$BACKENDS/python"
link() {  # link TARGET NAME: (re)create only when it does not already point there
    if [[ $(readlink "$2" 2>/dev/null) != "$1" ]]; then
        ln -sfn "$1" "$2"
    fi
}
link "$TS_HOME/backends/python/libtriton_python.so" "$BACKENDS/python/libtriton_python.so"
link "$TS_HOME/backends/python/triton_python_backend_utils.py" "$BACKENDS/python/triton_python_backend_utils.py"
link "$STUB" "$BACKENDS/python/triton_python_backend_stub"

# --- check that every binary resolves its shared libraries ----------------
# shellcheck source=scripts/triton_env.sh
source "$ROOT/scripts/triton_env.sh"
# ldd gets the resolved path: run through a symlink, ld.so takes $ORIGIN from the
# real file (/proc/self/exe), while `ldd symlink` would take it from the link.
for bin in "$TS_HOME/bin/tritonserver" "$STUB" "$VENV/bin/perf_analyzer"; do
    unresolved=$(ldd "$(readlink -f "$bin")" | grep 'not found' || true)
    if [[ -n $unresolved ]]; then
        echo "[setup_triton] unresolved libraries in $bin:" >&2
        echo "$unresolved" >&2
        exit 1
    fi
done
"$STUB_VENV/bin/python" -c 'import numpy, tokenizers' ||
    { echo "[setup_triton] the stub venv cannot import numpy and tokenizers" >&2; exit 1; }
log "ok: tritonserver $TRITONSERVER_VERSION, python $PYVER stub, backends in $BACKENDS, stub venv $STUB_VENV"
