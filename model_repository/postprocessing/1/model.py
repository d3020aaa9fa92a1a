"""postprocessing: output_ids + context_ids (+ finish_reason, text_trim) -> text_output delta.

Stateless and exact for streams: emits decode(context + new) minus decode(context),
holding back a trailing unfinished UTF-8 character unless finish_reason is
non-empty (the last chunk). Logic: v4flash_backend.serving.prepost.Postprocessor
and v4flash_backend.serving.detok.

Finding the package: as in preprocessing/1/model.py, the repository's src/ (three
levels above this file's real location) goes first on sys.path when it exists;
otherwise the installed v4flash_backend package is used.
"""

import json
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[3] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import triton_python_backend_utils as pb_utils  # noqa: E402

from v4flash_backend.serving.prepost import Postprocessor  # noqa: E402


def _optional(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _invalid_arg(message):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def initialize(self, args):
        self._post = Postprocessor.from_model_config(
            json.loads(args["model_config"]), args["model_repository"]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                text = self._post.text_output(
                    pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy(),
                    _optional(request, "context_ids"),
                    _optional(request, "finish_reason"),
                    _optional(request, "text_trim"),
                )
            except ValueError as exc:  # ids outside the vocabulary
                responses.append(_invalid_arg(f"postprocessing: {exc}"))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
