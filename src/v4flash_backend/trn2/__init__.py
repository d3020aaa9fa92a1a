"""The Trainium2 decode path (imports ops, model, engine.runner).

`static_step` (fixed-shape verify and draft graphs per bucket, no host syncs), `static_round` (a
decode round in two graphs with sampling and admission inside), `round_plan` (the round's typed plan
and read-back: fields, padding, wire form, column layout; the one trn2/ module the engine imports),
`launch` (standard library only: the Neuron view of the settings and one rank's environment of a
Neuron launch), `compiler` (the torch-neuronx compile path), `graphs` (buckets, the compiled graphs
per bucket, warm-up), `static_runner` (StaticRunner over them, resident placement) and `neuron` (the
old name: re-exports them). Neuron packages are imported only inside `compiler.import_neuron`.
"""
