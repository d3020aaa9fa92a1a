"""The serving engine client over a torchrun rank group (`v4flash_backend.group.rank_group.RankGroup`).

Launches the group (or connects to one started elsewhere, parameter rank_group_address),
forwards requests and cancellations, and brings a failed group back: when the group dies,
`RankGroup` fails the requests in flight with UNAVAILABLE and answers new ones the same
way at once; a watchdog thread here restarts a group it launched (reconnects to an external
one) so the model serves again without a Triton restart.

A launched group dies with this process (`RankGroup.launch`: the ranks watch it) and with the
pids in ``watch_also``: the Triton model passes the server's, because when tritonserver dies the
2.51 stub can hang instead of exiting (its health thread, seeing the server gone, blocks on the
mutex its stub-to-parent thread holds while it waits for the dead server's answer to an
`is_cancelled()`; python_backend r24.10 pb_stub.cc), which would keep a group watching only the
stub alive for good. An external group (rank_group_address) carries no watch.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from v4flash_backend.group.rank_group import RankGroup, RankGroupError
from v4flash_backend.request import GenerateRequest
from v4flash_backend.settings import Settings

from .engine_inprocess import EventCallback, checkpoint_vocab_size

# Warm-up prompt: BOS plus a few ids every vocabulary has; only its timing matters.
_WARMUP_PROMPT = [0, 3, 4, 5]


class RankGroupEngine:
    def __init__(self, settings: Settings, log: Callable[[str], None] = print,
                 watchdog_interval_s: float = 1.0, watch_also: tuple[int, ...] = ()):
        self.settings = settings
        self.watch_also = tuple(watch_also)  # more pids the ranks of a launched group die with
        self.log = log
        self.vocab_size = checkpoint_vocab_size(settings.checkpoint_dir)
        self.max_model_len = settings.max_model_len
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self.restarts = 0
        self.group = self._start()
        self._watchdog = threading.Thread(target=self._watch, args=(watchdog_interval_s,),
                                          name="v4flash-rank-group-watchdog", daemon=True)
        self._watchdog.start()

    # ---- group lifecycle -----------------------------------------------------------------------
    def _start(self) -> RankGroup:
        s = self.settings
        t0 = time.monotonic()
        if s.rank_group_address:
            group = RankGroup.connect(s.rank_group_address, timeout_s=s.startup_timeout_s,
                                      secret_file=s.group_secret_file or None)
            self.log(f"[v4flash] connected to the rank group at {s.rank_group_address}: {group.info}")
        else:
            group = RankGroup.launch(s, watch_also=self.watch_also)
            self.log(f"[v4flash] rank group of {s.world_size} rank(s) up in {time.monotonic() - t0:.1f} s "
                     f"(pids {group.pids}; log {group.log_path})")
        self._warm_up(group)
        return group

    def _warm_up(self, group: RankGroup) -> None:
        """One short request before the model reports ready, so one-time work on rank 0 (the
        DSpark steps/s profile runs at the first draft) is not charged to a client."""
        prompt = [t for t in _WARMUP_PROMPT if t < self.vocab_size]
        t0 = time.monotonic()
        res = group.submit(prompt, {"max_tokens": 2, "ignore_eos": True}, request_id="warmup", warmup=True).result(
            timeout=self.settings.startup_timeout_s)
        if res["error"] is not None:
            raise RankGroupError(f"warm-up request failed: {res['code']}: {res['error']}")
        self.log(f"[v4flash] warm-up request done in {time.monotonic() - t0:.1f} s")

    def _watch(self, interval_s: float) -> None:
        while not self._closing.wait(interval_s):
            group = self.group
            if group.alive:
                continue
            self.log(f"[v4flash] rank group down ({group.failure}); starting a new one")
            try:
                if group.launch_args is not None:
                    group.shutdown(timeout=10)  # reap what is left of the old session
                new = self._start()
            except Exception as exc:  # try again at the next tick; requests get UNAVAILABLE meanwhile
                self.log(f"[v4flash] rank group restart failed: {type(exc).__name__}: {exc}")
                time.sleep(min(30.0, 2.0 * (self.restarts + 1)))
                continue
            with self._lock:
                if self._closing.is_set():
                    new.shutdown(timeout=30)
                    return
                self.group = new
                self.restarts += 1

    # ---- backend interface ---------------------------------------------------------------------
    def submit(self, req: GenerateRequest, request_id: str, on_event: EventCallback) -> None:
        # The group validates again and answers errors as events; RankGroup answers a dead
        # group with an immediate UNAVAILABLE event, so nothing raises here.
        self.group.submit(req.prompt, req.sampling(), request_id=request_id, callback=on_event)

    def cancel(self, request_id: str) -> None:
        self.group.cancel(request_id)

    def stats(self) -> dict:
        reply = self.group.stats(timeout=5.0)
        return dict(reply.get("engine", {}), world_size=reply.get("world_size"), restarts=self.restarts)

    def health(self) -> dict:
        return self.group.health(timeout=5.0)

    def close(self) -> None:
        with self._lock:
            self._closing.set()
            group = self.group
        group.shutdown(timeout=30)
        self._watchdog.join(timeout=5)
