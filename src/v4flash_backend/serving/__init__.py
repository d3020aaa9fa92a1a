"""Triton-facing helpers: tokenization for the preprocessing model, stateless exact
streaming detokenization for the postprocessing model, model-parameter parsing.

Nothing here imports ``triton_python_backend_utils``: the model.py files under
``model_repository/`` convert between ``pb_utils`` tensors and the numpy arrays these
modules take, so everything here is testable without a server.
"""
