"""The torchrun rank group (imports everything below serving).

`rank_entry` (torchrun's module for every rank: the rank's environment from the settings -- a Neuron
launch's NeuronCore, compiler flags, LNC, compile cache -- before torch loads, then the worker; and
`launch_plan`, the dry run of a launch), `worker` (the rank's entry: rank 0 runs the engine and
broadcasts integer step plans through `PlanRunner`, ranks > 0 `follow` them), `plan_codec` (the step
plans' wire form), `server` (rank 0's JSON-lines socket server), `protocol` (that socket's messages,
documented once), `lifetime` (dying with torchrun or the launcher, SIGTERM, the Neuron rank's
environment), `build` (runner and engine of a rank) and `rank_group` (launch / connect, submit,
cancel, health, stats, restart; the client the Triton model uses).
"""
