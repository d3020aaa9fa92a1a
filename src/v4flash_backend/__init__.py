"""v4flash: DeepSeek-V4.1-Flash with DSpark speculative decoding behind Triton.

Subpackages, in layer order (each imports only those above it; DESIGN.md section 2):

    config, settings, request   model config (official keys); the one serving/engine settings
                                schema; the one request type and error type (no torch, no model)
    formats/                    number formats (e4m3fn / e2m1 / ue8m0) and the checkpoint layout
    kernels/                    NKI kernels, one per op family (nki >= 0.6; `nki_sim` runs them on a CPU)
    ops/                        the op seam: one function per op family, backends torch / nki-sim / nki
    model/                      the V4.1-Flash forward: attention, FFN / MoE / Engram, DSpark stages,
                                rope, per-slot state, weights, Engram hash, loading a checkpoint
    parallel/                   the trn2 layout, collectives, the sharded model, the placement report
    engine/                     runners, sampling, DSpark scheduling and acceptance, the continuous-
                                batching engine, single-sequence generation
    trn2/                       the static decode step and the Neuron compile path
    group/                      the torchrun worker and the rank-group client
    serving/                    Triton request parsing, responses, metrics, detokenization
    checks/                     golden-check against the official reference's fixtures
    training/                   builds the embedded model (never imported by serving)
    cli, client                 `python -m v4flash_backend ...`; the Triton gRPC client
    openai_api/                 the OpenAI-compatible API beside tritonserver (imports nothing above)

`tests/test_layout.py` checks the import order and that serving loads no training module.
"""

__version__ = "0.1.0"
