# Source me (bash): restrict_args <key file> fills the array RESTRICT_ARGS with the tritonserver
# flags that put Triton's administrative protocols behind a key, on HTTP and gRPC alike:
#
#   shared-memory     registering system / CUDA shared-memory regions (the server then reads and
#                     writes memory a client names)
#   model-repository  index, load and unload (loading a model runs its code)
#   trace, logging    changing trace and log settings at run time
#
# A request to one of them is answered only when it carries the HTTP header
#   v4flash-admin-key: <the file's content>
# or, over gRPC, the metadata triton-grpc-protocol-v4flash-admin-key (tritonserver 2.51 prefixes
# the gRPC key with triton-grpc-protocol-; its refusal names the key it expects).
# Inference, health, metadata, model-config, statistics and the metrics port stay open: what a
# client of the model, a load balancer's probe or perf_analyzer / AIPerf use.
#
# The key file holds one token (whitespace around it is dropped) of at least 16 characters from
# [A-Za-z0-9._~+/-], readable by its owner only. Note: tritonserver takes the key on its command line
# (there is no file form of the flag), so on a shared host other users can read it in `ps`; run the
# server in its own container (its own PID namespace) or on a host of its own.
RESTRICT_HEADER=v4flash-admin-key
RESTRICT_APIS=shared-memory,model-repository,trace,logging

restrict_args() {
    local file=$1 key mode
    RESTRICT_ARGS=()
    if [[ -z $file || ! -r $file ]]; then
        echo "[triton_restrict] admin key file '${file}' is missing or unreadable" >&2
        return 1
    fi
    mode=$(stat -c '%a' "$file")
    if [[ ${mode: -2} != 00 ]]; then
        echo "[triton_restrict] admin key file $file is accessible to other users (mode $mode): chmod 600 it" >&2
        return 1
    fi
    key=$(tr -d ' \t\r\n' <"$file")
    if [[ ! $key =~ ^[A-Za-z0-9._~+/-]{16,}$ ]]; then
        echo "[triton_restrict] admin key in $file must be at least 16 characters of [A-Za-z0-9._~+/-]" >&2
        return 1
    fi
    RESTRICT_ARGS=("--http-restricted-api=${RESTRICT_APIS}:${RESTRICT_HEADER}=${key}"
        "--grpc-restricted-protocol=${RESTRICT_APIS}:${RESTRICT_HEADER}=${key}")
}

# new_admin_key <file>: write a fresh random key (64 hex digits) to <file>, mode 600, unless it exists.
new_admin_key() {
    local file=$1
    [[ -e $file ]] && return 0
    mkdir -p "$(dirname "$file")"
    (umask 077 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$file")
    echo "[triton_restrict] generated an admin key in $file" >&2
}
