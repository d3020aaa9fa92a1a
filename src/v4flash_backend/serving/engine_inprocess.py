"""What the Triton model talks to: an engine behind a small, uniform interface.

    submit(req, request_id, on_event)   queue a validated GenerateRequest; on_event(dict) is
                                        called from the client's own thread for every event
                                        (see response.py for the event dicts), exactly one
                                        of them final (finish_reason set, or an error event)
    cancel(request_id)                  ask the engine to stop it (a final "cancelled" follows)
    stats() -> dict                     engine counters; slots_in_use / slots_total at least
    close()
    vocab_size, max_model_len           the limits RequestParser checks against

`engine_rank_group.RankGroupEngine` is the serving path: a torchrun rank group
(`group.rank_group.RankGroup`), rank 0 running the Engine. `InProcessEngine` here runs the
Engine on a thread of the calling process (one rank, no subprocess): the launcher=inprocess
setting, and the unit tests. `model_setup.make_engine` picks one.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

EventCallback = Callable[[dict], None]


class EngineClient(Protocol):
    vocab_size: int
    max_model_len: int

    def submit(self, req: GenerateRequest, request_id: str, on_event: EventCallback) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def event_dict(ev) -> dict:
    """An engine.Event as a protocol event dict (the same shape rank 0 sends over its socket)."""
    return ev.to_wire()


def checkpoint_vocab_size(checkpoint_dir) -> int:
    """vocab_size of a checkpoint, from its config.json (no weights loaded)."""
    from v4flash_backend.config import ModelConfig

    return ModelConfig.from_json(Path(checkpoint_dir) / "config.json").vocab_size


class InProcessEngine:
    """The Engine on a daemon thread of this process (W = 1)."""

    def __init__(self, settings: Settings, log: Callable[[str], None] = print):
        """The engine `group.build.build_engine` builds for these settings (decode_graph static: the
        static round graphs, warmed here); a setting it cannot honour in process (world_size > 1,
        pipeline_parallel, sequence_parallel) raises `group.build.InProcessRefused`."""
        from v4flash_backend.group.build import build_engine

        self._log = log
        self.engine = build_engine(settings)
        self.vocab_size = self.engine.mcfg.vocab_size
        self.max_model_len = settings.max_model_len
        if self.engine.spec:
            self.engine.ensure_cost()  # at load time, not in the first request's latency
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
        # A copy: the caller keeps its request (the response builder reads it) unchanged.
        self.engine.submit(dataclasses.replace(req, id=request_id, callback=lambda ev: on_event(event_dict(ev))))

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        warming = getattr(self.engine.runner, "warming", None)
        if warming is not None:  # a background compile stopped before the stub exits (trn2.warmup)
            warming.close()
