"""The `v4flash` model's Triton inputs and outputs, in one place.

model_repository/v4flash/config.pbtxt declares them; ``auto_complete_config`` adds any the
config leaves out; tests/test_serving.py checks that the two agree. The input side keeps
vllm_backend's names (text_input, stream, sampling_parameters, exclude_input_in_output) so
Triton's OpenAI frontend and genai-perf's vllm mode can talk to it, plus typed sampling
inputs (the TRT-LLM ensemble's names) that the v4flash_text ensemble maps through.
"""

from __future__ import annotations

# (name, data_type, dims, optional)
INPUTS = (
    ("input_ids", "TYPE_INT32", [-1], True),  # exactly one of input_ids / text_input
    ("text_input", "TYPE_STRING", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
    ("sampling_parameters", "TYPE_STRING", [1], True),
    ("exclude_input_in_output", "TYPE_BOOL", [1], True),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("seed", "TYPE_UINT64", [1], True),
    ("stop_token_ids", "TYPE_INT32", [-1], True),
    ("ignore_eos", "TYPE_BOOL", [1], True),
    ("min_tokens", "TYPE_INT32", [1], True),
    # Triton's OpenAI frontend, TRT-LLM format (engine/utils/triton.py,
    # _create_trtllm_generate_request): stop strings and the frequency / presence penalties
    ("stop_words", "TYPE_STRING", [-1], True),
    ("frequency_penalty", "TYPE_FP32", [1], True),
    ("presence_penalty", "TYPE_FP32", [1], True),
    # vllm_backend's return_* switches (the frontend sends return_logprobs and return_num_*_tokens)
    ("return_finish_reason", "TYPE_BOOL", [1], True),
    ("return_cumulative_logprob", "TYPE_BOOL", [1], True),
    ("return_logprobs", "TYPE_BOOL", [1], True),
    ("return_num_input_tokens", "TYPE_BOOL", [1], True),
    ("return_num_output_tokens", "TYPE_BOOL", [1], True),
    # text_input only: tokenize with (true) or without (false) the tokenizer's special tokens (BOS);
    # absent: the model's add_special_tokens parameter. A chat prompt rendered with its template
    # (the OpenAI frontend) already holds BOS and is sent with false, as vLLM tokenizes chat prompts.
    ("add_special_tokens", "TYPE_BOOL", [1], True),
)

# (name, data_type, dims); text_output only in responses to text_input requests.
OUTPUTS = (
    ("output_ids", "TYPE_INT32", [-1]),
    ("context_ids", "TYPE_INT32", [-1]),
    ("finish_reason", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_UINT32", [1]),
    ("num_cached_tokens", "TYPE_UINT32", [1]),
    ("num_output_tokens", "TYPE_UINT32", [-1]),
    ("num_drafted_tokens", "TYPE_UINT32", [1]),
    ("num_accepted_tokens", "TYPE_UINT32", [1]),
    ("text_trim", "TYPE_UINT32", [1]),
    ("logprobs", "TYPE_STRING", [-1]),
    ("cumulative_logprob", "TYPE_FP32", [-1]),
    ("text_output", "TYPE_STRING", [-1]),
)

INPUT_NAMES = tuple(name for name, *_ in INPUTS)


def auto_complete(auto_complete_model_config):
    """What ``TritonPythonModel.auto_complete_config`` does: decoupled, max_batch_size 0
    (the engine batches, not Triton), and every input/output the config does not name."""
    cfg = auto_complete_model_config
    cfg.set_model_transaction_policy(dict(decoupled=True))
    cfg.set_max_batch_size(0)
    config = cfg.as_dict()
    have_in = {i["name"] for i in config.get("input", [])}
    have_out = {o["name"] for o in config.get("output", [])}
    for name, dtype, dims, optional in INPUTS:
        if name not in have_in:
            cfg.add_input({"name": name, "data_type": dtype, "dims": dims, "optional": optional})
    for name, dtype, dims in OUTPUTS:
        if name not in have_out:
            cfg.add_output({"name": name, "data_type": dtype, "dims": dims})
    return cfg
