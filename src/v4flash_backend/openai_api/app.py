"""The FastAPI application: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(streamed as server-sent events `data: {...}` ending with `data: [DONE]`, or one JSON body), and
`GET /health` (200 once Triton's `v4flash` model is ready; no key needed: a load balancer's probe).

A request is checked (the API key, the body: protocol.py, the model name), rendered (chat), then
streamed from Triton (triton.py). An error before the first token is the HTTP response (400 / 404 /
503 ...: errors.py); an error after a stream began is its last event, ``data: {"error": {...}}``
(what the `openai` client raises on), then ``data: [DONE]``. A client that disconnects -- streamed
or not -- cancels its Triton request at once (`EventStream`, `until_disconnect`), which frees the
KV slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import aclosing, asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse

from .errors import APIError, invalid
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import CompletionLogprobs, Stream, Tally, chat_body, chat_logprobs, completion_body
from .triton import GenerateParams

log = logging.getLogger("v4flash.openai")


class ClientGone(Exception):
    """The client disconnected while its request was being served."""


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that listens for the client's disconnect whatever ASGI spec the
    server advertises (Starlette's own, under spec 2.4, notices one only when a write fails, i.e. at
    the next token, which may be a long prefill away) and then cancels the body at once: the
    generator's `finally` cancels the Triton request (tests/test_openai_api.py)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as tg:
            async def watch():
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await self.stream_response(send)
            except OSError:  # the connection is gone (uvicorn's ClientDisconnected)
                pass
            finally:
                tg.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()


async def until_disconnect(request: Request, awaitable):
    """``await awaitable``, cancelled (and ClientGone raised) if the client disconnects first."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()


class KeyCheck:
    """ASGI middleware: every /v1 request needs `Authorization: Bearer <key>` (before its body is read,
    so a client without the key learns nothing else); compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError(401, "missing or incorrect API key (send the header Authorization: Bearer <key>)",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    e = exc.errors()[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return invalid(f"the request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    if e.get("type") == "extra_forbidden":
        return invalid(f"unrecognized request argument: {'.'.join(loc)}", loc[-1] if loc else None)
    if e.get("type") == "missing":
        return invalid(f"{'.'.join(loc)} is required", loc[0] if loc else None)
    where = ".".join(loc)
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    return invalid(f"{where}: {msg}" if where else msg, loc[0] if loc else None)  # param: the top-level field


def create_app(backend, renderer, model_name: str = "v4flash", api_key: str | None = None,
               root: str | None = None) -> FastAPI:
    """The application over a backend (triton.TritonBackend, or a stand-in with its `generate`) and a
    chat renderer (chat_templates.select; None: chat requests are refused)."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        await backend.close()

    app = FastAPI(title="v4flash OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    if api_key:
        app.add_middleware(KeyCheck, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc: RequestValidationError):
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal")
        return JSONResponse(err.body(), status_code=500)

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "v4flash", "root": root}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model `{name}` does not exist (this server serves `{model_name}`)",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        ok = await backend.ready()
        return JSONResponse({"status": "ok" if ok else "triton not ready"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        check_model(name)
        return card

    async def serve(request: Request, params: GenerateParams, rename: dict, chat: bool, body, logprobs_of):
        """Stream or collect one request. ``logprobs_of(chunk)``: the chunk's log-probs in the
        endpoint's form, or None."""
        gen = backend.generate(params, rename)
        if not body.stream:
            async def collect():
                tally, parts = Tally(), []
                async with aclosing(gen):
                    async for c in gen:
                        tally.add(c)
                        if (lp := logprobs_of(c)) is not None:
                            parts.append(lp)
                return tally, parts

            try:
                tally, parts = await until_disconnect(request, collect())
            except ClientGone:
                return JSONResponse({}, status_code=499)
            if chat:
                return chat_body(model_name, tally, [x for p in parts for x in p] if params.return_logprobs else None)
            return completion_body(model_name, tally, CompletionLogprobs.join(parts) if params.return_logprobs
                                   else None)
        # streamed: wait for the first chunk first, so an error before any token is the HTTP status
        try:
            first = await until_disconnect(request, gen.__anext__())
        except ClientGone:
            await gen.aclose()
            return JSONResponse({}, status_code=499)
        except StopAsyncIteration:
            first = None
        except APIError:
            await gen.aclose()
            raise
        stream = Stream(chat, model_name, body.include_usage, body.continuous_usage)

        async def events():
            tally = Tally()
            try:
                async with aclosing(gen):
                    if chat:
                        yield sse(stream.role())
                    c = first
                    while c is not None:
                        tally.add(c)
                        yield sse(stream.delta(c, tally, logprobs_of(c)))
                        c = await anext(gen, None)
                if body.include_usage:
                    yield sse(stream.usage(tally))
            except APIError as exc:
                yield sse(exc.body())
            except Exception as exc:  # noqa: BLE001 -- the stream ends with the error, the server stays up
                log.exception("stream failed")
                yield sse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error",
                                   code="internal").body())
            yield DONE

        return EventStream(events(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        try:
            prompt = body.one_prompt()
        except ValueError as exc:
            raise invalid(str(exc), "prompt") from None
        lp = body.logprobs
        params = GenerateParams(sampling=body.sampling(body.max_tokens, lp), return_logprobs=lp is not None,
                                add_special_tokens=body.add_special_tokens)
        if isinstance(prompt, str):
            params.prompt_text = prompt
        else:
            params.prompt_ids = prompt
        conv = CompletionLogprobs(lp or 0)
        return await serve(request, params, {}, False, body, lambda c: conv.of(c) if lp is not None else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if renderer is None:
            raise invalid("this model has no chat template (none in its tokenizer_config.json and not the "
                          "DeepSeek-V4.1 tokenizer): use /v1/completions, or start the frontend with "
                          "--chat-template", "messages")
        messages = [{"role": m.role, "content": m.text(),
                     **({"reasoning_content": m.reasoning_content} if m.reasoning_content else {}),
                     **({"name": m.name} if m.name else {})} for m in body.messages]
        prompt = renderer.render(messages, body.chat_template_kwargs or {}, body.reasoning_effort)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = GenerateParams(sampling=body.sampling(body.max_new, top), prompt_text=prompt,
                                return_logprobs=body.logprobs,
                                # the rendered prompt holds its BOS (vLLM: add_special_tokens false for chat)
                                add_special_tokens=bool(body.add_special_tokens))
        rename = {"prompt": "messages",
                  "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                  "logprobs": "top_logprobs"}
        return await serve(request, params, rename, True, body,
                           lambda c: chat_logprobs(c, top) if top is not None else None)

    return app
