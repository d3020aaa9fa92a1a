"""``python -m v4flash_backend.openai_api``: the OpenAI-compatible frontend beside a running
tritonserver (scripts/serve.sh starts it: `make serve`, OPENAI_PORT).

    python -m v4flash_backend.openai_api --grpc-url 127.0.0.1:8001 --port 9000 \\
        --checkpoint models/v4flash-tiny [--api-key-file FILE]

The API key (optional) is read from a file, as the admin key is (scripts/triton_restrict.sh): one
token of at least 16 characters of [A-Za-z0-9._~+/-], the file readable by its owner only; never
on the command line (other users could read it in `ps`).
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
from pathlib import Path

KEY_RE = re.compile(r"^[A-Za-z0-9._~+/-]{16,}$")


def read_key(path: str) -> str:
    """The key in ``path``; SystemExit naming the problem (missing, readable by others, malformed)."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
        key = p.read_text().strip()
    except OSError as exc:
        sys.exit(f"[openai] API key file {path}: {exc}")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        sys.exit(f"[openai] API key file {path} is accessible to other users (mode {stat.S_IMODE(mode):o}): "
                 "chmod 600 it")
    if not KEY_RE.match(key):
        sys.exit(f"[openai] the API key in {path} must be at least 16 characters of [A-Za-z0-9._~+/-]")
    return key


def parse_args(argv=None):
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m v4flash_backend.openai_api",
                                 description="OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
                                             "/v1/models) in front of a running tritonserver")
    ap.add_argument("--grpc-url", default=f"127.0.0.1:{env('GRPC_PORT', '8001')}", help="tritonserver's gRPC address")
    ap.add_argument("--host", default=env("OPENAI_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("OPENAI_PORT", "9000")))
    ap.add_argument("--model-name", default="v4flash", help="the model id clients send (/v1/models lists it)")
    ap.add_argument("--triton-model", default="v4flash", help="the Triton model requests go to")
    ap.add_argument("--checkpoint", default=env("V4FLASH_CHECKPOINT_DIR"),
                    help="checkpoint directory whose chat format renders chat prompts (tokenizer_config.json)")
    ap.add_argument("--chat-template", default="auto",
                    help="auto (the checkpoint's: chat_templates.py), deepseek-v4.1, or a Jinja file")
    ap.add_argument("--api-key-file", default=env("V4FLASH_OPENAI_KEY_FILE") or None,
                    help="file holding the API key clients must send (Authorization: Bearer); none: open")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--access-log", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    key = read_key(args.api_key_file) if args.api_key_file else None
    import uvicorn

    from .app import create_app
    from .chat_templates import select
    from .triton import TritonBackend

    renderer = select(args.checkpoint, args.chat_template)
    app = create_app(TritonBackend(args.grpc_url, args.triton_model), renderer, args.model_name, key,
                     root=args.checkpoint)
    print(f"[openai] http://{args.host}:{args.port}/v1 -> triton {args.grpc_url} model {args.triton_model}; "
          f"chat format: {renderer.name if renderer else 'none (chat refused)'}; "
          f"API key: {'required' if key else 'none'}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
