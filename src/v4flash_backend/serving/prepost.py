"""Tokenizer lookup and the logic of the ensemble's preprocessing and postprocessing
models, on numpy arrays (the model.py files only convert pb_utils tensors).

preprocessing:  text_input  STRING [1]  ->  input_ids  INT32 [-1]
postprocessing: output_ids INT32 [-1], context_ids INT32 [-1] (optional),
                finish_reason STRING [-1] (optional), text_trim UINT32 [1] (optional)
                ->  text_output STRING [1]

Both are stateless. The postprocessing step is exact for streams (see detok.py): a
chunk whose finish_reason is non-empty is the last one and also flushes a trailing
unfinished character.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .detok import StreamDetokenizer
from .params import model_parameters, param_bool, resolve_path, sibling_parameter

TOKENIZER_FILE = "tokenizer.json"
# The engine model whose checkpoint directory the tokenizer comes from by default,
# and the name of its parameter.
ENGINE_MODEL = "v4flash"
CHECKPOINT_PARAM = "checkpoint_dir"
CHECKPOINT_ENV = "V4FLASH_CHECKPOINT_DIR"


def find_tokenizer(params: dict[str, str], model_dir: str | Path) -> Path:
    """The tokenizer.json a pre/postprocessing model uses, first match wins:

    1. its ``tokenizer_dir`` parameter (a directory holding tokenizer.json, or the file);
    2. the ``checkpoint_dir`` parameter of the engine model's config.pbtxt in the same
       repository (parameter ``engine_model_name``, default "v4flash");
    3. the environment variable V4FLASH_CHECKPOINT_DIR;
    4. the checkpoint the engine model serves by default (serving.triton_settings: the embedded model,
       else the golden tiny checkpoint).
    Relative paths are taken from the model repository root.
    """
    tried = []
    candidates = []
    if params.get("tokenizer_dir"):
        candidates.append(("parameter tokenizer_dir", params["tokenizer_dir"]))
    engine = params.get("engine_model_name") or ENGINE_MODEL
    ckpt = sibling_parameter(model_dir, engine, CHECKPOINT_PARAM)
    if ckpt:
        candidates.append((f"{engine}'s parameter {CHECKPOINT_PARAM}", ckpt))
    if os.environ.get(CHECKPOINT_ENV):
        candidates.append((f"${CHECKPOINT_ENV}", os.environ[CHECKPOINT_ENV]))
    default_error = None
    try:
        from .triton_settings import repository_checkpoint_dir

        default, why = repository_checkpoint_dir(Path(model_dir).resolve().parent, engine)
        candidates.append((f"default checkpoint ({why})", str(default)))
    except Exception as e:  # no embedded or golden checkpoint either: only explicit sources apply
        default_error = f"default checkpoint unavailable ({e})"
    for source, value in candidates:
        path = resolve_path(value, model_dir)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if path.is_file():
            return path
        tried.append(f"{source} -> {path}")
    if default_error:
        tried.append(default_error)
    raise FileNotFoundError(
        "no tokenizer.json found; set the model parameter tokenizer_dir, the "
        f"{CHECKPOINT_PARAM} parameter of model {engine!r}, or ${CHECKPOINT_ENV}"
        + (f" (tried: {'; '.join(tried)})" if tried else "")
    )


def _one_string(tensor: np.ndarray, name: str) -> str:
    values = np.asarray(tensor, dtype=object).reshape(-1)
    if values.size != 1:
        raise ValueError(f"{name} must hold exactly one string, got {values.size}")
    value = values[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8: {exc}") from None


class Preprocessor:
    """text_input -> input_ids with the checkpoint's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, add_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens

    @classmethod
    def from_model_config(cls, model_config: dict, model_dir: str | Path) -> "Preprocessor":
        params = model_parameters(model_config)
        tokenizer = Tokenizer.from_file(str(find_tokenizer(params, model_dir)))
        return cls(tokenizer, param_bool(params, "add_special_tokens", True))

    def input_ids(self, text_input: np.ndarray | None) -> np.ndarray:
        """INT32 [n] ids of the one string in ``text_input``; ValueError on bad input, None included
        (the ensemble declares text_input optional so that a request without it reaches this check:
        with it required, Triton 2.51 counted `stream` alone as enough inputs and answered nothing)."""
        if text_input is None:
            raise ValueError("text_input is required: the v4flash_text ensemble takes the prompt as "
                             "text_input (STRING), not prompt or input_ids (send token ids to v4flash)")
        text = _one_string(text_input, "text_input")
        # "" is refused, not served as a BOS-only prompt (the v4flash model's rule, parse.py)
        ids = self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids if text else []
        if not ids:
            raise ValueError("text_input is empty: the prompt needs at least one token")
        return np.asarray(ids, dtype=np.int32)


class Postprocessor:
    """One streamed chunk (new ids + context ids) -> its exact text delta."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.detok = StreamDetokenizer(tokenizer, skip_special_tokens)

    @classmethod
    def from_model_config(cls, model_config: dict, model_dir: str | Path) -> "Postprocessor":
        params = model_parameters(model_config)
        tokenizer = Tokenizer.from_file(str(find_tokenizer(params, model_dir)))
        return cls(tokenizer, param_bool(params, "skip_special_tokens", True))

    def text_output(
        self,
        output_ids: np.ndarray,
        context_ids: np.ndarray | None = None,
        finish_reason: np.ndarray | None = None,
        text_trim: np.ndarray | None = None,
    ) -> np.ndarray:
        """STRING [1] (object array of UTF-8 bytes) holding the chunk's text delta, less its last
        ``text_trim`` characters (the stop string that ended the request, see serving/stop.py)."""
        final = finish_reason is not None and any(
            len(v) > 0 for v in np.asarray(finish_reason, dtype=object).reshape(-1)
        )
        context = [] if context_ids is None else np.asarray(context_ids).reshape(-1)
        text = self.detok.delta(context, np.asarray(output_ids).reshape(-1), final)
        trim = 0 if text_trim is None else int(np.asarray(text_trim).reshape(-1)[0])
        if trim:
            text = text[:max(0, len(text) - trim)]
        return np.array([text.encode("utf-8")], dtype=np.object_)
