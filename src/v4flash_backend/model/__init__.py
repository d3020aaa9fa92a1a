"""The V4.1-Flash forward (imports config, formats, ops; never parallel, engine or serving).

`transformer` (V41Model: one forward for prefill, chunked prefill, decode and verification),
`attention` (window + shared compressed KV + indexer + sink), `ffn` (MoE, shared expert, Engram),
`dspark` (the draft stages, Markov and confidence heads), `rope`, `state` (per-slot state by
absolute position), `weights` (typed weights and `linear`), `engram_hash`, `loading` (a V41Model
from a checkpoint directory). Parallelism enters only through the `comm` hooks the model is given.
"""
