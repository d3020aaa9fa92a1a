#!/usr/bin/env bash
# The Neuron image's command: tritonserver "$@" with Triton's shared-memory, model-repository,
# trace and logging protocols behind a key (scripts/triton_restrict.sh: header v4flash-admin-key).
#
#   V4FLASH_ADMIN_KEY_FILE   the key (mode 600); default /run/secrets/v4flash_admin_key (a mounted
#                            secret). When that file does not exist a fresh key is generated into
#                            $V4FLASH_STATE_DIR/admin_key (the admin protocols stay closed to
#                            anyone who cannot read the container's state directory).
#   V4FLASH_RESTRICT_ADMIN   0 turns the restriction off (default 1).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ${V4FLASH_RESTRICT_ADMIN:-1} == 0 ]]; then
    echo "[tritonserver_restricted] V4FLASH_RESTRICT_ADMIN=0: every protocol open" >&2
    exec tritonserver "$@"
fi
# shellcheck source=scripts/triton_restrict.sh
source "$ROOT/scripts/triton_restrict.sh"
key_file=${V4FLASH_ADMIN_KEY_FILE:-/run/secrets/v4flash_admin_key}
if [[ ! -e $key_file ]]; then
    key_file=${V4FLASH_STATE_DIR:-/var/lib/v4flash}/admin_key
    new_admin_key "$key_file"
fi
restrict_args "$key_file"
echo "[tritonserver_restricted] $RESTRICT_APIS restricted to requests with the header $RESTRICT_HEADER (key: $key_file)" >&2
exec tritonserver "$@" "${RESTRICT_ARGS[@]}"
