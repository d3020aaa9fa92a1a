"""v4flash: DeepSeek-V4.1-Flash with DSpark speculative decoding behind Triton.

Layers (each imports only those above it): config, quant, checkpoint, ops, kernels, model,
parallel, cache, sampling/dspark, engine, worker/rank_group/serving/cli. See DESIGN.md.
"""

__version__ = "0.1.0"
