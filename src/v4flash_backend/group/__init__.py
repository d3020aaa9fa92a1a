"""The torchrun rank group (imports everything below serving).

`worker` (the torchrun entry: rank 0 runs the engine behind a loopback JSON-lines socket and
broadcasts integer step plans; ranks > 0 follow them) and `rank_group` (launch / connect, submit,
cancel, health, stats, restart; the client the Triton model uses).
"""
