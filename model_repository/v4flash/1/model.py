"""v4flash: decoupled Python model in front of the engine's rank group.

Thin Triton hooks only (vllm_backend's shape). The logic lives in
v4flash_backend.serving: settings (parameters, checkpoint lookup), request (parsing and
validation), response (output tensors), service (submission, the response-sending
thread, cancellation, FINAL always sent), engine_inprocess / engine_rank_group (the rank group or an in-process
engine), metrics.

Finding the package: as in preprocessing/1/model.py, the repository's src/ (three
levels above this file's real location) goes first on sys.path when it exists;
otherwise the installed v4flash_backend package is used.
"""

import json
import os
import sys
from pathlib import Path

_SRC = Path(__file__).resolve().parents[3] / "src"
if _SRC.is_dir() and str(_SRC) not in sys.path:
    sys.path.insert(0, str(_SRC))

import triton_python_backend_utils as pb_utils  # noqa: E402

from v4flash_backend.serving import triton_io  # noqa: E402
from v4flash_backend.serving.model_setup import build_service  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _log(message):
    pb_utils.Logger.log_info(message)


def _error(exc):
    # The code also leads the message: Triton 2.51 passes only the message on gRPC streams
    # (ModelStreamInferResponse.error_message), and its HTTP generate endpoints read the
    # status from an error they have already freed (http_server.cc InferResponseComplete:
    # AddErrorJson deletes it before HttpCodeFromError), so UNAVAILABLE arrives as 400 there.
    code = getattr(pb_utils.TritonError, exc.code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(f"[{exc.code}] {exc.message}", code)


class _Sink:
    """The service's view of one request's response sender."""

    def __init__(self, request):
        self._request = request  # held for the request's lifetime, like the sender
        self._sender = request.get_response_sender()

    def send(self, outputs, error, final):
        flags = FINAL if final else 0
        if outputs is None and error is None:
            self._sender.send(flags=flags)
            return
        tensors = [pb_utils.Tensor(name, value) for name, value in (outputs or {}).items()]
        response = pb_utils.InferenceResponse(output_tensors=tensors,
                                              error=None if error is None else _error(error))
        self._sender.send(response, flags=flags)

    def is_cancelled(self):
        return self._sender.is_cancelled()


class TritonPythonModel:
    @classmethod
    def auto_complete_config(cls, auto_complete_model_config):
        return triton_io.auto_complete(auto_complete_model_config)

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "v4flash streams token chunks: set model_transaction_policy { decoupled: true }")
        try:
            # the rank group dies with this stub and with the server (the stub's parent): when
            # tritonserver crashes, a stub can hang instead of exiting (engine_rank_group.py)
            self._service = build_service(config, args["model_repository"], args["model_name"],
                                          args["model_version"], metric_api=pb_utils, log=_log,
                                          watch_also=(os.getppid(),))
        except Exception as exc:  # a bad parameter or a failed launch fails the load, clearly
            raise pb_utils.TritonModelException(f"v4flash failed to start: {type(exc).__name__}: {exc}")

    def execute(self, requests):
        for request in requests:
            inputs = {}
            for name in triton_io.INPUT_NAMES:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            # handle() copies what it needs before returning: request tensors are freed
            # when execute() returns.
            self._service.handle(inputs, request.parameters(), _Sink(request))
        return None

    def finalize(self):
        self._service.close()
        self._service = None
