"""The Triton side of v4flash (imports everything below it; never training/).

`triton_settings` (config.pbtxt parameters -> `Settings`, checkpoint lookup), `params` (reading a
model's parameters and sibling configs), `parse` (Triton inputs -> a
`GenerateRequest`), `response` (engine events -> output tensors), `service` (the request loop:
submission, the response-sending thread, cancellation, FINAL always sent), `engine_inprocess` /
`engine_rank_group` (what the service talks to: the Engine in process, or the torchrun rank group
with its watchdog), `model_setup` (wires all of it from initialize()'s arguments), `metrics`,
`detok` (stateless exact streaming detokenization), `prepost` (the pre/postprocessing models),
`triton_io` (the v4flash model's input and output declarations).

Nothing here imports ``triton_python_backend_utils``: the model.py files under
``model_repository/`` convert between ``pb_utils`` tensors and the numpy arrays these modules
take, so they stay thin adapters and everything here is testable without a server.
"""
