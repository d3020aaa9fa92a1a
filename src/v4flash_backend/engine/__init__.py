"""Generation on rank 0 (imports config, request, settings, model, parallel).

`runner` (the Runner protocol and LocalRunner: forward and DSpark calls over one model state),
`sampling` (temperature / top-k / top-p with exact distributions, penalties, min_tokens, log-probs),
`noise` (counter-based randomness shared with the static graphs), `dspark_sched` (admit, the steps/s
table), `dspark_accept` (Markov drafting, lossless verification), `calibration` (STS of the
confidence head), `step_cost` (the step's real cost, stepping aside), `device_boundary` (host-sync
and boundary counters), `engine` (continuous
batching: admission, segmented prefill, the step loop, slots, stop conditions, cancellation; `Engine`
combines the modules of its other concerns: `seq` (a request's state, its events), `stats` (counters),
`adaptive` (stepping aside, probes, calibration feed), `step_profile` (timing the step cost),
`eager_step` / `round_step` (an eager step and its drafting / a static decode round), `logits` (logit
processing and the sampling inputs)),
`single` (one sequence, no engine: the reference decode loop the CLI's in-process generate uses).
"""
