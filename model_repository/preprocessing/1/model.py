"""preprocessing: text_input STRING [1] -> input_ids INT32 [-1] (stateless).

Thin Triton hooks; the logic is v4flash_backend.serving.prepost.Preprocessor.

Finding the package: this file puts the repository's src/ (three levels above its
real location, symlinks resolved) first on sys.path when that directory exists, so
the model repository works in place without installing the package; where it does
not exist (a deployed copy), the installed v4flash_backend package is used.
"""

import json
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[3] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import triton_python_backend_utils as pb_utils  # noqa: E402

from v4flash_backend.serving.prepost import Preprocessor  # noqa: E402


def _invalid_arg(message):
    # The code leads the message, as in v4flash/1/model.py (Triton 2.51 drops it on the wire).
    message = f"[INVALID_ARG] {message}"
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def initialize(self, args):
        self._pre = Preprocessor.from_model_config(
            json.loads(args["model_config"]), args["model_repository"]
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input")  # None when not sent
            try:
                ids = self._pre.input_ids(None if text is None else text.as_numpy())
            except ValueError as exc:
                responses.append(_invalid_arg(f"preprocessing: {exc}"))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
        return responses
