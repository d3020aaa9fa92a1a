"""The TRT-LLM request format, as Triton's OpenAI frontend sends it, mapped onto v4flash's inputs.

triton-inference-server/server python/openai/openai_frontend/engine/utils/triton.py,
`_create_trtllm_generate_request`, sends every value as a [1, 1] tensor (stop_words [1, n]): the
shape of TRT-LLM's ensembles, whose max_batch_size is > 0. Triton refuses those shapes for
v4flash and v4flash_text (max_batch_size 0, dims [1]: the vllm_backend format the frontend sends
with --backend vllm). The `v4flash_trtllm` ensemble takes the TRT-LLM shapes and its stateless
first step (`trtllm_request`) turns them into v4flash's vllm-format inputs: text_input,
stream, exclude_input_in_output and one sampling_parameters JSON (which v4flash validates).

exclude_input_in_output defaults to true here: the frontend sends it only when the OpenAI
request has `echo` (completions), and a chat answer must not start with the prompt.
"""

from __future__ import annotations

import json

import numpy as np

# (name, data_type, dims) of the TRT-LLM-format inputs the ensemble declares, all optional but the
# first; the frontend's lora_* and guided_decoding_* inputs are not declared (Triton refuses them).
INPUTS = (
    ("text_input", "TYPE_STRING", [1, 1]),
    ("stream", "TYPE_BOOL", [1, 1]),
    ("max_tokens", "TYPE_INT32", [1, 1]),
    ("stop_words", "TYPE_STRING", [1, -1]),
    ("top_p", "TYPE_FP32", [1, 1]),
    ("temperature", "TYPE_FP32", [1, 1]),
    ("frequency_penalty", "TYPE_FP32", [1, 1]),
    ("presence_penalty", "TYPE_FP32", [1, 1]),
    ("seed", "TYPE_UINT64", [1, 1]),
    ("exclude_input_in_output", "TYPE_BOOL", [1, 1]),
    ("return_num_input_tokens", "TYPE_BOOL", [1, 1]),
    ("return_num_output_tokens", "TYPE_BOOL", [1, 1]),
)
_SAMPLING = {"max_tokens": int, "top_p": float, "temperature": float, "frequency_penalty": float,
             "presence_penalty": float, "seed": int}


def _text(value) -> str:
    return value if isinstance(value, str) else bytes(value).decode("utf-8", "replace")


def to_vllm_format(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """TRT-LLM-format arrays (any shape with one value; stop_words any length) -> v4flash's inputs."""
    def one(name):
        return np.asarray(inputs[name]).reshape(-1)[0]

    sampling = {k: conv(one(k)) for k, conv in _SAMPLING.items() if k in inputs}
    if "stop_words" in inputs:
        sampling["stop"] = [_text(v) for v in np.asarray(inputs["stop_words"], dtype=object).reshape(-1)]
    exclude = bool(one("exclude_input_in_output")) if "exclude_input_in_output" in inputs else True
    text = np.asarray(inputs["text_input"], dtype=object).reshape(-1)
    if text.size != 1:
        raise ValueError(f"text_input must hold exactly one string, got {text.size}")
    return {"text_input": np.array([text[0]], dtype=object),
            "stream": np.array([bool(one("stream")) if "stream" in inputs else False]),
            "exclude_input_in_output": np.array([exclude]),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object)}
