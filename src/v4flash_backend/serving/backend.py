"""What the Triton model talks to: an engine behind a small, uniform interface.

    submit(req, request_id, on_event)   queue a validated GenerateRequest; on_event(dict) is
                                        called from the backend's own thread for every event
                                        (see response.py for the event dicts), exactly one
                                        of them final (finish_reason set, or an error event)
    cancel(request_id)                  ask the engine to stop it (a final "cancelled" follows)
    stats() -> dict                     engine counters; slots_in_use / slots_total at least
    close()
    vocab_size, max_model_len           the limits RequestParser checks against

`RankGroupBackend` is the serving path: a torchrun rank group (`rank_group.RankGroupClient`),
rank 0 running the Engine. `InProcessBackend` runs the Engine on a thread of the calling
process (one rank, no subprocess): the launcher=inprocess parameter, and the unit tests.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .request import GenerateRequest, ServingError
from .settings import ServingSettings

EventCallback = Callable[[dict], None]


def event_dict(ev) -> dict:
    """An engine.Event as a protocol event dict."""
    if ev.error is not None:
        return {"event": "error", "code": ev.error_code or "INTERNAL", "message": ev.error}
    return {"event": "chunk", "token_ids": list(ev.token_ids), "context_ids": list(ev.context_ids),
            "finish_reason": ev.finish_reason, "num_prompt_tokens": ev.num_prompt_tokens,
            "num_output_tokens": ev.num_output_tokens, "drafted": ev.drafted, "accepted": ev.accepted}


def checkpoint_vocab_size(checkpoint_dir) -> int:
    """vocab_size of a checkpoint, from its config.json (no weights loaded)."""
    from v4flash_backend.config import ModelConfig

    return ModelConfig.from_json(checkpoint_dir / "config.json").vocab_size


class InProcessBackend:
    """The Engine on a daemon thread of this process (W = 1)."""

    def __init__(self, settings: ServingSettings, log: Callable[[str], None] = print):
        from v4flash_backend import ops
        from v4flash_backend.engine.engine import Engine, EngineConfig
        from v4flash_backend.engine.runner import LocalRunner
        from v4flash_backend.model.loading import load_model

        self._log = log
        ops.set_backend(settings.ops_backend)
        if settings.numerics:
            ops.set_numerics(settings.numerics)
        model = load_model(settings.checkpoint_dir)
        self.vocab_size = model.cfg.vocab_size
        self.max_model_len = settings.max_model_len
        # One slot more than max_num_seqs: the engine profiles its steps/s table on the last.
        runner = LocalRunner(model, settings.max_num_seqs + 1, settings.max_model_len)
        self.engine = Engine(runner, EngineConfig(
            max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
            prefill_chunk=settings.prefill_chunk, spec_mode=settings.spec_mode,
            sps_path=settings.sps_path or None))
        if self.engine.spec:
            self.engine.ensure_sps()  # at load time, not in the first request's latency
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="v4flash-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.engine.run(self._stop)
            except Exception as exc:  # the failed step already failed its requests (UNAVAILABLE)
                self._log(f"[v4flash] engine step failed: {type(exc).__name__}: {exc}")
                time.sleep(0.05)

    def submit(self, req: GenerateRequest, request_id: str, on_event: EventCallback) -> None:
        from v4flash_backend.engine.engine import Request, RequestError

        r = Request(prompt=list(req.prompt), id=request_id, callback=lambda ev: on_event(event_dict(ev)),
                    **dict(req.sampling(), stop_token_ids=tuple(req.stop_token_ids)))
        try:
            self.engine.submit(r)
        except RequestError as exc:
            raise ServingError(str(exc), exc.code) from None

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def make_backend(settings: ServingSettings, log: Callable[[str], None] = print):
    """The backend the settings ask for (launcher parameter)."""
    if settings.launcher == "inprocess":
        return InProcessBackend(settings, log)
    from .rank_group_backend import RankGroupBackend

    return RankGroupBackend(settings, log)
