"""Which golden level this machine can be held to: does its fp32 GEMM reproduce the reference's bits?

The official reference ran on a CPU whose MKL took its generic code path (an AMD EPYC). MKL picks its
kernels by CPU and by shape (on an Intel Xeon a GEMM of fewer than ~6 rows takes another kernel than a
longer one, and the generic path has its own small-row kernels), so the same ops in the same order give
the reference's bits on some machines and other bits, an fp32 ulp here and there, on others. The
forward's rounding points are the same everywhere; what differs is the summation order inside a GEMM.

The probe carries no bits of its own: the fixture holds the reference's head GEMM on both sides, its
input (`prefill_final_hidden`, bf16) and its output, once over every prompt row (`prefill_logits`, a
GEMM of S rows) and once over the last row alone (`prefill_logits_last`, one row, the shape of every
decode step). This machine's fp32 GEMM (`torch_ops.matmul_f32`, in the configured `ops` GEMM order)
reproduces all eight of the four cases, or it does not:

- level `bits`: it does; golden-check then also holds every replayed row bit-exact and the end-to-end
  logits at cosine 1 and full top-1 agreement (tests/test_golden.py);
- level `strict`: it does not; the fixture README's strict criteria hold (<= 5 % of rows above 2e-3 per
  layer, pre-mix within 1e-4, the same top-k sets but at near ties), bits are not claimed.

    python -m v4flash_backend.checks.gemm_probe ../shared/golden/v41-tiny [--second-order]

prints `gemm-probe: ...` (the level). `--second-order` prints the environment of the suite's second GEMM
order (`make test`'s third phase): `MKL_ENABLE_INSTRUCTIONS=AVX2` where that moves MKL to another path
(Intel CPUs: the probe's bits change), else `V4FLASH_GEMM_ORDER=split-k` (any CPU), and checks, in a
fresh process under that environment, that the probe's output bits really differ from the default's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from v4flash_backend import ops

MKL_SECOND = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
SPLIT_K = {"V4FLASH_GEMM_ORDER": "split-k"}
# what selects a GEMM order; the default order is the environment with none of them set
ORDER_VARS = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "V4FLASH_GEMM_ORDER")


@dataclass
class Probe:
    reproduced: int  # head GEMMs whose every output equals the reference's bits
    total: int
    digest: str  # a hash of every output bit (tells two orders apart)
    order: str  # the ops GEMM order and the MKL variables in effect

    @property
    def level(self) -> str:
        return "bits" if self.reproduced == self.total else "strict"

    def line(self) -> str:
        return (f"gemm-probe: reference_bits={self.reproduced}/{self.total} level={self.level} "
                f"order={self.order} digest={self.digest}")


def probe(fixture: str | Path) -> Probe:
    """The fixture's head GEMMs recomputed here, in the current GEMM order (fp32, as the reference's
    head: a bf16 hidden times the fp32-held bf16 head weight)."""
    from v4flash_backend.formats.checkpoint import CheckpointReader
    from v4flash_backend.ops import torch_ops

    d = Path(fixture)
    with CheckpointReader(d) as ck:
        w = ck.get("head.weight").float()
    f = safe_open(str(d / "cases.safetensors"), "pt")
    keys = set(f.keys())
    cases = sorted({k.split(".")[0] for k in keys if k.endswith(".prefill_final_hidden")})
    ok, n, h = 0, 0, hashlib.sha256()
    for c in cases:
        hid = f.get_tensor(f"{c}.prefill_final_hidden").float()
        for x, want in ((hid, f"{c}.prefill_logits"), (hid[-1:], f"{c}.prefill_logits_last")):
            if want not in keys:
                continue
            got = torch_ops.matmul_f32(x, w.T)
            ok += int(torch.equal(got.reshape(-1), f.get_tensor(want).reshape(-1)))
            n += 1
            h.update(got.contiguous().numpy().tobytes())
    mkl = ",".join(f"{k}={os.environ[k]}" for k in ORDER_VARS[:2] if os.environ.get(k))
    return Probe(ok, n, h.hexdigest()[:16], ops.get_gemm_order() + (f"+{mkl}" if mkl else ""))


def _probe_in(fixture: str | Path, env_vars: dict) -> Probe:
    """The probe in a fresh process (MKL reads its variables once, at load) under the default order
    plus `env_vars`."""
    env = {k: v for k, v in os.environ.items() if k not in ORDER_VARS}
    env.update(env_vars)
    code = ("import sys; from v4flash_backend.checks.gemm_probe import probe; p = probe(sys.argv[1]); "
            "print(p.reproduced, p.total, p.digest, p.order)")
    out = subprocess.run([sys.executable, "-c", code, str(fixture)], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    return Probe(int(out[0]), int(out[1]), out[2], out[3])


def second_order(fixture: str | Path) -> tuple[dict, Probe, Probe]:
    """The environment of the second GEMM order, the default order's probe and its probe: MKL's AVX2
    path where it changes the bits, else the split-K order (which changes them on every CPU)."""
    base = _probe_in(fixture, {})
    for env in (MKL_SECOND, SPLIT_K):
        other = _probe_in(fixture, env)
        if other.digest != base.digest:
            return env, base, other
    raise RuntimeError("no second GEMM order changes the probe's bits (split-K should on any CPU)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("fixture", help="a golden fixture directory (../shared/golden/v41-tiny)")
    ap.add_argument("--second-order", action="store_true",
                    help="print the second GEMM order's environment (KEY=VALUE) on stdout, after checking that "
                         "it changes the probe's bits; its report goes to stderr")


def main(args) -> int:
    if not args.second_order:
        print(probe(args.fixture).line())
        return 0
    env, base, other = second_order(args.fixture)
    print(f"gemm-order: default {base.line()[len('gemm-probe: '):]}", file=sys.stderr)
    print(f"gemm-order: second  {other.line()[len('gemm-probe: '):]} (the output bits differ from the "
          f"default's: digest {other.digest} != {base.digest})", file=sys.stderr)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    return 0


if __name__ == "__main__":
    from v4flash_backend.checks.command import standalone

    standalone("python -m v4flash_backend.checks.gemm_probe", add_arguments, main)
