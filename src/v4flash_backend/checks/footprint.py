"""Live SBUF / PSUM footprint of NKI kernel launches under the CPU simulator, and the release-shape
kernel check of `release-check`.

The figures are the simulator's own accounting (`nki_sim._rules.Footprint`, rule R8, issue 12): every
on-chip allocation counts its bytes per partition (free size x item size; PSUM in whole 2 KiB banks) from
its allocation until the kernel drops its last reference to it, per program of the launch grid;
`measuring()` reads the per-program peaks the simulator leaves in `nki_sim._runtime.last_peaks`. This is
conservative against the compiler, which can reuse the space of a tile whose last use has passed while a
Python name still holds it.

Budgets (`nki_sim._rules` of issue 12, after aws-neuron-sdk `nki/guides/architecture/trainium2_arch.rst`):
192 KiB of SBUF per partition usable by a kernel (NeuronCore-v3 has 224 KiB physical, the rest left
to the compiler) and PSUM 16 KiB per partition = 8 banks of 2 KiB.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

SBUF_BUDGET = 192 * 1024
PSUM_BUDGET = 16 * 1024
PSUM_BANK = 2 * 1024
PSUM_BANKS = 8
GRID = 2  # programs per launch: the LNC of a trn2 rank (ops.nki_ops uses 1 in the simulator by default)

# the op seam functions (ops/__init__.py), each running one of the kernels of kernels.KERNELS
OP_NAMES = ("linear_fp8", "linear_fp4", "linear_bf16", "linear_f32", "rms_norm", "sparse_attn", "indexer_scores",
            "softmax_pool", "hc_mixes", "hc_expand", "hc_collapse", "hc_post", "swiglu", "engram_gate")


def arg_sig(a):
    """Hashable skeleton of an op argument: ('T', shape, dtype) for a tensor, else the value."""
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), str(a.dtype).replace("torch.", ""))
    if isinstance(a, float):
        return float(a)
    return a


# ---- the measurement --------------------------------------------------------------------------------
@dataclass
class Launch:
    kernel: str
    peak_sbuf: int  # bytes per partition
    peak_psum: int  # bytes per partition of whole PSUM banks (peak_banks x 2 KiB)
    peak_banks: int
    cost: dict | None = None  # the simulator's engine-time ledger of the launch (nki_sim._cost.CallCost)


@contextmanager
def measuring():
    """Within the block, every nki_sim kernel launch appends a `Launch` to the yielded list: the largest
    peaks over the programs of its grid, as the simulator's own footprint rule (`nki_sim._rules.Footprint`,
    R8) counted them. The rule's refusal is off inside the block (`measure_only`) so that an
    over-budget kernel runs to completion and its peak can be reported."""
    from v4flash_backend.kernels import _nki

    if not _nki.USING_SIMULATOR:
        raise RuntimeError("footprint measurement needs the nki_sim simulator (V4FLASH_NKI=sim)")
    import nki_sim._runtime as R
    from nki_sim._rules import measure_only

    launches: list[Launch] = []
    orig_launch = R.launch

    def launch(fn, grid, args, kwargs):
        R.last_peaks, R.last_cost = [], None
        try:
            return orig_launch(fn, grid, args, kwargs)
        finally:  # a launch that raised reports the programs that finished
            sbuf = max((p[0] for p in R.last_peaks), default=0)
            banks = max((p[1] for p in R.last_peaks), default=0)
            cost = R.last_cost.as_dict() if R.last_cost is not None else None
            launches.append(Launch(getattr(fn, "__name__", "kernel"), sbuf, banks * PSUM_BANK, banks, cost))

    R.launch = launch
    try:
        with measure_only():
            yield launches
    finally:
        R.launch = orig_launch


# ---- the release-shape kernel check -----------------------------------------------------------------
@dataclass
class KernelResult:
    kernel: str
    launches: int = 0
    failures: list = field(default_factory=list)
    peak_sbuf: int = 0
    peak_psum: int = 0
    peak_banks: int = 0
    worst: str = ""  # the op call with the largest SBUF footprint
    seconds: float = 0.0

    @property
    def fits(self) -> bool:
        return self.peak_sbuf <= SBUF_BUDGET and self.peak_psum <= PSUM_BUDGET and self.peak_banks <= PSUM_BANKS

    @property
    def ok(self) -> bool:
        return self.launches > 0 and not self.failures and self.fits


def _make(a, g: torch.Generator, idx_range: int | None = None):
    """A real input for a signature entry: values a kernel accepts (finite floats, unit e8m0 scales,
    valid attention slots)."""
    if not (isinstance(a, tuple) and a and a[0] == "T"):
        return a
    shape, dt = a[1], getattr(torch, a[2])
    if dt == torch.float8_e8m0fnu:
        return torch.full(shape, 127, dtype=torch.uint8).view(dt)  # 2^0
    if dt in (torch.int8, torch.uint8):
        return torch.randint(-128 if dt == torch.int8 else 0, 128 if dt == torch.int8 else 256, shape,
                             dtype=dt, generator=g)
    if dt in (torch.int32, torch.int64):
        hi = idx_range or 1
        return torch.randint(-1, hi, shape, dtype=dt, generator=g)
    return (torch.randn(shape, generator=g) * 0.5).to(dt)


def _inputs(op: str, sig, g):
    kw = {}
    args = []
    for a in sig:
        if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and a[0] != "T":
            kw[a[0]] = _make(a[1], g)
        else:
            args.append(a)
    idx_range = None
    if op == "sparse_attn":
        idx_range = args[1][1][1]  # kv rows
    vals = [_make(a, g, idx_range) for a in args]
    if op in ("linear_fp4", "linear_fp8") and len(vals) == 4:  # the routed experts' slots (`experts`)
        vals[3] = torch.full(vals[3].shape, -1, dtype=vals[3].dtype)
        vals[3][:ROUTED_OCCUPIED] = 0  # the first ROUTED_OCCUPIED slots on expert 0, the rest empty
    return vals, kw


# occupied slots of a routed call's measurement (`engine_time` measures 1 and 0: a slot's cost and the
# call's fixed part, which the projection scales by the expected occupancy)
ROUTED_OCCUPIED = 1


def _describe(op, sig) -> str:
    parts = []
    for a in sig:
        if isinstance(a, tuple) and a and a[0] == "T":
            parts.append(f"{a[2]}{list(a[1])}")
    return f"{op}({', '.join(parts)})"


def add_costs(a: dict | None, b: dict | None) -> dict | None:
    """Two engine-time ledgers (`Launch.cost`) of launches that run one after the other."""
    if a is None or b is None:
        return a or b
    out = {k: a[k] + b[k] for k in ("call_ns", "compute_ns", "engine_ns", "dma_ns", "dma_bytes", "hbm_bytes",
                                    "dma_transfers")}
    for k in ("per_engine_ns", "instructions"):
        out[k] = {e: a[k][e] + b[k][e] for e in a[k]}
    return out


def check_kernels(calls: dict, log=None, grid: int = GRID, costs: dict | None = None) -> list[KernelResult]:
    """Run every recorded op call {op: {signature}} (see `release._OpRecorder`) on the nki-sim backend
    with fresh inputs of those shapes; one KernelResult per kernel of `kernels.KERNELS` (a kernel no
    call reaches counts as not ok: unmeasured). `costs`, if given, receives {(op, signature): the
    engine-time ledger of the call} (summed over its launches; `nki_sim._cost`)."""
    import os

    from v4flash_backend import kernels, ops

    names = [k.__name__ for fams in kernels.KERNELS.values() for k in fams]
    res = {n: KernelResult(n) for n in names}
    g = torch.Generator().manual_seed(0)
    saved = ops.get_backend()
    saved_grid = os.environ.get("V4FLASH_NKI_GRID")
    os.environ["V4FLASH_NKI_GRID"] = str(grid)
    ops.set_backend("nki-sim")
    try:
        with measuring() as launches:
            for op in OP_NAMES:
                for sig in sorted(calls.get(op, ()), key=repr):
                    args, kw = _inputs(op, sig, g)
                    n0 = len(launches)
                    t0 = time.perf_counter()
                    err = None
                    try:
                        getattr(ops, op)(*args, **kw)
                    except Exception as e:  # noqa: BLE001 - any refusal of the simulator is a result
                        err = f"{type(e).__name__}: {str(e)[:200]}"
                    dt = time.perf_counter() - t0
                    if costs is not None and not err:
                        for la in launches[n0:]:
                            costs[(op, sig)] = add_costs(costs.get((op, sig)), la.cost)
                    for la in launches[n0:] or [Launch(op, 0, 0, 0)]:
                        r = res.setdefault(la.kernel, KernelResult(la.kernel))
                        r.launches += 1
                        r.seconds += dt
                        if err:
                            r.failures.append(f"{_describe(op, sig)}: {err}")
                        if la.peak_sbuf >= r.peak_sbuf:
                            r.worst = _describe(op, sig)
                        r.peak_sbuf = max(r.peak_sbuf, la.peak_sbuf)
                        r.peak_psum = max(r.peak_psum, la.peak_psum)
                        r.peak_banks = max(r.peak_banks, la.peak_banks)
                        if log:
                            log(f"kernel {la.kernel} {_describe(op, sig)}: sbuf_kib={la.peak_sbuf / 1024:.1f} "
                                f"psum_kib={la.peak_psum / 1024:.1f} banks={la.peak_banks} {dt:.1f}s"
                                + (f" FAILED {err}" if err else ""))
    finally:
        ops.set_backend(saved)
        if saved_grid is None:
            os.environ.pop("V4FLASH_NKI_GRID", None)
        else:
            os.environ["V4FLASH_NKI_GRID"] = saved_grid
    out = [res[n] for n in names] + [r for n, r in res.items() if n not in names]
    if log:
        for r in out:
            state = "ok" if r.ok else ("unmeasured" if not r.launches else "FAILED" if r.failures else "OVER BUDGET")
            log(f"kernel-footprint {r.kernel}: {state} launches={r.launches} peak_sbuf_kib={r.peak_sbuf / 1024:.1f} "
                f"(budget {SBUF_BUDGET // 1024}) peak_psum_kib={r.peak_psum / 1024:.1f} banks={r.peak_banks}/"
                f"{PSUM_BANKS} worst={r.worst} {r.seconds:.1f}s")
    return out


# ---- engine time per decode step -------------------------------------------------------------
def price(counts: Counter, costs: dict) -> dict:
    """{family: calls, engine_ns, call_ns, dma_ns, hbm_bytes} of one graph's calls (counts x ledgers),
    plus 'unpriced': calls whose kernel did not run."""
    fam: dict = defaultdict(lambda: {"calls": 0, "engine_ns": 0.0, "call_ns": 0.0, "dma_ns": 0.0,
                                     "hbm_bytes": 0})
    missing = 0
    for (op, sig), n in counts.items():
        c = costs.get((op, sig))
        if c is None:
            missing += n
            continue
        f = fam[op]
        f["calls"] += n
        for k in ("engine_ns", "call_ns", "dma_ns", "hbm_bytes"):
            f[k] += n * c[k]
    out = {k: dict(v) for k, v in sorted(fam.items())}
    out["unpriced"] = missing
    return out


def step_lines(counts: dict, costs: dict, graphs: list[str], label: str) -> list[str]:
    """`kernel-time` lines: per op family, its calls and engine time summed over `graphs` (one decode
    step; counts: {graph: Counter of (op, signature)}), and a total; call_us follows the overlap rule
    of `nki_sim._cost`, engine_us is the busiest engine alone."""
    total: Counter = Counter()
    for g in graphs:
        total.update(counts.get(g, Counter()))
    fams = price(total, costs)
    lines = []
    for op, f in fams.items():
        if op == "unpriced":
            continue
        lines.append(f"kernel-time {op}: calls_per_step={f['calls']} engine_us={f['engine_ns'] / 1e3:.1f} "
                     f"call_us={f['call_ns'] / 1e3:.1f} dma_us={f['dma_ns'] / 1e3:.1f} "
                     f"hbm_mib={f['hbm_bytes'] / 2 ** 20:.1f}")
    e = sum(f["engine_ns"] for k, f in fams.items() if k != "unpriced")
    c = sum(f["call_ns"] for k, f in fams.items() if k != "unpriced")
    n = sum(f["calls"] for k, f in fams.items() if k != "unpriced")
    lines.append(f"kernel-time step ({label}): calls={n} engine_ms={e / 1e6:.2f} call_ms={c / 1e6:.2f} "
                 f"unpriced_calls={fams['unpriced']} (nki_sim engine model: busiest engine + 2 DMA latencies "
                 "per call; a model, not a measurement)")
    return lines


# ---- the linears at a prefill row block ---------------------------------------------------------------
def linear_block_calls(rows: int = 512, n: int = 2048) -> dict:
    """Op calls of the linears at the release's contraction sizes with `rows` rows (the kernels' 512-row
    x^T block is the most a prefill chunk puts in SBUF at once) and `n` output columns (2 column blocks per
    program of the LNC=2 grid; the footprint does not grow with N past that): DSpark main_proj (fp8,
    K = 15360), the shared expert / attention projections (fp8, K = 5120), the routed experts (fp4), the
    bf16 compressor and grouped wo_a projections, the fp32 head shard."""
    def t(shape, dt):
        return ("T", tuple(shape), dt)

    return {
        "linear_fp8": {(t((rows, k), "bfloat16"), t((n, k), "float8_e4m3fn"), t((n // 32, k // 32), "float8_e8m0fnu"))
                       for k in (15360, 5120)},
        "linear_fp4": {(t((rows, 5120), "bfloat16"), t((n, 2560), "int8"), t((n, 160), "float8_e8m0fnu"))},
        "linear_bf16": {(t((rows, 5120), "bfloat16"), t((n, 5120), "bfloat16")),
                        (t((rows, 1, 4096), "bfloat16"), t((1, 1024, 4096), "bfloat16"))},
        "linear_f32": {(t((rows, 5120), "float32"), t((n, 5120), "float32"))},
    }


if __name__ == "__main__":  # python -m v4flash_backend.checks.footprint [rows]: the linears at a row block
    import sys

    res = check_kernels(linear_block_calls(int(sys.argv[1]) if len(sys.argv) > 1 else 512),
                        log=lambda s: None if "unmeasured" in s else print(s, flush=True))
    sys.exit(0 if all(r.ok for r in res if r.launches) else 1)
