"""trtllm_request: the TRT-LLM request format ([1, 1] tensors, as Triton's OpenAI frontend sends it
without --backend vllm) -> v4flash's inputs (text_input, stream, exclude_input_in_output,
sampling_parameters). Stateless; first step of the v4flash_trtllm ensemble. Logic:
v4flash_backend.serving.trtllm_format.

Finding the package: as in preprocessing/1/model.py, the repository's src/ (three levels above
this file's real location) goes first on sys.path when it exists.
"""

import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[3] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import triton_python_backend_utils as pb_utils  # noqa: E402

from v4flash_backend.serving.trtllm_format import INPUTS, to_vllm_format  # noqa: E402


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            inputs = {}
            for name, *_ in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            try:
                out = to_vllm_format(inputs)
            except (ValueError, TypeError) as exc:
                error = pb_utils.TritonError(f"trtllm_request: {exc}", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
        return responses
