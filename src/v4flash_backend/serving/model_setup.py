"""Builds everything the `v4flash` Triton model holds, from its initialize() arguments.

Kept out of model.py so the model file stays a thin adapter and so the same wiring can
run without a server (tests/test_serving.py drives it with an in-process engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tokenizers import Tokenizer

from v4flash_backend.settings import Settings

from .detok import StreamDetokenizer
from .engine_inprocess import EngineClient, InProcessEngine
from .metrics import ServingMetrics
from .parse import RequestParser
from .service import GenerateService
from .triton_settings import load_settings, tokenizer_path


def load_tokenizer(path: Path, log: Callable[[str], None]) -> Tokenizer | None:
    if not path.is_file():
        log(f"[v4flash] no tokenizer at {path}: text_input is disabled (send input_ids)")
        return None
    return Tokenizer.from_file(str(path))


def make_engine(settings: Settings, log: Callable[[str], None] = print,
                watch_also: tuple[int, ...] = ()) -> EngineClient:
    """The engine client the settings ask for (launcher setting); ``watch_also``: pids a launched
    rank group dies with besides this process (`RankGroupEngine`)."""
    if settings.launcher == "inprocess":
        return InProcessEngine(settings, log)
    from .engine_rank_group import RankGroupEngine

    return RankGroupEngine(settings, log, watch_also=watch_also)


def build_service(model_config: dict, model_dir: str, model_name: str = "v4flash", model_version: str = "1",
                  metric_api=None, log: Callable[[str], None] = print,
                  engine: EngineClient | None = None, watch_also: tuple[int, ...] = ()) -> GenerateService:
    """The model's `GenerateService` (engine launched, tokenizer loaded, metrics registered).

    ``metric_api``: ``pb_utils`` (its MetricFamily) or None for no metrics. ``engine``:
    an already built engine client (tests); default: the one the settings ask for, its rank group
    dying with this process and the pids in ``watch_also`` (model.py: the server's).
    """
    settings, source, unknown = load_settings(model_config, model_dir)
    log(f"[v4flash] checkpoint {settings.checkpoint_dir} ({source}); "
        f"world_size={settings.world_size} ops={settings.ops_backend} max_num_seqs={settings.max_num_seqs} "
        f"max_model_len={settings.max_model_len} spec_mode={settings.spec_mode} launcher={settings.launcher}")
    if unknown:
        log(f"[v4flash] ignoring unknown parameter(s): {', '.join(sorted(unknown))}")
    tokenizer = load_tokenizer(tokenizer_path(settings), log)
    metrics = None
    if metric_api is not None:
        try:
            metrics = ServingMetrics(metric_api, model_name, model_version)
        except Exception as exc:  # server started with --allow-metrics=false
            log(f"[v4flash] metrics disabled: {exc}")
    if engine is None:
        engine = make_engine(settings, log, watch_also)
    tokenize = None
    if tokenizer is not None:
        default_add = settings.add_special_tokens

        def tokenize(text: str, add: bool = default_add) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=add).ids
    parser = RequestParser(engine.vocab_size, settings.max_model_len, settings.default_max_tokens, tokenize)
    detok = StreamDetokenizer(tokenizer, settings.skip_special_tokens) if tokenizer is not None else None
    service = GenerateService(engine, parser, detok, metrics, log, stats_interval_s=settings.stats_interval_s)
    service.settings = settings
    if metrics is not None:
        metrics.set_slots(0, settings.max_num_seqs)
    return service
