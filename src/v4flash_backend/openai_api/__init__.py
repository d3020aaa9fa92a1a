"""openai_api/: the OpenAI-compatible API beside tritonserver -- `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, streamed (server-sent events) or not -- on FastAPI + uvicorn, talking to the
running server's `v4flash` model over gRPC streaming (tritonclient's asyncio API). `make serve` starts
it on 127.0.0.1:$OPENAI_PORT (9000; scripts/serve_openai.sh supervises it beside tritonserver).

It imports nothing of this package outside itself (tests/test_layout.py): no engine, no model, no
second tokenizer. Chat prompts are rendered here with the checkpoint's own format
(chat_templates.py, dsv41.py) and tokenized by Triton's `v4flash` model like any text_input.

    protocol        the request bodies (pydantic) and their sampling_parameters
    chat_templates  the checkpoint's Jinja template (rendered as transformers renders it), or
    dsv41           DeepSeek-V4.1's chat encoding
    triton          one gRPC stream per request, its responses as chunks; cancellation
    responses       usage (with the `usage.dspark` extension), log-probs, bodies and stream chunks
    errors          OpenAI's error shape; Triton's codes -> HTTP statuses
    app             the FastAPI application (routes, API key, disconnect handling)
    __main__        the command (`python -m v4flash_backend.openai_api`)
"""
