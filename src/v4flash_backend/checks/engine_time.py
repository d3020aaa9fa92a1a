"""Engine time of a decode step at release shapes, from the kernels' own instructions.

`python -m v4flash_backend.checks.engine_time [--ctx 4096] [--json FILE]`:

1. builds rank 0 of the W = 64 layout at the V4.1-Flash config on the meta device -- the serving
   loader (`layout.load_shard`) reading a reader that only knows the config's tensor names, shapes
   and dtypes (no checkpoint, no memory),
2. traces the static step's graphs at one sequence and context bound `--ctx` (`release.trace_one`):
   plain decoding (the verify graph with one row) and the DSpark step (the verify graph with
   1 + block rows and the draft graph), counting every op-seam call per graph -- each one NKI kernel
   launch on a NeuronCore -- and every torch op outside the seam ("glue", left to the compiler),
3. runs every distinct call once under the simulator at those shapes (launch grid 2, the LNC of a
   trn2 rank) and reads its engine-time ledger (`nki_sim._cost`: cycles per engine, DMA bytes, the
   overlap rule's call time), and adds the calls the projection prices the other MoE forms and
   expert formats with (a routed expert on one row; the expert GEMMs on bf16 weights), and
4. the DeepSeek-V3-shaped stack of NxDI's trn2 profile (`dsv3_calls`), priced the same way.

The JSON it writes is what `perf/trn2_projection.py` reads (`perf/trn2_engine_time.json`).
`footprint.step_lines` turns counts and ledgers into the per-family lines `release-check` prints.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from v4flash_backend.config import ModelConfig

from . import footprint

DEFAULT_JSON = Path(__file__).resolve().parents[3] / "perf" / "trn2_engine_time.json"
GLUE_LANES = 128  # a glue op's elements spread over the 128 Vector Engine lanes (assumed layout)
# torch calls that only reshape or view (no data moved on the device)
_VIEWS = {"view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "permute", "transpose", "t",
          "flatten", "unflatten", "narrow", "select", "split", "chunk", "unbind", "as_strided", "view_as",
          "contiguous", "size", "dim", "numel", "__get__", "__set__", "__len__", "__iter__", "stride",
          "element_size", "is_contiguous", "movedim", "squeeze_", "unsqueeze_", "detach", "requires_grad_",
          "data_ptr", "untyped_storage", "storage_offset", "__format__", "__repr__", "type", "is_floating_point"}


# ---- a rank of the release layout on the meta device ------------------------------------------------
class MetaReader:
    """The `CheckpointReader` calls `layout.load_shard` makes, answered from the config's tensor
    specs with meta tensors (shapes and dtypes only)."""

    def __init__(self, cfg: ModelConfig):
        from v4flash_backend.formats.checkpoint import ST_TO_TORCH
        from v4flash_backend.parallel import placement

        self.specs = {n: (tuple(s), ST_TO_TORCH[st]) for n, s, st in placement.tensor_specs(cfg)}

    def keys(self):
        return list(self.specs)

    def __contains__(self, name):
        return name in self.specs

    def shape(self, name):
        return self.specs[name][0]

    def get(self, name, shape=None, dtype=None):
        s, dt = self.specs[name]
        return torch.empty(s, dtype=dt, device="meta")

    def get_slice(self, name, dim, start, stop):
        s, dt = self.specs[name]
        return torch.empty(tuple(stop - start if d == dim else n for d, n in enumerate(s)), dtype=dt, device="meta")


def meta_rank_model(cfg: ModelConfig, world: int = 64, rank: int = 0):
    """Rank `rank` of `world`: the serving loader's shard on the meta device, the Engram hasher of
    the release tokenizer, collectives that keep the W-rank shapes (`release.ShapeCollectives`)."""
    from tokenizers import Tokenizer

    from v4flash_backend.model.engram_hash import EngramHasher
    from v4flash_backend.model.transformer import V41Model
    from v4flash_backend.parallel.comm import DistComm
    from v4flash_backend.parallel.layout import Layout, load_shard

    from .memory import meta_device
    from .release import ShapeCollectives, tokenizer_json

    lay = Layout(rank, world)
    with meta_device():
        W = load_shard(MetaReader(cfg), cfg, lay)
    hasher = None
    if cfg.engram_layer_ids:
        hasher = EngramHasher.from_config(cfg, Tokenizer.from_file(str(tokenizer_json())))
        hasher.to("meta")
    return V41Model(cfg, W, hasher, DistComm(lay, ShapeCollectives(lay), cfg.vocab_size, cfg))


# ---- tracing one step with counts ----------------------------------------------------------------------
class GlueCounter(torch.overrides.TorchFunctionMode):
    """Torch calls of the traced graph outside the op seam (the recorder's depth is 0), except views:
    per graph their count, Vector Engine cycles (each one instruction over its output elements spread
    over the 128 lanes, MIN_II at least: the compiler's fused elementwise code, assumed) and the bytes
    they move through HBM (tensor inputs read -- only the gathered rows of an indexed read -- and
    outputs written: the graph's own copies of caches and tables between kernels)."""

    def __init__(self, recorder):
        super().__init__()
        self.rec = recorder
        self.stats: dict = defaultdict(lambda: {"ops": 0, "cycles": 0, "bytes": 0})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.rec.depth or not self.rec.on or name in _VIEWS:
            return out
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        if name == "__setitem__" and len(args) > 2 and isinstance(args[2], torch.Tensor):
            outs = [args[2]]
        if not outs:
            return out
        out_bytes = sum(o.numel() * o.element_size() for o in outs)
        if name in ("__getitem__", "__setitem__"):
            idx = args[1] if len(args) > 1 else None
            items = idx if isinstance(idx, tuple) else (idx,)
            if not any(isinstance(i, torch.Tensor) for i in items):
                return out  # basic slicing: a view (or a strided write the next kernel could take)
            in_bytes = out_bytes
        else:
            ins = [a for a in list(args) + list(kwargs.values()) for a in (a if isinstance(a, (list, tuple)) else [a])]
            in_bytes = sum(a.numel() * a.element_size() for a in ins if isinstance(a, torch.Tensor))
        s = self.stats[self.rec.graph]
        s["ops"] += 1
        s["cycles"] += max(64, math.ceil(sum(o.numel() for o in outs) / GLUE_LANES))
        s["bytes"] += in_bytes + out_bytes
        return out


def trace_step(model, cfg: ModelConfig, ctx: int, recorder=None):
    """Trace plain decoding ('plain_verify': one sequence, one row) and the DSpark step
    ('dspark_verify', 'dspark_draft': 1 + block rows) at context bound `ctx` on the meta device, with
    counts. Returns (recorder, glue stats by graph); a graph that fails to trace raises."""
    from v4flash_backend.model.state import ModelState
    from v4flash_backend.trn2.static_step import StaticDecoder

    from .release import _OpRecorder, trace_one

    rec = recorder or _OpRecorder()
    B = cfg.dspark_block_size or 0
    n_pos = ctx + max(1 + B, B) + 1
    for rope in model.ropes.values():
        rope.at(torch.tensor([n_pos - 1]))
        rope._table = rope._table.to("meta")
    with torch.device("meta"):
        state = ModelState(cfg, 2, ctx)
    glue = GlueCounter(rec)
    runs = [("plain_verify", StaticDecoder(model, state, scratch=1, max_rows=1), False)]
    if B:
        runs.append(("dspark_verify", StaticDecoder(model, state, scratch=1, max_rows=1 + B), True))
    with rec.active(), glue:
        for counted in (False, True):  # a first pass fills the model's one-time caches (rope, weight forms)
            rec.on = counted
            for name, dec, draft in runs:
                with torch.device("meta"):
                    tokens, slot, start, n = dec.padding_plan(1, dec.max_rows)
                    taps = torch.zeros(dec.max_rows, len(cfg.dspark_target_layer_ids) * cfg.dim,
                                       dtype=torch.bfloat16)
                graphs = [(name, lambda: dec.verify(tokens, slot, start, n, ctx))]
                if draft and dec.drafter is not None:
                    graphs.append(("dspark_draft", lambda: dec.draft(taps, n, slot, start, tokens[:, 0])))
                for gname, fn in graphs:
                    rec.graph = gname
                    res = trace_one(gname, fn)
                    if not res.ok:
                        raise RuntimeError(f"graph {gname} did not trace: {res.error}")
    from v4flash_backend.ops import torch_ops

    torch_ops._cache._d.clear()
    return rec, {g: dict(v) for g, v in glue.stats.items()}


# ---- signatures of the calls the projection prices the alternatives with --------------------------------
def with_rows(sig: tuple, rows_from: int, rows_to: int) -> tuple:
    """`sig` with every tensor argument's leading size `rows_from` replaced by `rows_to`."""
    def fix(a):
        if isinstance(a, tuple) and a and a[0] == "T" and a[1] and a[1][0] == rows_from:
            return ("T", (rows_to,) + tuple(a[1][1:]), a[2])
        return a
    return tuple(fix(a) for a in sig)


def as_bf16(op: str, sig: tuple) -> tuple[str, tuple]:
    """The bf16-weight GEMM of the same shape as a linear_fp8 / linear_fp4 call (x, w, scale)."""
    x, w = sig[0], sig[1]
    n, k = w[1][0], x[1][-1]
    return "linear_bf16", (x, ("T", (n, k), "bfloat16"))


def is_routed(op: str, sig: tuple) -> bool:
    """A call of the routed experts' kernel: x [S, M, K] on a stack [E, N, ..] with `experts` [S]."""
    return op in ("linear_fp4", "linear_fp8") and len(sig) == 4 and isinstance(sig[3], tuple)


def routed_bf16(sig: tuple) -> tuple[str, tuple]:
    """One occupied slot of a routed call as the bf16-weight GEMM on one row (the formats' variant)."""
    k, n = sig[0][1][-1], sig[1][1][1]
    return "linear_bf16", (("T", (1, k), "bfloat16"), ("T", (n, k), "bfloat16"))


def variant_calls(counts: Counter) -> set:
    """(op, sig) of the alternatives: each routed-expert GEMM (linear_fp4) and weighted swiglu on one
    row, every fp8 / fp4 GEMM on bf16 weights (rows as traced and one), a routed call's slot on bf16."""
    out = set()
    for (op, sig) in counts:
        if is_routed(op, sig):
            out.add(routed_bf16(sig))
            continue
        rows = sig[0][1][0] if sig and isinstance(sig[0], tuple) and sig[0][0] == "T" else None
        if op in ("linear_fp4", "linear_fp8") and len(sig[0][1]) == 2:
            b = as_bf16(op, sig)
            out |= {b, (b[0], with_rows(b[1], rows, 1))}
            if op == "linear_fp4":
                out.add((op, with_rows(sig, rows, 1)))
        if op == "swiglu" and sig[2] is not None:
            out.add((op, with_rows(sig, rows, 1)))
    return out


# ---- the DeepSeek-V3 stack of NxDI's trn2 profile --------------------------------------------------------
DSV3 = {"layers": 61, "dense_layers": 3, "dim": 7168, "heads": 128, "q_lora": 1536, "kv_lora": 512, "rope": 64,
        "nope": 128, "v_dim": 128, "experts": 256, "top_k": 8, "moe_inter": 2048, "dense_inter": 18432,
        "vocab": 129280, "tp": 64, "seq_len": 512}
# glue ops per layer: rope (q, k), 2 residual adds, router sigmoid / bias / group top-k / top-k / gather /
# normalize / scale, the latent split (assumed count; each one Vector instruction at MIN_II)
DSV3_GLUE_PER_LAYER = 14


def dsv3_calls(c: dict = DSV3) -> Counter:
    """One token of DeepSeek-V3 at batch 1 on one TP-64 rank, as NxDI shards it (contrib/models/
    DeepSeek-V3: q_a / kv_a replicated nn.Linear, q_b / kv_b column- and o row-parallel, every expert
    on every rank with its intermediate split 64 ways, fused gate|up; absorbed MLA over the 576-wide
    latent cache of seq_len rows), written as calls of this project's op seam with bf16 weights."""
    def t(*shape, dt="bfloat16"):
        return ("T", tuple(shape), dt)

    D, tp, eps = c["dim"], c["tp"], 1e-6
    h = c["heads"] // tp
    lat = c["kv_lora"] + c["rope"]
    inter, dense = c["moe_inter"] // tp, c["dense_inter"] // tp
    layer = Counter()
    layer[("rms_norm", (t(1, D), t(D), eps))] += 2
    layer[("linear_bf16", (t(1, D), t(c["q_lora"], D)))] += 1
    layer[("rms_norm", (t(1, c["q_lora"]), t(c["q_lora"]), eps))] += 1
    layer[("linear_bf16", (t(1, c["q_lora"]), t(h * (c["nope"] + c["rope"]), c["q_lora"])))] += 1
    layer[("linear_bf16", (t(1, D), t(lat, D)))] += 1
    layer[("rms_norm", (t(1, c["kv_lora"]), t(c["kv_lora"]), eps))] += 1
    layer[("linear_bf16", (t(1, h, c["nope"]), t(h, c["kv_lora"], c["nope"])))] += 1  # q absorbed into the latent
    layer[("sparse_attn", (t(1, 1, h, lat), t(1, c["seq_len"], lat), t(h, dt="float32"),
                           t(1, 1, c["seq_len"], dt="int32"), float(lat) ** -0.5))] += 1
    layer[("linear_bf16", (t(1, h, c["kv_lora"]), t(h, c["v_dim"], c["kv_lora"])))] += 1  # latent -> v
    layer[("linear_bf16", (t(1, h * c["v_dim"]), t(D, h * c["v_dim"])))] += 1
    moe = Counter()
    moe[("linear_f32", (t(1, D), t(c["experts"], D)))] += 1
    for weighted, n in ((False, 1), (True, c["top_k"])):  # the shared expert, the routed ones
        moe[("linear_bf16", (t(1, D), t(2 * inter, D)))] += n
        moe[("swiglu", (t(1, inter), t(1, inter), t(1, 1, dt="float32") if weighted else None, 10.0))] += n
        moe[("linear_bf16", (t(1, inter), t(D, inter)))] += n
    mlp = Counter({("linear_bf16", (t(1, D), t(2 * dense, D))): 1,
                   ("swiglu", (t(1, dense), t(1, dense), None, 10.0)): 1,
                   ("linear_bf16", (t(1, dense), t(D, dense))): 1})
    out = Counter()
    for _ in range(c["layers"]):
        out.update(layer)
    for _ in range(c["layers"] - c["dense_layers"]):
        out.update(moe)
    for _ in range(c["dense_layers"]):
        out.update(mlp)
    out[("rms_norm", (t(1, D), t(D), eps))] += 1
    out[("linear_bf16", (t(1, D), t(-(-c["vocab"] // tp), D)))] += 1
    return out


# ---- the measurement -----------------------------------------------------------------------------------------
def sources_sha() -> str:
    """Hash of the simulator and kernel sources the ledgers depend on (a stale cache shows)."""
    import nki_sim
    from v4flash_backend import kernels

    h = hashlib.sha256()
    for d in (Path(nki_sim.__file__).parent, Path(kernels.__file__).parent):
        for p in sorted(d.glob("*.py")):
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def _listing(counts: Counter) -> list[dict]:
    return [{"op": op, "sig": repr(sig), "count": n} for (op, sig), n in sorted(counts.items(), key=repr)]


def measure(cfg: ModelConfig, ctx: int = 4096, world: int = 64, log=print) -> dict:
    """Trace, count, simulate (see the module docstring); the JSON-able result."""
    from nki_sim import _cost
    from v4flash_backend import ops

    t0 = time.perf_counter()
    ops.set_backend("torch")
    ops.set_numerics("reference")  # what a Neuron rank runs
    model = meta_rank_model(cfg, world)
    rec, glue = trace_step(model, cfg, ctx)
    del model
    log(f"traced {sorted(rec.counts)} in {time.perf_counter() - t0:.0f}s")
    every: Counter = Counter()
    for c in rec.counts.values():
        every.update(c)
    dsv3 = dsv3_calls()
    todo = defaultdict(set)
    for op, sig in set(every) | variant_calls(every) | set(dsv3):
        todo[op].add(sig)
    costs: dict = {}
    res = footprint.check_kernels(todo, log=lambda s: log(s) if s.startswith("kernel-footprint") else None,
                                  costs=costs)
    # the routed calls once more with every slot empty: their fixed part ('<op>@empty')
    routed = {op: {sig for sig in sigs if is_routed(op, sig)} for op, sigs in todo.items()}
    empty: dict = {}
    footprint.ROUTED_OCCUPIED = 0
    try:
        res += footprint.check_kernels({op: s for op, s in routed.items() if s}, costs=empty)
    finally:
        footprint.ROUTED_OCCUPIED = 1
    costs.update({(op + "@empty", sig): c for (op, sig), c in empty.items()})
    failed = [f for r in res for f in r.failures]
    if failed:
        raise RuntimeError(f"{len(failed)} kernel call(s) failed under the simulator, e.g. {failed[:2]}")
    return {"config": cfg.to_dict(), "world": world, "rank": 0, "ctx": ctx, "grid": footprint.GRID,
            "sources_sha": sources_sha(), "seconds": round(time.perf_counter() - t0, 1),
            "cost_model": {"constants": {k: [v, s] for k, (v, s) in _cost.CONSTANTS.items()},
                           "assumed": _cost.ASSUMED, "rule": _cost.__doc__.split("Overlap rule")[1].strip()},
            "graphs": {g: _listing(c) for g, c in sorted(rec.counts.items())},
            "glue": glue,
            "dsv3": {"shape": DSV3, "calls": _listing(dsv3), "glue_ops": DSV3_GLUE_PER_LAYER * DSV3["layers"]},
            "costs": [{"op": op, "sig": repr(sig), **c} for (op, sig), c in sorted(costs.items(), key=repr)]}


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[4] / "shared" / "configs"
                                            / "deepseek-v4.1-flash.json"))
    ap.add_argument("--ctx", type=int, default=4096, help="context bound of the decode bucket")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the ledgers")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig.from_json(args.config) if Path(args.config).exists() else ModelConfig.release()
    out = measure(cfg, args.ctx)
    Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    import ast

    costs = {(c["op"], ast.literal_eval(c["sig"])): c for c in out["costs"]}
    counts = {g: Counter({(e["op"], ast.literal_eval(e["sig"])): e["count"] for e in lst})
              for g, lst in out["graphs"].items()}
    for graphs in (["plain_verify"], ["dspark_verify", "dspark_draft"]):
        for line in footprint.step_lines(counts, costs, graphs, " + ".join(graphs) + f" at ctx {args.ctx}"):
            print(line)
    print(f"engine-time: wrote {args.json} ({len(out['costs'])} kernel calls, {out['seconds']:.0f}s, "
          f"sources {out['sources_sha']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
