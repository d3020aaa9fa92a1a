"""A MODEL (not a measurement) of the V4.1-Flash decode step on trn2.48xlarge, W = 64, batch 1.

    .venv/bin/python perf/trn2_projection.py [--ctx 4096] [--tau 4.174] [--regen] [--json out.json]

step = compute + hbm + collectives + launch, each term printed with where its numbers come from:
- compute: every kernel call of the step's static graphs at release shapes (rank 0 of 64, context
  bound --ctx) run under the simulator with its engine-time ledger (`nki_sim._cost`: the NKI guides'
  clocks and per-instruction costs; a call = its busiest engine + 2 DMA latencies), plus the graphs'
  torch ops outside the kernels (one Vector instruction each). MEASURED here: perf/trn2_engine_time.json,
  written by `python -m v4flash_backend.checks.engine_time` (2-4 min; --regen runs it);
- hbm: the bytes those kernels' DMAs move to and from HBM plus the glue's copies, at a rank's
  bandwidth (BORROWED: 2.9 TB/s per trn2 device over its 4 LNC=2 ranks), not overlapped with compute;
- collectives: the step's collectives, MEASURED on the CPU step of the release structure
  (`trn2_step_counts`), x an in-graph all-reduce (BORROWED: NxDI's DeepSeek-V3 profile);
- launch: graphs per step x (BORROWED: NxDI's TPOT minus its profiled device time).
The same compute model prices a DeepSeek-V3-shaped stack; its ratio to NxDI's ~12 ms is
`dsv3_compute_ratio`. The MoE is priced as the static graph runs it (`model/ffn.py`): the routed
experts packed into `ffn.moe_capacity` (row, expert) slots per rank and layer, each routed kernel call
its measured fixed part (every slot empty: no weight read) plus the expected occupied slots x one
slot's measured cost, the overflow pass likewise. The expert weight formats (deliverable 4 of issue 47)
are compared side by side with `placement`'s memory per rank.
The last line is the `trn2-projection:` summary of the DSpark step.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import trn2_step_counts as sc  # noqa: E402
from trn2_step_counts import (  # noqa: E402,F401  (the names tests and other benches import from here)
    TOKENIZER,
    build_random_model,
    layout_counts,
    measure_step,
    release_config,
    served_counts,
    structure_config,
)

from v4flash_backend import ops  # noqa: E402
from v4flash_backend.checks import engine_time as et  # noqa: E402
from v4flash_backend.model import ffn  # noqa: E402

ENGINE_JSON = ROOT / "perf" / "trn2_engine_time.json"
NXDI = "aws-neuron/neuronx-distributed-inference contrib/models/DeepSeek-V3/README.md (SDK 2.28, TP 64, LNC 2, BF16)"
BORROWED = {
    "allreduce_us": (3000.0 / 122, f"{NXDI}: ~3 ms of collectives over 122 TP-64 all-reduces (61 layers x 2)"),
    "launch_ms": (20.5 - 19.0, f"{NXDI}: TPOT 20.5 ms p50 minus the profile's ~19 ms device total, per graph"),
    "rank_hbm_gbps": (2900.0 / 4, "trn2 device HBM 2.9 TB/s (NKI Trainium2 architecture guide) over 4 LNC=2 ranks"),
    "dsv3_compute_ms": (12.0, f"{NXDI}: profile 'Compute (matmul, attention, MoE) ~12 ms'"),
    "dsv3_weights_ms": (3.0, f"{NXDI}: profile 'Memory access (weight reads) ~3 ms'"),
    "dsv3_tpot_ms": (20.5, f"{NXDI}: TPOT p50"),
}
TAU = (4.174, "the embedded model's greedy acceptance, fixed-5 at T = 0 on 96 held-out prompts: "
              "perf/draft_acceptance.py, docs/performance.md (recorded 2515ca2)")
TARGETS = {"plain_step_ms": 20.0, "dspark_token_ms": 8.0}
GLUE_GHZ = 0.96  # glue runs on the Vector Engine (nki_sim._cost)
FORMATS = {  # expert weight bytes per weight in memory, how the GEMM is priced
    "fp4": (0.5 + 1 / 32, "MXFP4 decoded in SBUF per call (today): linear_fp4's own instructions"),
    "fp8": (1.0, "converted once at load to e4m3 + a power-of-two per row: priced as the bf16 GEMM schedule "
                 "(no decode) with fp8 bytes; no kernel for it yet"),
    "bf16": (2.0, "converted once at load to bf16: linear_bf16's own instructions"),
}


# ---- the engine-time cache -----------------------------------------------------------------------------
def load_engine(path: Path, regen: bool, ctx: int) -> dict:
    if regen or not path.exists():
        ops.set_numerics("reference")
        data = et.measure(release_config(), ctx)
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    data = json.loads(path.read_text())
    if data["ctx"] != ctx:
        raise SystemExit(f"{path} was measured at context bound {data['ctx']}, not {ctx}: pass --regen")
    data["costs_by"] = {(c["op"], ast.literal_eval(c["sig"])): c for c in data["costs"]}
    data["counts"] = {g: Counter({(e["op"], ast.literal_eval(e["sig"])): e["count"] for e in lst})
                      for g, lst in data["graphs"].items()}
    data["dsv3_counts"] = Counter({(e["op"], ast.literal_eval(e["sig"])): e["count"] for e in data["dsv3"]["calls"]})
    return data


# ---- pricing ----------------------------------------------------------------------------------------------
def expected_occupied(pairs: int, p: float, cap: int) -> float:
    """E[min(X, cap)] for X ~ Binomial(pairs, p): the routed form's occupied slots per rank and layer."""
    return sum(min(x, cap) * math.comb(pairs, x) * p ** x * (1 - p) ** (pairs - x) for x in range(pairs + 1))


def p_overflow(pairs: int, p: float, cap: int) -> float:
    return sum(math.comb(pairs, x) * p ** x * (1 - p) ** (pairs - x) for x in range(cap + 1, pairs + 1))


def weight_bytes(fmt: str, n: int, k: int) -> float:
    return {"fp4": n * k * (0.5 + 1 / 32), "fp8": n * k + 4 * n, "bf16": 2 * n * k}[fmt]


def moe_shape(cfg, graph: str, world: int):
    """(local experts, activated experts per row, total experts) of the graph's MoE layers."""
    if graph == "dspark_draft":
        return cfg.dspark_n_routed_experts // world, cfg.dspark_n_activated_experts, cfg.dspark_n_routed_experts
    return cfg.n_routed_experts // world, cfg.n_activated_experts, cfg.n_routed_experts


def graph_rows(cfg, graph: str) -> int:
    """Rows of one sequence's MoE calls in a graph of the step (batch 1)."""
    B = cfg.dspark_block_size or 0
    return {"plain_verify": 1, "dspark_verify": 1 + B, "dspark_draft": B}[graph]


def routed_slots(cfg, graph: str, sig: tuple, world: int = 64) -> tuple[float, str]:
    """(expected occupied slots, which pass) of a routed call (`et.is_routed`): the packed pass
    (x [capacity, 1, K]) holds min(X, capacity) of a rank's X ~ Binomial(rows x top-k, local/total)
    pairs (routing uniform, assumed); the overflow pass (x [local experts, rows, K]) runs at most the
    E[(X - capacity)+] overflowing pairs' experts (an upper bound: two may share one)."""
    e_local, k_act, e_total = moe_shape(cfg, graph, world)
    rows = graph_rows(cfg, graph)
    cap = ffn.moe_capacity(rows, k_act, e_local, e_total)
    p = e_local / e_total
    fit = expected_occupied(rows * k_act, p, cap)
    if sig[0][1][0] == e_local:
        return rows * k_act * p - fit, "overflow"
    return fit, "packed"


def price_graph(eng: dict, cfg, graph: str, expert: str = "fp4", dense: str = "fp8", world: int = 64) -> dict:
    """compute_ns, hbm_bytes and per-family figures of one graph as traced, under weight formats. A routed
    call costs its measured fixed part (every slot empty) + the expected occupied slots x one slot's cost
    (measured with one slot occupied, minus the fixed part; other formats: the bf16 GEMM on one row)."""
    costs = eng["costs_by"]
    fam: dict = defaultdict(lambda: {"calls": 0.0, "compute_ns": 0.0, "hbm_bytes": 0.0, "call_ns": 0.0})
    occupied: dict = {}
    for (op, sig), n in eng["counts"][graph].items():
        f = fam[op]
        if et.is_routed(op, sig):
            occ, which = routed_slots(cfg, graph, sig, world)
            occupied[which] = occ
            base, one = costs[(op + "@empty", sig)], costs[(op, sig)]
            if expert == "fp4":
                slot = {k: one[k] - base[k] for k in ("compute_ns", "call_ns", "hbm_bytes")}
            else:
                b = costs[et.routed_bf16(sig)]
                nn, kk = sig[1][1][1], sig[0][1][-1]
                slot = {"compute_ns": b["compute_ns"], "call_ns": b["call_ns"],
                        "hbm_bytes": b["hbm_bytes"] + weight_bytes(expert, nn, kk) - weight_bytes("bf16", nn, kk)}
            f["calls"] += n
            for k in ("compute_ns", "call_ns", "hbm_bytes"):
                f[k] += n * (base[k] + occ * slot[k])
            continue
        use, hbm_fix = (op, sig), 0.0
        if op == "linear_fp4" and expert != "fp4":
            use = et.as_bf16(*use)
            nn, kk = use[1][1][1]
            hbm_fix = weight_bytes(expert, nn, kk) - weight_bytes("bf16", nn, kk)
        if op == "linear_fp8" and dense == "bf16" and len(sig[0][1]) == 2:
            use = et.as_bf16(*use)
        c = costs.get(use)
        if c is None:
            raise KeyError(f"{graph}: no ledger for {use[0]}{use[1]}; regenerate with --regen")
        f["calls"] += n
        f["compute_ns"] += n * c["compute_ns"]
        f["call_ns"] += n * c["call_ns"]
        f["hbm_bytes"] += n * (c["hbm_bytes"] + hbm_fix)
    glue = eng["glue"][graph]
    fam["(glue)"] = {"calls": glue["ops"], "compute_ns": glue["cycles"] / GLUE_GHZ, "hbm_bytes": glue["bytes"],
                     "call_ns": glue["cycles"] / GLUE_GHZ + glue["bytes"] / BORROWED["rank_hbm_gbps"][0]}
    return {"families": {k: dict(v) for k, v in fam.items()}, "occupied": occupied,
            "compute_ns": sum(v["compute_ns"] for v in fam.values()),
            "hbm_bytes": sum(v["hbm_bytes"] for v in fam.values()),
            "call_ns": sum(v["call_ns"] for v in fam.values())}


def step(eng: dict, cfg, counts: dict, dspark: bool, tau: float, expert="fp4", dense="fp8",
         pipeline: int = 1) -> dict:
    """The terms of one decode step (plain: the verify graph; DSpark: verify + draft)."""
    graphs = ["dspark_verify", "dspark_draft"] if dspark else ["plain_verify"]
    priced = {g: price_graph(eng, cfg, g, expert, dense) for g in graphs}
    coll = counts["dspark" if dspark else "plain"]
    n_coll = sum(c[0] for c in coll["collectives"].values()) + 1  # + the step plan's broadcast
    n_graphs = coll["graphs"] + (pipeline - 1)  # the verify graph runs as one graph per stage
    n_coll += pipeline - 1  # one boundary hand-off per stage boundary
    t = {"compute_ms": sum(p["compute_ns"] for p in priced.values()) / 1e6,
         "hbm_ms": sum(p["hbm_bytes"] for p in priced.values()) / (BORROWED["rank_hbm_gbps"][0] * 1e6),
         "collectives_ms": n_coll * BORROWED["allreduce_us"][0] / 1e3,
         "launch_ms": n_graphs * BORROWED["launch_ms"][0]}
    t["step_ms"] = sum(t.values())
    # the kernels' weight streaming hidden under their engines (each call: its busiest queue, DMA included)
    t["overlapped_ms"] = (sum(p["call_ns"] for p in priced.values()) / 1e6 + t["collectives_ms"] + t["launch_ms"])
    t["tau"] = tau if dspark else 1.0
    t["tpot_ms"] = t["step_ms"] / t["tau"]
    t.update(graphs=n_graphs, collectives=n_coll, priced=priced, host_syncs=coll["host_syncs"],
             world_allreduce=sum(c[0] for h, c in coll["collectives"].items()
                                 if sc.HOOK_GROUP[h] == "world" and sc.HOOK_OP.get(h, "all_reduce") == "all_reduce"))
    return t


def dsv3(eng: dict) -> dict:
    """The DeepSeek-V3 stack priced by the same compute model (and its other terms, for the record)."""
    costs = eng["costs_by"]
    fam: dict = defaultdict(lambda: {"calls": 0, "compute_ns": 0.0, "hbm_bytes": 0.0})
    for (op, sig), n in eng["dsv3_counts"].items():
        c = costs[(op, sig)]
        fam[op]["calls"] += n
        fam[op]["compute_ns"] += n * c["compute_ns"]
        fam[op]["hbm_bytes"] += n * c["hbm_bytes"]
    glue_ns = eng["dsv3"]["glue_ops"] * 64 / GLUE_GHZ
    compute = (sum(f["compute_ns"] for f in fam.values()) + glue_ns) / 1e6
    hbm = sum(f["hbm_bytes"] for f in fam.values()) / (BORROWED["rank_hbm_gbps"][0] * 1e6)
    return {"families": {k: dict(v) for k, v in fam.items()}, "compute_ms": compute, "hbm_ms": hbm,
            "ratio": compute / BORROWED["dsv3_compute_ms"][0]}


# ---- memory per rank of the expert formats (placement) ---------------------------------------------------------
def rank_gib(cfg, world: int, pipeline: int, expert: str, dense: str = "fp8", max_model_len: int = 65536,
             max_num_seqs: int = 8) -> float:
    """The largest rank's weights + caches (`placement`) with the experts (and dense fp8 GEMMs) in a format."""
    from v4flash_backend.parallel import placement
    from v4flash_backend.parallel.layout import stage_cuts

    specs = []
    for name, shape, st in placement.tensor_specs(cfg):
        is_exp = ".ffn.experts." in name
        is_dense8 = st == "F8_E4M3" and not is_exp and ".engram.embed." not in name
        base = name[: -len("scale")] + "weight" if name.endswith(".scale") else name
        if is_exp and expert != "fp4":
            if name.endswith(".scale"):
                if expert == "fp8":
                    specs.append((name, (shape[0], 1), "F32"))  # the per-row power of two
                continue
            specs.append((name, (shape[0], shape[1] * 2), "F8_E4M3" if expert == "fp8" else "BF16"))
        elif dense == "bf16" and (is_dense8 or (name.endswith(".scale") and st == "F8_E8M0" and not is_exp
                                                and ".engram.embed." not in base)):
            if not name.endswith(".scale"):
                specs.append((name, shape, "BF16"))
        else:
            specs.append((name, shape, st))
    per_rank = placement.all_rank_bytes(cfg, world, specs, pipeline=pipeline)
    cuts = stage_cuts(cfg, pipeline)
    S = world // pipeline
    worst = 0
    for r, b in enumerate(per_rank):
        s = r // S
        caches = placement.cache_bytes(cfg, max_num_seqs + 1, max_model_len, layers=(cuts[s], cuts[s + 1]),
                                       dspark=s == pipeline - 1)
        worst = max(worst, sum(b.values()) + caches)
    return worst / placement.GIB


def fp8_exact_rows(w: torch.Tensor) -> torch.Tensor:
    """Per row of fp32 weights [N, K]: scaled by the power of two that brings its largest magnitude into
    (120, 240], does it hold only e4m3 values (the legacy e4m3 and e4m3fn grids agree up to 240)?"""
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(2.0 ** -126)
    v = w * torch.exp2(-torch.ceil(torch.log2(amax / 240.0)))
    return (v.to(torch.float8_e4m3fn).float() == v).all(dim=1)


def fp8_rows_exact(ckpt: Path) -> tuple[int, int]:
    """(rows, rows exact) of a checkpoint's MXFP4 experts in the fp8-at-load format: each row scaled
    by the power of two that brings its largest magnitude into (120, 240] (the e4m3 range a NeuronCore-v3
    matmul takes) must then hold only e4m3 values -- e2m1 x its ue8m0 scales, exactly; a row whose scales
    span too many binades would lose its small values to e4m3's subnormal floor (2^-9)."""
    from v4flash_backend.formats import quant
    from v4flash_backend.formats.checkpoint import CheckpointReader

    rows = exact = 0
    with CheckpointReader(ckpt) as r:
        for name in r.keys():
            if ".ffn.experts." not in name or not name.endswith(".weight") or r.info(name).st_dtype != "I8":
                continue
            ok = fp8_exact_rows(quant.dequant_fp4_weight(r.get(name), r.get(name[: -len("weight")] + "scale")))
            rows += ok.numel()
            exact += int(ok.sum())
    return rows, exact


# ---- output ---------------------------------------------------------------------------------------------------------
def fam_table(title: str, rows: dict) -> list[str]:
    out = [title, f"  {'family':18}{'calls':>9}{'compute ms':>12}{'HBM MB':>10}"]
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]["compute_ns"]):
        out.append(f"  {k:18}{v['calls']:>9.1f}{v['compute_ns'] / 1e6:>12.2f}{v['hbm_bytes'] / 1e6:>10.1f}")
    return out


def merged(priced: dict) -> dict:
    out: dict = defaultdict(lambda: {"calls": 0.0, "compute_ns": 0.0, "hbm_bytes": 0.0, "call_ns": 0.0})
    for p in priced.values():
        for k, v in p["families"].items():
            for f in out[k]:
                out[k][f] += v[f]
    return out


def terms_line(label: str, t: dict) -> str:
    return (f"  {label:34} compute {t['compute_ms']:8.1f}  hbm {t['hbm_ms']:6.1f}  collectives "
            f"{t['collectives_ms']:5.2f}  launch {t['launch_ms']:4.1f}  = step {t['step_ms']:8.1f} ms"
            + (f", tau {t['tau']:.3f} -> token {t['tpot_ms']:.1f} ms" if t["tau"] != 1.0 else "")
            + f" (HBM under the kernels' DMA: {t['overlapped_ms']:.1f})")


def verdict(name: str, value: float, target: float, t: dict) -> str:
    if value <= target:
        return f"done-when {name}: {value:.1f} ms <= {target:g} ms: met"
    parts = {k: t[k] for k in ("compute_ms", "hbm_ms", "collectives_ms", "launch_ms")}
    big = max(parts, key=parts.get)
    fams = merged(t["priced"])
    top = sorted(fams.items(), key=lambda kv: -kv[1]["compute_ns"])[:3]
    div = t["tau"]
    return (f"done-when {name}: {value:.1f} ms > {target:g} ms: NOT met, blocked by {big[:-3]} "
            f"({parts[big] / div:.1f} ms of it; over by {value - target:.1f} ms); its largest families: "
            + ", ".join(f"{k} {v['compute_ns'] / 1e6 / div:.1f} ms" for k, v in top))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=4096, help="context bound of the decode bucket")
    ap.add_argument("--tau", type=float, default=TAU[0], help="tokens committed per DSpark step")
    ap.add_argument("--regen", action="store_true", help=f"re-measure {ENGINE_JSON.name} (about 2 min)")
    ap.add_argument("--engine-json", type=Path, default=ENGINE_JSON)
    ap.add_argument("--no-formats", dest="formats", action="store_false",
                    help="skip the expert-format memory comparison (placement of W = 64 and 128: ~1 min)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    ops.set_numerics("reference")  # the device's numerics; counts do not depend on it
    eng = load_engine(args.engine_json, args.regen, args.ctx)
    cfg = release_config()
    from tokenizers import Tokenizer

    small = structure_config(cfg, Tokenizer.from_file(str(TOKENIZER)))
    model = build_random_model(small, comm=sc.CountingComm())
    counts = {"plain": measure_step(model, 1, args.ctx, False), "dspark": measure_step(model, 1, args.ctx, True)}
    tau = args.tau
    res = {m: step(eng, cfg, counts, m == "dspark", tau) for m in ("plain", "dspark")}
    ds = dsv3(eng)
    cur = et.sources_sha()
    where = args.engine_json.relative_to(ROOT) if args.engine_json.is_relative_to(ROOT) else args.engine_json
    out = [f"V4.1-Flash decode step on trn2.48xlarge (W = 64, batch 1, context bound {args.ctx}): a MODEL, "
           "not a measurement",
           f"engine-time ledgers: {where} (MEASURED here: nki_sim at release shapes, rank 0 of {eng['world']}, "
           f"grid {eng['grid']}; kernels/simulator {eng['sources_sha']}, now {cur}: "
           f"{'current' if cur == eng['sources_sha'] else 'STALE, pass --regen'})",
           "cost model (nki_sim._cost), overlap rule " + eng["cost_model"]["rule"].replace("\n", " "),
           "  constants:"]
    out += [f"    {k} = {v}  [{s}]" for k, (v, s) in eng["cost_model"]["constants"].items()]
    out += ["  assumed (the documents do not say):"] + [f"    - {a}" for a in eng["cost_model"]["assumed"]]
    out += ["borrowed:"] + [f"  {k} = {v:.4g}  [{s}]" for k, (v, s) in BORROWED.items()]
    tau_src = TAU[1] if tau == TAU[0] else "--tau"
    out.append(f"  tau = {tau:.3f}  [{tau_src}; the release model's acceptance is unknown]")
    out += fam_table("plain decoding (the static graph: routed experts in packed slots), per step:",
                     merged(res["plain"]["priced"]))
    out += fam_table("DSpark step (verify 6 rows + draft), per step:", merged(res["dspark"]["priced"]))
    occ = res["dspark"]["priced"]["dspark_verify"]["occupied"]
    occ_plain = res["plain"]["priced"]["plain_verify"]["occupied"]
    rows_v = 1 + cfg.dspark_block_size
    e_local = cfg.n_routed_experts // eng["world"]
    cap_v = ffn.moe_capacity(rows_v, cfg.n_activated_experts, e_local, cfg.n_routed_experts)
    cap_p = ffn.moe_capacity(1, cfg.n_activated_experts, e_local, cfg.n_routed_experts)
    out += [f"routed MoE (model/ffn.py, what the graph runs): {cap_v} (row, expert) slots per rank and MoE layer at "
            f"a {rows_v}-row verify, {cap_p} at a plain row (ffn.moe_capacity); routing uniform over the experts "
            f"(assumed), so a rank's pairs per layer ~ Binomial(rows x top-k, 1/{eng['world']}): occupied "
            f"{occ.get('packed', 0):.4f} at the verify (overflow pass: <= {occ.get('overflow', 0):.1e} experts, "
            f"P(overflow) {p_overflow(rows_v * cfg.n_activated_experts, 1 / 64, cap_v):.1e} per layer), "
            f"{occ_plain.get('packed', 0):.4f} at a plain row; a routed call = its measured fixed part (every slot "
            "empty: no weight read) + occupied x one slot (measured); the draft stages (2 local experts) run the "
            "dense form",
            "terms (ms): compute MEASURED (+ glue DERIVED), hbm bytes MEASURED / bandwidth BORROWED, collectives "
            "count MEASURED x latency BORROWED, launch graphs MEASURED x latency BORROWED"]
    for k in ("plain", "dspark"):
        out.append(terms_line(k, res[k]))
    out += fam_table("DeepSeek-V3 stack (61 layers, 7168, 256 experts top-8, MLA, bf16, TP 64, seq 512, batch 1) "
                     "priced by the same compute model, per token:", ds["families"])
    out.append(f"  compute {ds['compute_ms']:.2f} ms vs NxDI's ~{BORROWED['dsv3_compute_ms'][0]:g} ms: "
               f"dsv3_compute_ratio={ds['ratio']:.2f} (bar 0.5-2); weight reads {ds['hbm_ms']:.2f} ms vs ~"
               f"{BORROWED['dsv3_weights_ms'][0]:g} ms")
    pa, da = res["plain"], res["dspark"]
    out += [verdict("plain decoding step", pa["step_ms"], TARGETS["plain_step_ms"], pa),
            verdict("DSpark token", da["tpot_ms"], TARGETS["dspark_token_ms"], da)]
    best = {m: step(eng, cfg, counts, m == "dspark", tau, "fp8", "bf16") for m in ("plain", "dspark")}
    out += fam_table("what is left with every GEMM weight converted at load (experts fp8, dense fp8 -> bf16), "
                     "plain decoding per step:", merged(best["plain"]["priced"]))
    out += [terms_line("plain, converted at load", best["plain"]),
            terms_line("dspark, converted at load", best["dspark"]),
            verdict("plain decoding step (converted)", best["plain"]["step_ms"], TARGETS["plain_step_ms"],
                    best["plain"]),
            verdict("DSpark token (converted)", best["dspark"]["tpot_ms"], TARGETS["dspark_token_ms"],
                    best["dspark"])]
    fmt = formats(eng, cfg, counts, tau) if args.formats else []
    out += [r["line"] for r in fmt]
    for line in out:
        print(line)
    if args.json:
        dump = {k: {kk: vv for kk, vv in v.items() if kk != "priced"} | {"families": merged(v["priced"])}
                for k, v in res.items()}
        Path(args.json).write_text(json.dumps({"terms": dump, "dsv3": ds, "formats": fmt, "tau": tau,
                                               "borrowed": BORROWED, "ctx": args.ctx,
                                               "counts": counts}, indent=1, default=str))
    print(f"trn2-projection: step_ms={da['step_ms']:.1f} tpot_ms={da['tpot_ms']:.1f} compute_ms={da['compute_ms']:.1f} "
          f"hbm_ms={da['hbm_ms']:.1f} collectives_ms={da['collectives_ms']:.2f} launch_ms={da['launch_ms']:.1f} "
          f"graphs_per_step={da['graphs']} host_syncs_per_step={da['host_syncs']} "
          f"world_allreduce_per_step={da['world_allreduce']} dsv3_compute_ratio={ds['ratio']:.2f}")
    return 0


def formats(eng: dict, cfg, counts: dict, tau: float) -> list[dict]:
    """Deliverable 4: the expert weight formats (and two pipeline stages at W = 128) side by side."""
    rows = []
    options = [("fp4", 64, 1, "fp8"), ("fp8", 64, 1, "fp8"), ("bf16", 64, 1, "fp8"), ("bf16", 128, 2, "fp8"),
               ("fp8", 64, 1, "bf16")]
    from v4flash_backend.parallel.placement import RANK_HBM_GIB

    for expert, world, pp, dense in options:
        gib = rank_gib(cfg, world, pp, expert, dense)
        r = {"expert": expert, "world": world, "pipeline": pp, "dense": dense, "gib_per_rank": gib,
             "fits": gib <= RANK_HBM_GIB}
        p = step(eng, cfg, counts, False, tau, expert, dense, pp)
        d = step(eng, cfg, counts, True, tau, expert, dense, pp)
        r["routed"] = {"plain_step_ms": p["step_ms"], "dspark_token_ms": d["tpot_ms"]}
        label = (f"experts {expert}" + (f" at W={world} ({pp} stages)" if pp > 1 else "")
                 + (", dense fp8 GEMMs -> bf16 at load" if dense == "bf16" else ""))
        r["line"] = (f"  {label:52} {gib:6.2f} GiB/rank ({'fits' if r['fits'] else 'OVER'} {RANK_HBM_GIB:g})  "
                     f"routed: plain {r['routed']['plain_step_ms']:6.1f} / token "
                     f"{r['routed']['dspark_token_ms']:5.1f} ms")
        rows.append(r)
    fit = [r for r in rows if r["fits"] and r["dense"] == "fp8"]
    best = min(fit, key=lambda r: r["routed"]["dspark_token_ms"])
    checks = []
    for label, ck in (("golden v41-tiny (official reference code's tiny)", sc.SHARED / "golden" / "v41-tiny"),
                      ("embedded v4flash-tiny", ROOT / "models" / "v4flash-tiny")):
        if (ck / "config.json").exists():
            n, ok = fp8_rows_exact(ck)
            checks.append(f"{label} {ok}/{n}")
    exact = {"line": "fp8 at load is exact (bit-identical weights, so golden-check is unchanged) for the expert rows "
                     "whose scales fit e4m3 after one power of two per row: " + ", ".join(checks)
                     + "; the release checkpoint's rows are not checked here (rows that do not fit stay bf16)"}
    head = {"line": "expert weight formats (memory: placement, max rank, max_model_len 65536 x 8 sequences; "
                    "step times as above; " + "; ".join(f"{k}: {v[1]}" for k, v in FORMATS.items()) + "):"}
    tail = {"line": f"trn2-formats: choice={best['expert']} (W={best['world']}) routed_token_ms="
                    f"{best['routed']['dspark_token_ms']:.1f} "
                    f"gib_per_rank={best['gib_per_rank']:.2f} (the fastest that fits; not the default yet: see "
                    "docs/performance.md)"}
    return [head] + rows + [exact, tail]


if __name__ == "__main__":
    sys.exit(main())
