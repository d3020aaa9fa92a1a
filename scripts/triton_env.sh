# Source me:  source scripts/triton_env.sh
# Environment for running the tritonserver / perf_analyzer that scripts/setup_triton.sh
# installed into the venv (works from bash and zsh; sets nothing else).
#
#   TRITON_HOME             the wheel's pytriton/tritonserver directory (bin/, caches/)
#   TRITON_BACKEND_DIR      .triton/backends (python/ holds the symlinks to the wheel)
#   TRITON_CACHE_DIR        the wheel's caches directory (response cache plug-ins)
#   TRITONSERVER_VERSION    the server release the wheel carries
#   TRITON_STUB_VENV        .triton/stub-venv: numpy 1.26 + the project venv (.pth);
#                           the python backend stubs must run in it (numpy 2 breaks
#                           the 2.51 stub's tensors, see setup_triton.sh), so put
#                           "$TRITON_STUB_VENV/bin" first on PATH for tritonserver
#                           only, as run_tritonserver.sh does (not in your shell:
#                           there `python` would then get numpy 1.26)
#   PATH                    the venv's bin, then $TRITON_HOME/bin (tritonserver,
#                           and perf_analyzer from the venv's bin)
#   LD_LIBRARY_PATH         the venv Python's LIBDIR first (the stub must load the
#                           libpython3.X matching the venv's stdlib, not another build),
#                           then nvidia/cuda_runtime/lib (libcudart.so.12 for perf_analyzer)
#
# VENV overrides the venv (default: <repo>/.venv), TRITON_DIR the .triton folder.

_v4f_root=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)
_v4f_venv=${VENV:-$_v4f_root/.venv}
_v4f_out=$("$_v4f_venv/bin/python" - <<'EOF'
import sys, sysconfig
site = sysconfig.get_paths()["purelib"]
print(site)
print(sysconfig.get_config_var("LIBDIR") or "")
EOF
) || { echo "triton_env.sh: cannot run $_v4f_venv/bin/python" >&2; return 1 2>/dev/null || exit 1; }
_v4f_site=$(printf '%s\n' "$_v4f_out" | sed -n 1p)
_v4f_libdir=$(printf '%s\n' "$_v4f_out" | sed -n 2p)

export TRITON_HOME=$_v4f_site/pytriton/tritonserver
export TRITON_BACKEND_DIR=${TRITON_DIR:-$_v4f_root/.triton}/backends
export TRITON_CACHE_DIR=$TRITON_HOME/caches
export TRITONSERVER_VERSION=2.51.0
export TRITON_STUB_VENV=${TRITON_DIR:-$_v4f_root/.triton}/stub-venv

_v4f_prepend() {  # _v4f_prepend VAR DIR: put DIR first in VAR, without duplicates
    local cur
    eval "cur=\${$1:-}"
    cur=":$cur:"
    cur=${cur//:$2:/:}
    cur=${cur#:}
    cur=${cur%:}
    if [ -n "$cur" ]; then eval "export $1=\"\$2:\$cur\""; else eval "export $1=\"\$2\""; fi
}
_v4f_prepend PATH "$TRITON_HOME/bin"
_v4f_prepend PATH "$_v4f_venv/bin"
_v4f_prepend LD_LIBRARY_PATH "$_v4f_site/nvidia/cuda_runtime/lib"
if [ -n "$_v4f_libdir" ]; then _v4f_prepend LD_LIBRARY_PATH "$_v4f_libdir"; fi
unset -f _v4f_prepend
unset _v4f_root _v4f_venv _v4f_out _v4f_site _v4f_libdir
