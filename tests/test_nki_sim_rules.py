"""Self-tests of the documented trn2 rules the simulator enforces (nki_sim/_rules.py, R1-R11, each citing its
documentation line): for every rule a kernel that breaks it fails, and the compliant variant passes. Plus the
device-like mode and the exact number-format / division helpers the kernels use to live within the rules.

The simulator is used directly (`nki_sim`), as in test_nki_sim.py.
"""

import ml_dtypes
import numpy as np
import pytest
import torch

import nki_sim
from nki_sim import SimError
from nki_sim import isa as nisa
from nki_sim import language as nl

jit = nki_sim.jit


def _run(body, *arrays, grid=1):
    return jit(body)[grid](*arrays)


def _expect(body, match, *arrays, grid=1):
    with pytest.raises(SimError, match=match):
        _run(body, *arrays, grid=grid)


def _out(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.shared_hbm)


# ---- R1 dtype policy per target ------------------------------------------------------------------------------
def test_r1_no_e4m3fn_or_e8m0_tensors_on_trn2():
    f8 = np.zeros((4, 4), ml_dtypes.float8_e4m3fn)
    e8 = np.zeros((4, 4), ml_dtypes.float8_e8m0fnu)

    def take(a):
        t = nl.ndarray((4, 4), dtype=nl.bfloat16)
        nisa.dma_copy(dst=t, src=a)
        o = _out((4, 4), nl.bfloat16)
        nisa.dma_copy(dst=o, src=t)
        return o

    def alloc():
        nl.ndarray((4, 4), dtype=nl.float8_e4m3fn)

    def view(a):
        t = nl.ndarray((4, 4), dtype=nl.uint8)
        nisa.dma_copy(dst=t, src=a)
        t.view(nl.float8_e8m0fnu)

    with nki_sim.use_target("trn2"):
        _expect(take, "not a trn2", f8)
        _expect(take, "not a trn2", e8)
        _expect(alloc, "not a trn2")
        _expect(view, "not a trn2", np.zeros((4, 4), np.uint8))
        _run(take, np.zeros((4, 4), np.float32))  # a bf16 / fp32 path is fine
    with nki_sim.use_target("trn3"):  # NeuronCore-v4 has them
        got = _run(take, np.array([[0x38] * 4] * 4, np.uint8).view(ml_dtypes.float8_e4m3fn))
        assert (got.astype(np.float32) == 1.0).all()
        _run(alloc)


# ---- R2 no divide ------------------------------------------------------------------------------------------------
def test_r2_divide_is_not_an_alu_operator():
    def tt():
        a = nl.ones((4, 4), dtype=nl.float32)
        nisa.tensor_tensor(dst=nl.ndarray((4, 4), dtype=nl.float32), data1=a, data2=a, op=nl.divide)

    def ts():
        a = nl.ones((4, 4), dtype=nl.float32)
        nisa.tensor_scalar(dst=nl.ndarray((4, 4), dtype=nl.float32), data=a, op0=nl.divide, operand0=3.0)

    def stt():
        a = nl.ones((4, 4), dtype=nl.float32)
        nisa.scalar_tensor_tensor(dst=nl.ndarray((4, 4), dtype=nl.float32), data=a, op0=nl.multiply, operand0=2.0,
                                  op1=nl.divide, operand1=a)

    for body in (tt, ts, stt):
        _expect(body, "divide is not a hardware ALU operator")

    def recip():  # the documented workaround passes
        a = nl.full((4, 4), 4.0, dtype=nl.float32)
        r = nl.ndarray((4, 4), dtype=nl.float32)
        nisa.reciprocal(dst=r, data=a)
        o = _out((4, 4))
        nisa.dma_copy(dst=o, src=r)
        return o

    assert (_run(recip) == 0.25).all()


# ---- R3 arithmetic ALU operators compute in fp32 -----------------------------------------------------------------
def test_r3_integer_arithmetic_goes_through_fp32_bitvec_stays_exact():
    a = np.array([[2 ** 24 + 1, 7]], np.int32)

    def body(x):
        t = nl.ndarray((1, 2), dtype=nl.int32)
        nisa.dma_copy(dst=t, src=x)
        s = nl.ndarray((1, 2), dtype=nl.int32)
        nisa.tensor_scalar(dst=s, data=t, op0=nl.add, operand0=0.0)
        b = nl.ndarray((1, 2), dtype=nl.int32)
        nisa.tensor_scalar(dst=b, data=t, op0=nl.bitwise_or, operand0=0)
        o1, o2 = _out((1, 2), nl.int32), _out((1, 2), nl.int32)
        nisa.dma_copy(dst=o1, src=s)
        nisa.dma_copy(dst=o2, src=b)
        return o1, o2

    s, b = _run(body, a)
    assert s[0, 0] == 2 ** 24 and s[0, 1] == 7  # 2^24 + 1 is not an fp32 value
    assert b[0, 0] == 2 ** 24 + 1


# ---- R4 indirect DMA stride ------------------------------------------------------------------------------------------
def _gather(base_reshape):
    def body(kv, idx):
        b, n, d = kv.shape
        it = nl.ndarray((4, 1), dtype=nl.int32)
        nisa.dma_copy(dst=it, src=idx)
        base = kv.reshape((b * n, d)) if base_reshape else kv
        t = nl.ndarray((4, d), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=base.ap(pattern=[[d, 4], [1, d]], vector_offset=it, indirect_dim=0))
        o = _out((4, d))
        nisa.dma_copy(dst=o, src=t)
        return o
    return body


def test_r4_indirect_dma_steps_by_the_base_tensor_not_the_pattern():
    kv = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    idx = np.array([[0], [4], [5], [9]], np.int32)  # global rows b*N + n
    # a [B, N, D] base: the device would step an index by N*D = 15 and ignore the pattern's 3
    _expect(_gather(False), "ignored by the device", kv, idx)
    got = _run(_gather(True), kv, idx)  # reshaped to [B*N, D]: one index = one row
    np.testing.assert_array_equal(got, kv.reshape(10, 3)[idx[:, 0]])


# ---- R5 start partition -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("start,size,ok", [(0, 128, True), (64, 64, True), (32, 64, False), (32, 32, True),
                                           (96, 32, True), (16, 16, False), (4, 4, False), (0, 96, True),
                                           (32, 96, False), (32, 33, False), (64, 33, True)])
def test_r5_start_partition_rule(start, size, ok):
    def body():
        a = nl.zeros((128, 4), dtype=nl.float32)
        b = nl.ndarray((128, 4), dtype=nl.float32)
        nisa.tensor_scalar(dst=b[start:start + size], data=a[start:start + size], op0=nl.add, operand0=1.0)

    if ok:
        _run(body)
    else:
        _expect(body, "start_partition rule")


def test_r5_dma_may_start_anywhere():
    def body(a):
        t = nl.ndarray((8, 4), dtype=nl.float32)
        nisa.dma_copy(dst=t[3:5], src=a[0:2])  # DMA engines are not compute engines
        nisa.dma_copy(dst=t[0:3], src=a[0:3])
        nisa.dma_copy(dst=t[5:8], src=a[0:3])
        o = _out((2, 4))
        nisa.dma_copy(dst=o, src=t[3:5])
        return o

    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_array_equal(_run(body, a), a[0:2])


# ---- R6 Tensor Engine placement ----------------------------------------------------------------------------------
def _mm(k0, d0, tile_position=(), tile_size=(), m=32):
    def body():
        st = nl.zeros((128, m), dtype=nl.bfloat16)
        mv = nl.zeros((128, 16), dtype=nl.bfloat16)
        ps = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps[d0:d0 + m], stationary=st[k0:k0 + 32], moving=mv[k0:k0 + 32], accumulate=False,
                       tile_position=tile_position, tile_size=tile_size)
    return body


def test_r6_matmul_placement_needs_tile_position():
    _run(_mm(0, 0))
    _expect(_mm(32, 0), "without tile_position")
    _run(_mm(32, 0, (32, 0), (32, 128)))  # a 32-row tile at PE row 32
    _expect(_mm(32, 0, (64, 0), (32, 128)), "tile at PE row 64")
    _expect(_mm(0, 64), "PSUM destination starts at partition 64")
    _run(_mm(0, 64, (0, 64), (32, 64)))  # a column tile writes PSUM partitions 64..
    _expect(_mm(0, 64, (0, 64), ()), "both be set")
    _expect(_mm(0, 64, (0, 64), (32, 32), m=64), "does not fit")
    _expect(_mm(0, 48, (0, 48), (32, 32), m=16), "multiple of tile_size")


def test_r6_transpose_into_psum_partition_64():
    def plain():
        a = nl.zeros((32, 64), dtype=nl.bfloat16)
        tp = nl.ndarray((128, 32), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=tp[64:128], data=a)

    def tiled():
        a = nl.zeros((32, 64), dtype=nl.bfloat16)
        tp = nl.ndarray((128, 32), dtype=nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=tp[64:128], stationary=a, moving=a, is_transpose=True, tile_position=(0, 64),
                       tile_size=(32, 64))

    _expect(plain, "PSUM destination starts at partition 64")
    _run(tiled)


# ---- R7 PSUM banks, R8 live footprint ------------------------------------------------------------------------------
def test_r7_matmul_result_stays_in_one_psum_bank():
    def body(n0):
        def k():
            st = nl.zeros((128, 8), dtype=nl.bfloat16)
            mv = nl.zeros((128, 512), dtype=nl.bfloat16)
            ps = nl.ndarray((8, 1024), dtype=nl.float32, buffer=nl.psum)  # two banks
            nisa.nc_matmul(dst=ps[:, n0:n0 + 512], stationary=st, moving=mv, accumulate=False)
        return k

    _run(body(0))
    _run(body(512))
    _expect(body(256), "crossing a 2048-byte bank")


def test_r8_live_sbuf_and_psum_footprint():
    def too_much_sbuf():
        a = nl.ndarray((128, 100 * 256), dtype=nl.float32)  # 100 KiB per partition
        b = nl.ndarray((128, 100 * 256), dtype=nl.float32)  # 200 KiB live > 192 KiB usable
        assert a is not b

    def reuse_sbuf():
        for _ in range(4):  # each tile dies before the next is allocated
            a = nl.ndarray((128, 100 * 256), dtype=nl.float32)
            del a

    def nine_banks():
        keep = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(9)]
        assert len(keep) == 9

    _expect(too_much_sbuf, "SBUF overflow")
    _run(reuse_sbuf)
    _expect(nine_banks, "PSUM overflow")

    def eight_small():  # one bank each, whatever the size; all live until the body returns
        keep = [nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.psum) for _ in range(8)]
        assert len(keep) == 8

    _run(eight_small)


# ---- R9 grid = LNC degree --------------------------------------------------------------------------------------------
def test_r9_grid_is_the_lnc_degree(monkeypatch):
    def body():
        pass

    with pytest.raises(SimError, match="1 or 2 logical cores"):
        jit(body)[4]
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(SimError, match="does not match NEURON_LOGICAL_NC_CONFIG"):
        jit(body)[1]()
    jit(body)[2]()


# ---- R10 accumulate --------------------------------------------------------------------------------------------------
def test_r10_no_matmul_accumulation_onto_memset_psum():
    def body(acc, init):
        def k():
            st = nl.ones((8, 4), dtype=nl.bfloat16)
            ps = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
            if init == "memset":
                nisa.memset(dst=ps, value=0.0)
            else:
                nisa.nc_matmul(dst=ps, stationary=st, moving=st, accumulate=False)
            nisa.nc_matmul(dst=ps, stationary=st, moving=st, accumulate=acc)
            o = nl.ndarray((4, 4), dtype=nl.float32)
            nisa.tensor_copy(dst=o, src=ps)
            out = _out((4, 4))
            nisa.dma_copy(dst=out, src=o)
            return out
        return k

    _expect(body(True, "memset"), "undefined behavior")
    _expect(body(None, "memset"), "undefined behavior")
    assert (_run(body(True, "matmul")) == 16.0).all()
    assert (_run(body(None, "matmul")) == 16.0).all()
    assert (_run(body(False, "memset")) == 8.0).all()  # overwriting is fine


# ---- R11 shared_hbm races between the programs of a grid -----------------------------------------------------------
def test_r11_race_detector():
    a = np.arange(16, dtype=np.float32).reshape(4, 4)

    def both_write_everything(x):
        out = _out((4, 4))
        t = nl.ndarray((4, 4), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out

    def halves(x):
        out = _out((4, 4))
        pid = nl.program_id(0)
        t = nl.ndarray((2, 4), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=x[2 * pid:2 * pid + 2])
        nisa.dma_copy(dst=out[2 * pid:2 * pid + 2], src=t)
        return out

    def reads_the_other_half(x):
        out = _out((4, 4))
        pid = nl.program_id(0)
        t = nl.ndarray((2, 4), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=x[2 * pid:2 * pid + 2])
        nisa.dma_copy(dst=out[2 * pid:2 * pid + 2], src=t)
        if pid == 1:  # reads rows core 0 writes (concurrently, on the device)
            u = nl.ndarray((2, 4), dtype=nl.float32)
            nisa.dma_copy(dst=u, src=out[0:2])
        return out

    _expect(both_write_everything, "race on shared_hbm", a, grid=2)
    np.testing.assert_array_equal(_run(halves, a, grid=2), a)
    _expect(reads_the_other_half, "race on shared_hbm", a, grid=2)
    np.testing.assert_array_equal(_run(both_write_everything, a, grid=1), a)  # one program: no race


# ---- device-like mode ------------------------------------------------------------------------------------------------
def _exp_and_mm(x, w):
    o1, o2 = _out((64, 64)), _out((64, 64))
    t = nl.ndarray((64, 64), dtype=nl.float32)
    nisa.dma_copy(dst=t, src=x)
    e = nl.ndarray((64, 64), dtype=nl.float32)
    nisa.activation(dst=e, op=nl.exp, data=t)
    nisa.dma_copy(dst=o1, src=e)
    tw = nl.ndarray((128, 64), dtype=nl.float32)
    nisa.dma_copy(dst=tw, src=w)
    ps = nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=tw, moving=tw, accumulate=False)
    m = nl.ndarray((64, 64), dtype=nl.float32)
    nisa.tensor_copy(dst=m, src=ps)
    nisa.dma_copy(dst=o2, src=m)
    return o1, o2


def test_device_like_mode_perturbs_within_the_stated_bounds():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    e0, m0 = _run(_exp_and_mm, x, w)
    with nki_sim.device_like(seed=1, act_ulps=4):
        e1, m1 = _run(_exp_and_mm, x, w)
    with nki_sim.device_like(seed=1, act_ulps=4):
        e2, m2 = _run(_exp_and_mm, x, w)
    np.testing.assert_array_equal(e1, e2)  # seeded: reproducible
    np.testing.assert_array_equal(m1, m2)
    e3, m3 = _run(_exp_and_mm, x, w)
    np.testing.assert_array_equal(e3, e0)  # off again outside the context
    rel = np.abs(e1.astype(np.float64) - e0) / e0
    assert (rel <= 4 * 2.0 ** -23 + 2.0 ** -24).all() and (e1 != e0).mean() > 0.5
    exact = w.astype(np.float64).T @ w.astype(np.float64)
    bound = 128 * 2.0 ** -23 * (np.abs(w).astype(np.float64).T @ np.abs(w)) + 1e-30  # fp32 sum, any order
    assert (np.abs(m1 - exact) <= bound).all() and (m1 != m0).mean() > 0.1


# ---- the kernels' helpers that live within the rules -----------------------------------------------------------------
def test_exact_division_helpers_match_ieee_division():
    from v4flash_backend.kernels import _common as C

    def body(a, d):
        m, f = a.shape
        ta = nl.ndarray((128, f), dtype=nl.float32)
        nisa.dma_copy(dst=ta[0:m], src=a)
        td = nl.ndarray((128, 1), dtype=nl.float32)
        nisa.dma_copy(dst=td[0:m], src=d)
        o1, o2, o3 = nl.ndarray((128, f), dtype=nl.float32), nl.ndarray((128, f), dtype=nl.float32), \
            nl.ndarray((128, f), dtype=nl.float32)
        C.div_exact(o1[0:m], ta[0:m], td[0:m], m, lambda t: t.broadcast(1, f))
        C.div_const(o2[0:m], ta[0:m], 640, m)
        C.div_const(o3[0:m], ta[0:m], 1280 * 3, m)
        outs = [_out((m, f)) for _ in range(3)]
        for o, t in zip(outs, (o1, o2, o3)):
            nisa.dma_copy(dst=o, src=t[0:m])
        return tuple(outs)

    rng = np.random.default_rng(3)
    for scale in (1e-3, 1.0, 1e4):
        a = (rng.random((128, 256)) * scale).astype(np.float32)
        d = (rng.random((128, 1)) * scale + 1e-3).astype(np.float32)
        g1, g2, g3 = _run(body, a, d)
        np.testing.assert_array_equal(g1, a / d)
        np.testing.assert_array_equal(g2, a / np.float32(640))
        np.testing.assert_array_equal(g3, a / np.float32(3840))
    a = np.zeros((4, 8), np.float32)
    g1, _, _ = _run(body, a, np.full((4, 1), np.inf, np.float32))  # the empty attention row: 0 / inf = 0
    assert (g1 == 0).all()


def test_fp8_byte_decoders_are_exact_for_every_code():
    from v4flash_backend.kernels import _common as C

    def body(b8, s8):
        f = b8.shape[1]
        outs = []
        for src, dec in ((b8, "e4m3fn"), (s8, "e8m0")):
            t = nl.ndarray((1, f), dtype=nl.uint8)
            nisa.dma_copy(dst=t, src=src)
            i = nl.ndarray((1, f), dtype=nl.int32)
            C.bytes_to_i32(i, t)
            v = nl.ndarray((1, f), dtype=nl.float32)
            if dec == "e4m3fn":
                C.e4m3fn_to_f32(v, i, 1)
            else:
                C.e8m0_to_f32(v, i)
            o = _out((1, f))
            nisa.dma_copy(dst=o, src=v)
            outs.append(o)
        return tuple(outs)

    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F][None]  # every code but the two NaNs
    e8 = np.resize(np.arange(1, 255, dtype=np.uint8), codes.shape)
    g8, gs = _run(body, codes, e8)
    np.testing.assert_array_equal(g8, codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(gs, e8.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_activation_fake_quant_reproduces_e4m3fn_grid_and_448_saturation():
    from v4flash_backend.formats import quant
    from v4flash_backend.kernels import linear

    def body(x):
        m, k = x.shape
        t = nl.ndarray((128, k), dtype=nl.bfloat16)
        nisa.dma_copy(dst=t[0:m], src=x)
        q = linear.act_qdq(t, m, k)
        o = _out((m, k), nl.bfloat16)
        nisa.dma_copy(dst=o, src=q[0:m])
        return o

    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 256, generator=g) * torch.logspace(-6, 4, 96).unsqueeze(1)
    x[0, :32] = 0  # all-zero group: the 1e-4 amax floor
    x[1, :32] = torch.tensor([448.0, 447.0, 449.0, 464.0, 480.0, -500.0] + [1.0] * 26)  # saturation, ties
    x[2, :32] = torch.tensor([2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -10, 2.0 ** -11] + [2.0 ** -6] * 28)  # subnormals
    x[3, :32] = torch.tensor([1.0625, 1.1875, 1.3125, -1.0625, 17.0, 19.0] + [1.0] * 26)  # RNE ties (even)
    xb = x.to(torch.bfloat16)
    got = _run(body, xb.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    want = quant.fp8_act_qdq(xb)
    assert torch.equal(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16), want)


def test_kernels_fit_the_live_sbuf_and_psum_at_release_shapes():
    """R8 at the released model's sizes (dim 5120, hc 4, 64 heads x 512, 32 index heads x 128, expert dim
    2304, DSpark main_proj K = 15360): every kernel's live SBUF stays within the 192 KiB per partition (the simulator
    raises otherwise) -- the tiny test models would never reach the limit. Peaks are recorded per program
    (nki_sim._runtime)."""
    import nki_sim._runtime as R
    from nki_sim import _rules as RU
    from v4flash_backend import ops
    from v4flash_backend.formats import quant
    from v4flash_backend.ops import nki_ops

    ops.set_numerics("reference")
    g = torch.Generator().manual_seed(0)

    def rn(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=g).to(dt)

    x = rn(300, 5120)
    w8, s8 = quant.quantize_fp8_weight(rn(256, 5120, dt=torch.float32) / 70)
    # DSpark main_proj's K = 15360 at the 512-row block (a prefill chunk): K tiles + a 256-row x^T block
    x15 = rn(512, 15360)
    w15, s15 = quant.quantize_fp8_weight(rn(128, 15360, dt=torch.float32) / 120)
    w4, s4 = quant.quantize_fp4_weight(rn(256, 5120, dt=torch.float32) / 70)
    h = rn(8, 4, 5120)
    runs = {
        "linear_fp8": lambda: nki_ops.linear_fp8(x, w8, s8),
        "linear_fp8_k15360": lambda: nki_ops.linear_fp8(x15, w15, s15),
        "linear_fp4": lambda: nki_ops.linear_fp4(x, w4, s4),
        "linear_f32": lambda: nki_ops.linear_f32(x[:8].float(), rn(64, 5120, dt=torch.float32)),
        "hc_mixes": lambda: nki_ops.hc_mixes(h, rn(24, 20480, dt=torch.float32) / 140, torch.rand(3, generator=g),
                                             rn(24, dt=torch.float32), 4, 20, 1e-6, 1e-20),
        "hc_post": lambda: nki_ops.hc_post(x[:8], h, torch.rand(8, 4, generator=g), torch.rand(8, 16, generator=g)),
        "rms_norm": lambda: nki_ops.rms_norm(x, rn(5120), 1e-20),
        "swiglu": lambda: nki_ops.swiglu(rn(8, 2304), rn(8, 2304), None, 10.0),
        "sparse_attn": lambda: nki_ops.sparse_attn(rn(1, 2, 64, 512), rn(1, 300, 512), rn(64, dt=torch.float32),
                                                   torch.randint(0, 300, (1, 2, 256), generator=g).int(), 512 ** -0.5),
        "indexer_scores": lambda: nki_ops.indexer_scores(rn(1, 4, 32, 128), rn(1, 600, 128), rn(1, 4, 32)),
    }
    for name, run in runs.items():
        run()
        sbuf, banks = max(R.last_peaks)
        assert 0 < sbuf <= RU.SBUF_USABLE and banks <= RU.PSUM_BANKS, (name, sbuf, banks)
