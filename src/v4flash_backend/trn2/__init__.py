"""The Trainium2 decode path (imports ops, model, engine).

`static_step` (fixed-shape verify and draft graphs per bucket, no host syncs), `static_round` (a
decode round in two graphs with sampling and admission inside), `launch` (standard library only: the
Neuron view of the settings and one rank's environment of a Neuron launch), `compiler` (the
torch-neuronx compile path), `graph_key` (what identifies a compiled graph: one key for every rank),
`artifacts` (the compiled graphs' manifest: written by the compile command, loaded by a server),
`graphs` (buckets, the compiled graphs per bucket), `startup` (a rank's warm-up: compile or load every
graph, meet, then run), `static_runner` (StaticRunner over them, resident placement). The round's
typed plan is the engine's (`engine.round_plan`). Neuron packages are imported only inside
`compiler.import_neuron`.
"""
