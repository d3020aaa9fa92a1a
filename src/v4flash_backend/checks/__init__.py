"""Checks of the forward and of release-scale readiness: `golden` (golden-check against the official
reference's fixtures), `device_tolerance` (what golden-check tolerance a device can be held to),
`release` + `footprint` + `memory` (release-check: a rank's shard at W = 64, meta-traced graphs, kernel
SBUF/PSUM), `trn2` + `dtypes` (trn2-check: static graphs on fake device tensors, the trn2 dtype rule),
`command` (what the two commands share)."""
