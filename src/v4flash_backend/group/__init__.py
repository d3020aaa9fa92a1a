"""The torchrun rank group (imports everything below serving).

`rank_entry` (torchrun's module for every rank: the rank's environment from the settings -- a Neuron
launch's NeuronCore, compiler flags, LNC, compile cache -- before torch loads, then the worker; and
`launch_plan`, the dry run of a launch), `worker` (rank 0 runs the engine behind a loopback JSON-lines
socket and broadcasts integer step plans; ranks > 0 follow them) and `rank_group` (launch / connect,
submit, cancel, health, stats, restart; the client the Triton model uses).
"""
