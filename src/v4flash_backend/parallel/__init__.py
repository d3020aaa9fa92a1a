"""The trn2 parallel layout (imports config, formats, ops, model).

`layout` (Layout: attention TP groups, experts by id, vocab-parallel head, Engram rows by rank,
pipeline stages and their cuts; `shard_spec` / `load_shard`), `collectives` (the one
torch.distributed wrapper, counting per group and step; `init_distributed`), `comm` (DistComm, the
model's collective hooks on a sharded rank, sequence parallelism; building the sharded model),
`pipeline` (the stage boundary's payload and bytes), `micro_batch` (a stage's forward split into
micro-batches so the stages overlap), `placement` (bytes per rank and collectives per
step, no tensors).
"""
