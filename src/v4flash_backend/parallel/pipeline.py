"""Pipeline stages: the boundary payload between consecutive stages and what it costs.

The split itself is `layout.stage_cuts` (P contiguous stages balanced by layer count, cut only
where no KV-source cache, indexer top-k or candidate mask crosses). At a boundary the sending
stage hands over what the next layer reads and nothing else can rebuild:
- the full mHC residual streams h [T, hc, D] bf16 (hc = 4: four times one hidden, never a
  collapsed or sequence-parallel shard: the trap of vllm-ascend PR #18870);
- the FFN pre-mix [T, hc] f32 of the last block (single-pass mHC: the next block's attention
  collapses with it);
- the DSpark taps gathered so far [T, k * D] bf16 (k = target layers before the boundary) when
  the step keeps taps: the drafter runs on the last stage.

Transport: every rank of stage s sends the whole payload, as one uint8 message, to its peer (the
rank with the same in-stage index) in stage s + 1 (`torch.distributed.send` / `recv`). Chosen over
"one sender, then a broadcast inside the receiving stage" because the decode payload is small
(about 33 KiB per row at the release shape) and a broadcast over a 64-rank stage adds its
latency to every decode step, while the peer sends run concurrently on separate links; the cost
is S times the bytes across the boundary (`boundary_bytes`), which matters for long prefill
chunks and is the place to switch to 1/S slices plus an in-stage all-gather. The bytes are
reinterpreted, never converted, so the transfer is bit-exact. A 16-byte header (rows, taps) leads
the message: gloo fills a larger receive buffer from a shorter message without complaint, so a
sender handing over a shard must fail on the header check, not feed garbage to the next stage.
"""

from __future__ import annotations

import torch

from v4flash_backend.config import ModelConfig

from .layout import Layout, stage_cuts


def taps_before(cfg: ModelConfig, layer: int) -> int:
    """DSpark target layers before backbone layer `layer` (their taps cross a boundary there)."""
    return sum(1 for t in cfg.dspark_target_layer_ids if t < layer)


HEADER = 16  # int64 (rows, taps) in front of the payload: a message of a shard cannot pass as full rows


def payload_bytes(cfg: ModelConfig, T: int, n_taps: int) -> int:
    """Bytes of one boundary message for T rows with n_taps taps."""
    return HEADER + T * (cfg.hc_mult * cfg.dim * 2 + cfg.hc_mult * 4 + n_taps * cfg.dim * 2)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def pack_boundary(h: torch.Tensor, pre_mix: torch.Tensor, taps: torch.Tensor | None) -> torch.Tensor:
    n_taps = 0 if taps is None else taps.shape[-1] // h.shape[-1]
    head = torch.tensor([h.shape[0], n_taps], dtype=torch.int64)
    parts = [_bytes(head), _bytes(h.to(torch.bfloat16)), _bytes(pre_mix.to(torch.float32))]
    if taps is not None:
        parts.append(_bytes(taps.to(torch.bfloat16)))
    return torch.cat(parts)


def unpack_boundary(buf: torch.Tensor, cfg: ModelConfig, T: int, n_taps: int):
    hc, D = cfg.hc_mult, cfg.dim
    nh, npm = T * hc * D * 2, T * hc * 4
    got = buf[:HEADER].clone().view(torch.int64).tolist() if buf.numel() >= HEADER else None
    if buf.numel() != payload_bytes(cfg, T, n_taps) or got != [T, n_taps]:
        raise ValueError(f"boundary payload of {buf.numel()} bytes with header {got}, expected "
                         f"{payload_bytes(cfg, T, n_taps)} bytes for {T} full rows and {n_taps} taps")
    buf = buf[HEADER:]
    h = buf[:nh].clone().view(torch.bfloat16).view(T, hc, D)
    pre_mix = buf[nh:nh + npm].clone().view(torch.float32).view(T, hc)
    taps = buf[nh + npm:].clone().view(torch.bfloat16).view(T, n_taps * D) if n_taps else None
    return h, pre_mix, taps


def send_boundary(coll, lay: Layout, h, pre_mix, taps) -> None:
    coll.send(pack_boundary(h, pre_mix, taps), lay.peer(lay.stage + 1), "boundary_send")


def recv_boundary(coll, lay: Layout, cfg: ModelConfig, T: int, n_taps: int):
    buf = torch.empty(payload_bytes(cfg, T, n_taps), dtype=torch.uint8)
    coll.recv(buf, lay.peer(lay.stage - 1), "boundary_recv")
    return unpack_boundary(buf, cfg, T, n_taps)


def boundary_bytes(cfg: ModelConfig, world: int, pipeline: int, rows: int, want_taps: bool = True) -> list[int]:
    """Bytes crossing each of the P - 1 boundaries for one forward of `rows` rows: stage world
    S senders, each with the full payload."""
    cuts = stage_cuts(cfg, pipeline)
    S = world // pipeline
    return [S * payload_bytes(cfg, rows, taps_before(cfg, c) if want_taps else 0) for c in cuts[1:-1]]


def gather_stage_objects(obj, lay: Layout) -> list:
    """`obj` of the first rank of every stage, in stage order, on every rank (a check tool's
    report: pickled through torch.distributed.all_gather_object; serving never pickles)."""
    import torch.distributed as dist

    objs = [None] * lay.world
    dist.all_gather_object(objs, obj)
    return [objs[s * lay.stage_world] for s in range(lay.pipeline)]


def trim_state(state, lo: int, hi: int, keep_dspark: bool):
    """Drop the per-layer caches of a ModelState that a stage running layers [lo, hi) never reads
    (window rings, compressed KV, index keys and pending rows of other layers; the DSpark rings
    unless `keep_dspark`): a stage holds the caches of its own layers, as `placement.cache_bytes`
    counts them. (The valid cuts keep every KV source inside the stage that reads it.)"""
    for d in (state.window, state.ckv, state.ik, state.pend_kv, state.pend_score, state.pend_ring):
        for i in [i for i in d if not lo <= i < hi]:
            del d[i]
    if not keep_dspark:
        state.dspark.clear()
    return state
