"""Builds the embedded default model `models/v4flash-tiny` (`python -m v4flash_backend.training`).

`corpus` (the standard-library corpus and its split), `tokenizer` (byte-level BPE), `params` (fp32
masters and export to the official layout), `qat_ops` (fake-quant ops with straight-through
gradients), `tiny` (the recipe: target, then DSpark stages), `dspark` (draft-stage training),
`evaluate` (held-out loss, DSpark acceptance). Serving never imports this package.
"""
