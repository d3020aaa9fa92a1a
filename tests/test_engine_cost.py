"""The simulator's engine accounting (nki_sim._cost): a kernel with a known instruction mix gets the
cycles the documented constants give.

The expected figures are computed here from the documents' numbers and the instruction counts, not by
calling the cost model: the NKI ISA reference's "Estimated instruction cost" formulas (MIN_II = 64
cycles; N = elements per partition), the Trainium2 architecture guide's clocks (Tensor 2.4, Vector
0.96, Scalar / GpSimd 1.2 GHz) and Vector performance mode (bf16 copies 4x in SBUF), and the DMA
guide's 368 GB/s and ~1300 ns per transfer. All figures are exact arithmetic on small integers, so
the comparisons are exact up to float rounding (rel 1e-9)."""

import numpy as np
import pytest

import nki_sim
from nki_sim import _runtime as R

nki_sim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

GHZ = {"tensor": 2.4, "vector": 0.96, "scalar": 1.2, "gpsimd": 1.2}
DMA_GBPS, DMA_LAT_NS, MIN_II = 368.0, 1300.0, 64


@nki.jit
def mix(a, w):
    """a fp32 [128, 512], w bf16 [128, 512] in HBM -> fp32 [128, 512]."""
    x = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=x, src=a)                                    # DMA 256 KiB
    wb = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.dma_copy(dst=wb, src=w)                                   # DMA 128 KiB
    y = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=y, data1=x, data2=x, op=nl.add)         # Vector 2N = 1024 (fp32, both SBUF)
    nisa.activation(dst=y, op=nl.exp, data=y)                      # Scalar N = 512
    wc = nl.ndarray((128, 512), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.tensor_copy(dst=wc, src=wb, engine=nisa.vector_engine)    # Vector N/4 = 128 (bf16, SBUF, contiguous)
    sm = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=sm, data=y[:, 0:8], op0=nl.subtract, operand0=1.0)  # Vector max(64, 8) = 64
    r = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=r, data=y[:, 0:16])                        # Vector max(64, 8 * 16) = 128
    ii = nl.ndarray((128, 32), dtype=nl.int32, buffer=nl.sbuf)
    nisa.iota(dst=ii, pattern=[[1, 32]])                           # GpSimd 150 + 32 = 182
    tp = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.psum)
    nisa.nc_transpose(dst=tp, data=wb[:, 0:128])                   # Tensor max(P=128, min(64, 128)) = 128
    ps = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=wb[:, 0:128], moving=wb)     # Tensor max(min(64, 128), 512) = 512
    nisa.nc_matmul(dst=ps[0:8, 0:32], stationary=wb[:, 0:8], moving=wb[:, 0:32], accumulate=False)
    #                                                               Tensor max(min(64, 8), 32) = 32
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=y)                                  # DMA 256 KiB
    return out


def test_known_instruction_mix_gets_the_documented_cycles():
    a = np.ones((128, 512), np.float32)
    w = np.ones((128, 512), np.float32).astype(nl.bfloat16)
    mix(a, w)
    cost = R.last_cost
    (led,) = cost.ledgers  # grid 1: one program, one NeuronCore
    cycles = {"tensor": 128 + 512 + 32, "vector": 2 * 512 + 512 // 4 + 64 + 8 * 16, "scalar": 512,
              "gpsimd": 150 + 32}
    counts = {"tensor": 3, "vector": 4, "scalar": 1, "gpsimd": 1}
    assert led.cycles == pytest.approx(cycles, rel=1e-9)
    assert led.count == counts
    dma_bytes = 128 * 512 * (4 + 2 + 4)
    assert (led.dma_bytes, led.dma_transfers, led.hbm_bytes) == (dma_bytes, 3, dma_bytes)
    ns = {e: cycles[e] / GHZ[e] for e in GHZ}
    busiest = max(ns.values())  # Vector: 1344 cycles at 0.96 GHz = 1400 ns
    dma_ns = dma_bytes / DMA_GBPS
    assert cost.per_engine_ns() == pytest.approx(ns, rel=1e-9)
    assert cost.engine_ns == pytest.approx(busiest, rel=1e-9)
    assert cost.dma_ns == pytest.approx(dma_ns, rel=1e-9)
    # the overlap rule: the busiest queue (here the DMA: 2784 ns) plus one DMA latency in and one out
    assert cost.call_ns == pytest.approx(2 * DMA_LAT_NS + max(busiest, dma_ns), rel=1e-9)
    assert cost.compute_ns == pytest.approx(2 * DMA_LAT_NS + busiest, rel=1e-9)


@nki.jit
def split(a):
    """Program 0 runs 4 tiles, program 1 one (640 rows): the call takes the slower program."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    for t in range(pid * 4, 4 if pid == 0 else 5):
        x = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=a[t * 128:(t + 1) * 128])
        nisa.activation(dst=x, op=nl.exp, data=x)                  # Scalar N = 256 per tile
        nisa.dma_copy(dst=out[t * 128:(t + 1) * 128], src=x)
    return out


def test_a_call_takes_its_slowest_program():
    split[2](np.zeros((640, 256), np.float32))
    cost = R.last_cost
    assert [g.count["scalar"] for g in cost.ledgers] == [4, 1]
    slow = 4 * 256 / GHZ["scalar"], 4 * 2 * 128 * 256 * 4 / DMA_GBPS
    assert cost.engine_ns == pytest.approx(slow[0], rel=1e-9)
    assert cost.call_ns == pytest.approx(2 * DMA_LAT_NS + max(slow), rel=1e-9)


@nki.jit
def gather(table, idx):
    """Rows idx[p] of table (HBM) into SBUF; -1 rows are skipped (oob_mode skip): empty slots."""
    ix = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=ix, src=idx)
    rows = nl.ndarray((4, 64), dtype=nl.bfloat16, buffer=nl.sbuf)
    nisa.memset(dst=rows, value=0.0, engine=nisa.vector_engine)     # Vector max(64, 64 / 2) = 64
    nisa.dma_copy(dst=rows, src=table.ap(pattern=[[64, 4], [1, 64]], vector_offset=ix, indirect_dim=0),
                  oob_mode=nisa.oob_mode.skip)
    out = nl.ndarray((4, 64), dtype=nl.bfloat16, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=rows)
    return out


def test_empty_indirect_rows_move_no_bytes():
    """An indirect DMA is charged for the rows it moves: a slot whose index is out of range (skip)
    reads nothing -- what a routed-experts kernel's empty capacity slots must cost."""
    table = np.ones((10, 64), np.float32).astype(nl.bfloat16)
    for idx, moved in (([1, 2, 3, 4], 4), ([1, -1, 3, -1], 2), ([-1, -1, -1, -1], 0)):
        gather(table, np.array(idx, np.int32).reshape(4, 1))
        (led,) = R.last_cost.ledgers
        assert led.dma_bytes == 4 * 4 + moved * 64 * 2 + 4 * 64 * 2, idx
        assert led.cycles["vector"] == MIN_II


def test_a_refused_instruction_costs_nothing():
    @nki.jit
    def bad(a):
        x = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=x, src=a)
        p = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(dst=p, data1=p, data2=p, op=nl.add)  # both inputs in PSUM: refused
        return a

    with pytest.raises(nki_sim.SimError):
        bad(np.zeros((128, 512), np.float32))
    (led,) = R.last_cost.ledgers
    assert led.count == {"tensor": 0, "vector": 0, "scalar": 0, "gpsimd": 0} and led.dma_transfers == 1
