"""The Trainium2 decode path (imports ops, model, engine.runner).

`static_step` (fixed-shape verify and draft graphs per bucket, no host syncs), `static_round` (a
decode round in two graphs with sampling and admission inside), `launch` (standard library only: the
Neuron view of the settings and one rank's environment of a Neuron launch) and `neuron` (the
torch-neuronx compile path, warm-up, StaticRunner). Neuron packages are imported only inside
`neuron.import_neuron`.
"""
