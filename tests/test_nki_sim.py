"""Self-tests of the nki_sim CPU simulator: every hardware / toolchain rejection it promises fires, and the
instruction semantics the kernels rely on (matmul, accumulation, indirect DMA, casts, bit ops, iota,
reduce registers, launch grid) compute what the NKI documentation says.

The simulator is used directly (`nki_sim`, not whatever `nki` resolves to), so these tests exercise it even
on a machine that has the Neuron package.
"""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import nki_sim
from nki_sim import SimError
from nki_sim import isa as nisa
from nki_sim import language as nl

jit = nki_sim.jit


def _copy_kernel_out(shape, dtype):
    return nl.ndarray(shape, dtype=dtype, buffer=nl.shared_hbm)


def _run(body, *arrays, grid=1):
    """Launch a kernel whose body is `body(*tensors)` (returning the output tensor)."""
    k = jit(body)
    return k[grid](*arrays)


def _expect(body, match, *arrays):
    with pytest.raises(SimError, match=match):
        _run(body, *arrays)


# ---- rejections ------------------------------------------------------------------------------------------
def test_rejects_partition_dim_above_128():
    def alloc_sbuf():
        nl.ndarray((129, 4), dtype=nl.float32, buffer=nl.sbuf)

    def alloc_psum():
        nl.ndarray((200, 4), dtype=nl.float32, buffer=nl.psum)

    _expect(alloc_sbuf, "partition dim 129")
    _expect(alloc_psum, "partition dim 200")

    def ap_view(a):  # an access pattern may not reach 129 partitions either
        t = nl.ndarray((128, 4), dtype=nl.float32, buffer=nl.sbuf)
        t.ap(pattern=[[4, 129], [1, 4]])

    _expect(ap_view, "out of bounds|partition dim", np.zeros(1, np.float32))


def test_rejects_oversized_matmul_tiles():
    # K > 128 cannot even be expressed: both operands would need more than 128 partitions (see above).
    def mm(m, n, k=128):
        def body():
            st = nl.zeros((k, m), dtype=nl.bfloat16)
            mv = nl.zeros((k, n), dtype=nl.bfloat16)
            ps = nl.ndarray((min(m, 128), n), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=ps, stationary=st, moving=mv)
        return body

    _expect(mm(129, 64), "M=129")
    _expect(mm(64, 513), "N=513")
    _run(mm(128, 512))  # the largest legal tile passes


def test_rejects_bad_matmul_destination_and_operands():
    def dst_bf16():
        st, mv = nl.zeros((8, 4), dtype=nl.bfloat16), nl.zeros((8, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.bfloat16, buffer=nl.psum), stationary=st, moving=mv)

    def dst_sbuf():
        st, mv = nl.zeros((8, 4), dtype=nl.bfloat16), nl.zeros((8, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf), stationary=st, moving=mv)

    def two_free_dims():
        st, mv = nl.zeros((8, 2, 2), dtype=nl.bfloat16), nl.zeros((8, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), stationary=st, moving=mv)

    def e4m3fn_operand():
        st, mv = nl.zeros((8, 4), dtype=nl.float8_e4m3fn), nl.zeros((8, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), stationary=st, moving=mv)

    def f32_with_bf16():
        st, mv = nl.zeros((8, 4), dtype=nl.float32), nl.zeros((8, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), stationary=st, moving=mv)

    def psum_operand():
        st = nl.zeros((8, 4), dtype=nl.float32, buffer=nl.psum)
        mv = nl.zeros((8, 4), dtype=nl.float32)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), stationary=st, moving=mv)

    def different_partitions():
        st, mv = nl.zeros((16, 4), dtype=nl.bfloat16), nl.zeros((16, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), stationary=st[0:8],
                       moving=mv[8:16])

    _expect(dst_bf16, "dst must be float32")
    _expect(dst_sbuf, "dst must be in PSUM")
    _expect(two_free_dims, "exactly one free dim")
    _expect(e4m3fn_operand, "not a trn2")  # (the dtype itself is rejected on trn2, see the dtype policy)
    _expect(f32_with_bf16, "float32 operand requires")
    _expect(psum_operand, "must be in SBUF")
    _expect(different_partitions, "same partitions")


def test_rejects_dma_touching_psum():
    def from_psum(a):
        out = _copy_kernel_out((4, 4), nl.float32)
        p = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=out, src=p)
        return out

    def to_psum(a):
        p = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=p, src=a)

    _expect(from_psum, "DMA cannot access PSUM", np.zeros((4, 4), np.float32))
    _expect(to_psum, "DMA cannot access PSUM", np.zeros((4, 4), np.float32))


def test_rejects_single_partition_indirect_dma():
    def gather(data, idx):
        it = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=it, src=idx)
        t = nl.ndarray((1, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=data.ap(pattern=[[4, 1], [1, 4]], vector_offset=it, indirect_dim=0))

    _expect(gather, "at least 2 partitions", np.zeros((8, 4), np.float32), np.zeros((1, 1), np.int32))


def test_rejects_reads_of_never_written_memory():
    def fresh_read(a):
        out = _copy_kernel_out((4, 4), nl.float32)
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=out, src=t)
        return out

    def partial_read(a):
        out = _copy_kernel_out((4, 4), nl.float32)
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:3], src=a[0:3])  # row 3 never written
        u = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)
        nisa.dma_copy(dst=out, src=u)
        return out

    def output_left_unwritten(a):
        out = _copy_kernel_out((4, 4), nl.float32)
        t = nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out[0:2], src=t[0:2])
        return out

    def accumulate_into_fresh_psum(a):
        st = nl.zeros((4, 4), dtype=nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((4, 4), dtype=nl.float32, buffer=nl.psum), stationary=st, moving=st,
                       accumulate=True)

    a = np.ones((4, 4), np.float32)
    _expect(fresh_read, "never-written", a)
    _expect(partial_read, "never-written", a)
    _expect(output_left_unwritten, "never written", a)
    _expect(accumulate_into_fresh_psum, "never-written PSUM", a)


def test_rejects_raise_in_kernel_body():
    def bad(a):
        if a.shape[0] > 3:
            raise ValueError("no")

    with pytest.raises(SimError, match="raise"):
        jit(bad)


def test_rejects_other_engine_constraints():
    def both_psum():
        a = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.psum)
        b = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(dst=nl.ndarray((4, 4), dtype=nl.float32), data1=a, data2=b, op=nl.add)

    def cross_partition():
        a = nl.zeros((8, 4), dtype=nl.float32)
        nisa.tensor_copy(dst=nl.ndarray((64, 4), dtype=nl.float32)[32:36], src=a[0:4])

    def reduce_partition_axis():
        a = nl.zeros((8, 4), dtype=nl.float32)
        nisa.tensor_reduce(dst=nl.ndarray((1, 4), dtype=nl.float32), op=nl.add, data=a, axis=0)

    def reduce_middle_axis():
        a = nl.zeros((8, 4, 2), dtype=nl.float32)
        nisa.tensor_reduce(dst=nl.ndarray((8, 2), dtype=nl.float32), op=nl.add, data=a, axis=1)

    def pe_transpose_into_sbuf():  # (its 128x128 limit is the partition limit of both sides)
        a = nl.zeros((64, 64), dtype=nl.bfloat16)
        nisa.nc_transpose(dst=nl.ndarray((64, 64), dtype=nl.bfloat16), data=a, engine=nisa.engine.tensor)

    def big_vector_transpose():
        a = nl.zeros((64, 64), dtype=nl.float32)
        nisa.nc_transpose(dst=nl.ndarray((64, 64), dtype=nl.float32, buffer=nl.sbuf), data=a)

    def slice_out_of_range():
        nl.zeros((8, 4), dtype=nl.float32)[0:9]

    def partition_broadcast_view():
        nl.zeros((1, 4), dtype=nl.float32).broadcast(0, 8)

    def mixed_bitvec_and_arith():
        a = nl.zeros((4, 4), dtype=nl.int32)
        nisa.tensor_scalar(dst=a, data=a, op0=nl.bitwise_and, operand0=1, op1=nl.add, operand1=1.0)

    _expect(both_psum, "both be in PSUM")
    _expect(cross_partition, "different partitions")
    _expect(reduce_partition_axis, "trailing free axes")
    _expect(reduce_middle_axis, "trailing free axes")
    _expect(pe_transpose_into_sbuf, "writes PSUM")
    _expect(big_vector_transpose, "32x32")
    _expect(slice_out_of_range, "out of range")
    _expect(partition_broadcast_view, "partition broadcast")
    _expect(mixed_bitvec_and_arith, "must both be bitvec or both arithmetic")


# ---- semantics ---------------------------------------------------------------------------------------------
def test_matmul_is_stationary_transposed_times_moving_with_accumulation():
    rng = np.random.default_rng(0)
    st = rng.integers(-8, 8, (96, 40)).astype(np.float32)  # small integers: every fp32 sum is exact
    mv = rng.integers(-8, 8, (96, 300)).astype(np.float32)

    def body(a, b):
        out = _copy_kernel_out((40, 300), nl.float32)
        ta, tb = nl.ndarray((96, 40), dtype=nl.bfloat16), nl.ndarray((96, 300), dtype=nl.bfloat16)
        nisa.dma_copy(dst=ta, src=a)
        nisa.dma_copy(dst=tb, src=b)
        ps = nl.ndarray((40, 300), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ta[0:64], moving=tb[0:64])  # None: first write overwrites
        nisa.nc_matmul(dst=ps, stationary=ta[64:96], moving=tb[64:96],  # None: later writes add
                       tile_position=(64, 0), tile_size=(32, 128))  # rows from partition 64: a row tile
        nisa.nc_matmul(dst=ps, stationary=ta[0:32], moving=tb[0:32], accumulate=True)
        o = nl.ndarray((40, 300), dtype=nl.float32)
        nisa.tensor_copy(dst=o, src=ps)
        nisa.dma_copy(dst=out, src=o)
        return out

    want = st.T @ mv + st[:32].T @ mv[:32]
    np.testing.assert_array_equal(_run(body, st, mv), want)

    def overwrite(a, b):
        out = _copy_kernel_out((40, 300), nl.float32)
        ta, tb = nl.ndarray((96, 40), dtype=nl.float32), nl.ndarray((96, 300), dtype=nl.float32)
        nisa.dma_copy(dst=ta, src=a)
        nisa.dma_copy(dst=tb, src=b)
        ps = nl.ndarray((40, 300), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=ta[0:64], moving=tb[0:64])
        nisa.nc_matmul(dst=ps, stationary=ta[64:96], moving=tb[64:96], accumulate=False,
                       tile_position=(64, 0), tile_size=(32, 128))
        o = nl.ndarray((40, 300), dtype=nl.float32)
        nisa.tensor_copy(dst=o, src=ps)
        nisa.dma_copy(dst=out, src=o)
        return out

    np.testing.assert_array_equal(_run(overwrite, st, mv), st[64:].T @ mv[64:])


def test_indirect_gather_skip_and_error_modes_and_scatter():
    data = np.arange(40, dtype=np.float32).reshape(10, 4)
    idx = np.array([[3], [-1], [9], [10], [0], [7]], np.int32)

    def gather(mode):
        def body(d, i):
            out = _copy_kernel_out((6, 4), nl.float32)
            it = nl.ndarray((6, 1), dtype=nl.int32)
            nisa.dma_copy(dst=it, src=i)
            t = nl.ndarray((6, 4), dtype=nl.float32)
            nisa.memset(dst=t, value=-5.0)
            nisa.dma_copy(dst=t, src=d.ap(pattern=[[4, 6], [1, 4]], vector_offset=it, indirect_dim=0),
                          oob_mode=mode)
            nisa.dma_copy(dst=out, src=t)
            return out
        return body

    got = _run(gather(nisa.oob_mode.skip), data, idx)
    want = np.stack([data[3], np.full(4, -5.0), data[9], np.full(4, -5.0), data[0], data[7]])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(SimError, match="out of bounds"):
        _run(gather(nisa.oob_mode.error), data, idx)

    def scatter(d, i):
        out = _copy_kernel_out((10, 4), nl.float32)
        t = nl.ndarray((10, 4), dtype=nl.float32)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_copy(dst=out, src=t)
        it = nl.ndarray((2, 1), dtype=nl.int32)
        nisa.dma_copy(dst=it, src=i)
        s = nl.ndarray((2, 4), dtype=nl.float32)
        nisa.dma_copy(dst=s, src=d[0:2])
        nisa.dma_copy(dst=out.ap(pattern=[[4, 2], [1, 4]], vector_offset=it, indirect_dim=0), src=s)
        return out

    got = _run(scatter, data, np.array([[5], [1]], np.int32))
    want = np.zeros((10, 4), np.float32)
    want[5], want[1] = data[0], data[1]
    np.testing.assert_array_equal(got, want)


def test_casts_round_to_nearest_even_and_saturate():
    x = np.array([[2.5, 3.5, -2.5, 1e10, -1e10, np.nan, 0.49999997, 70000.0]], np.float32)

    def body(a):
        out_i = _copy_kernel_out((1, 8), nl.int32)
        out_u = _copy_kernel_out((1, 8), nl.uint8)
        t = nl.ndarray((1, 8), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=a)
        i = nl.ndarray((1, 8), dtype=nl.int32)
        nisa.tensor_copy(dst=i, src=t)
        nisa.dma_copy(dst=out_i, src=i)
        u = nl.ndarray((1, 8), dtype=nl.uint8)
        nisa.tensor_scalar(dst=u, data=t, op0=nl.add, operand0=0.0)
        nisa.dma_copy(dst=out_u, src=u)
        return out_i, out_u

    gi, gu = _run(body, x)
    np.testing.assert_array_equal(gi[0], [2, 4, -2, 2 ** 31 - 1, -2 ** 31, 0, 0, 70000])
    np.testing.assert_array_equal(gu[0], [2, 4, 0, 255, 0, 0, 0, 255])
    # bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> even (1.0); 1 + 3*2^-8 -> 1 + 2^-6
    y = np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8, 449.0, 470.0]], np.float32)

    def to_bf16_and_e4m3(a):
        ob, o8 = _copy_kernel_out((1, 4), nl.bfloat16), _copy_kernel_out((1, 4), nl.float8_e4m3fn)
        t = nl.ndarray((1, 4), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=a)
        b = nl.ndarray((1, 4), dtype=nl.bfloat16)
        nisa.tensor_copy(dst=b, src=t)
        nisa.dma_copy(dst=ob, src=b)
        e = nl.ndarray((1, 4), dtype=nl.float8_e4m3fn)
        nisa.tensor_scalar(dst=e, data=t, op0=nl.minimum, operand0=448.0)
        nisa.dma_copy(dst=o8, src=e)
        return ob, o8

    with nki_sim.use_target("trn3"):  # float8_e4m3fn tiles exist on NeuronCore-v4 only
        gb, g8 = _run(to_bf16_and_e4m3, y)
    np.testing.assert_array_equal(gb[0].astype(np.float32), [1.0, 1 + 2 ** -6, 448.0, 470.0])
    assert g8[0].astype(np.float32)[2:].tolist() == [448.0, 448.0]


def test_bitvec_ops_are_logical_and_int32_arithmetic_goes_through_fp32():
    a = np.array([[-8, 2 ** 30 + 1, 0x12345678, 1]], np.int32)

    def body(x):
        o1, o2, o3 = (_copy_kernel_out((1, 4), nl.int32) for _ in range(3))
        t = nl.ndarray((1, 4), dtype=nl.int32)
        nisa.dma_copy(dst=t, src=x)
        r = nl.ndarray((1, 4), dtype=nl.int32)
        nisa.tensor_scalar(dst=r, data=t, op0=nl.right_shift, operand0=28, op1=nl.bitwise_and, operand1=0xF)
        nisa.dma_copy(dst=o1, src=r)
        s = nl.ndarray((1, 4), dtype=nl.int32)
        nisa.tensor_tensor(dst=s, data1=t, data2=t, op=nl.add)  # arithmetic: fp32, then RNE + saturation
        nisa.dma_copy(dst=o2, src=s)
        f = nl.ndarray((1, 4), dtype=nl.int32)
        nisa.tensor_scalar(dst=f, data=t, op0=nl.add, operand0=0.0)  # arithmetic: through fp32
        nisa.dma_copy(dst=o3, src=f)
        return o1, o2, o3

    r, s, f = _run(body, a)
    np.testing.assert_array_equal(r[0], [0xF, 0x4, 0x1, 0])  # -8 >> 28 is 0xF: no sign extension
    # 2^30+1 -> fp32 2^30, doubled 2^31 saturates; 0x12345678 -> fp32 0x12345680 (ulp 32), doubled
    np.testing.assert_array_equal(s[0], [-16, 2 ** 31 - 1, 0x2468AD00, 2])
    assert f[0, 1] == 2 ** 30 and f[0, 2] != 0x12345678  # fp32 cannot hold these integers


def test_iota_reduce_registers_and_activation():
    def body(a):
        o_iota, o_sum, o_act = (_copy_kernel_out(s, nl.float32) for s in ((4, 6), (4, 1), (4, 3)))
        io = nl.ndarray((4, 6), dtype=nl.float32)
        nisa.iota(dst=io, pattern=[[10, 2], [1, 3]], offset=5, channel_multiplier=100)
        nisa.dma_copy(dst=o_iota, src=io)
        t = nl.ndarray((4, 3), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=a)
        y = nl.ndarray((4, 3), dtype=nl.float32)
        r = nl.ndarray((4, 1), dtype=nl.float32)
        b = nl.ndarray((4, 1), dtype=nl.float32)
        nisa.memset(dst=b, value=1.0)
        nisa.activation(dst=y, op=nl.exp, data=t, scale=2.0, bias=b, reduce_op=nl.add,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=y, op=nl.copy, data=t, reduce_op=nl.add, reduce_res=r,
                        reduce_cmd=nisa.reduce_cmd.reduce)  # adds on top of the previous sums
        nisa.dma_copy(dst=o_sum, src=r)
        nisa.activation(dst=y, op=nl.exp, data=t, scale=2.0, bias=b)
        nisa.dma_copy(dst=o_act, src=y)
        return o_iota, o_sum, o_act

    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    io, s, act = _run(body, x)
    want_iota = 5 + 100 * np.arange(4)[:, None] + (10 * np.arange(2)[:, None] + np.arange(3)).reshape(-1)
    np.testing.assert_array_equal(io, want_iota)
    want_act = np.exp(x * 2 + 1)
    np.testing.assert_allclose(act, want_act, rtol=2e-7)  # fp32 exp (one ulp of slack between libms)
    np.testing.assert_allclose(s[:, 0], want_act.sum(1) + x.sum(1), rtol=1e-6)

    def read_unset_registers(a):
        t = nl.zeros((4, 3), dtype=nl.float32)
        nisa.activation(dst=t, op=nl.copy, data=t, reduce_res=nl.ndarray((4, 1), dtype=nl.float32))

    _expect(read_unset_registers, "never-reset", x)


def test_grid_two_programs_share_outputs_and_split_work():
    a = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)

    def body(x):
        out = nl.ndarray((8, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        pid, g = nl.program_id(0), nl.num_programs(0)
        rows = 8 // g
        t = nl.ndarray((rows, 6), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=x[pid * rows:(pid + 1) * rows])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(pid * 1000))
        nisa.dma_copy(dst=out[pid * rows:(pid + 1) * rows], src=t)
        return out

    got = _run(body, a, grid=2)
    np.testing.assert_array_equal(got[:4], a[:4])
    np.testing.assert_array_equal(got[4:], a[4:] + 1000)  # program 1 did the second half
    with pytest.raises(SimError, match="never written"):  # a grid-1 launch of a half-writing body
        _run(_half, a)


def _half(x):
    out = nl.ndarray((8, 6), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((4, 6), dtype=nl.float32)
    nisa.dma_copy(dst=t, src=x[0:4])
    nisa.dma_copy(dst=out[0:4], src=t)
    return out


def test_torch_tensors_round_trip_bitwise():
    x = torch.randn(5, 7).to(torch.bfloat16)

    def body(a):
        out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(a.shape, dtype=a.dtype)
        nisa.dma_copy(dst=t, src=a)
        nisa.dma_copy(dst=out, src=t)
        return out

    y = _run(body, x)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and torch.equal(y, x)


def test_shim_selects_the_simulator_without_the_neuron_package():
    code = ("import sys, v4flash_backend.kernels._nki as s; import nki, nki_sim;"
            "print(s.IMPL, nki is nki_sim, sys.modules['nki.isa'] is nki_sim.isa)")
    have_real = subprocess.run([sys.executable, "-c", "import nki, sys; sys.exit(0 if hasattr(nki, 'jit') "
                                "and not getattr(nki, 'IS_SIMULATOR', False) else 1)"],
                               capture_output=True).returncode == 0
    env = {"PYTHONPATH": ":".join(sys.path), "V4FLASH_NKI": "sim"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["sim", "True", "True"]
    env["V4FLASH_NKI"] = "real"
    real = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if have_real:
        assert real.returncode == 0 and real.stdout.split()[0] == "real"
    else:
        assert real.returncode != 0 and "V4FLASH_NKI=real" in real.stderr


def test_views_ds_reshape_permute_broadcast_bitcast_and_private_hbm():
    a = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)

    def body(x):
        o_ds, o_perm, o_bc, o_bits = (_copy_kernel_out(s, d) for s, d in (((2, 3), nl.float32), ((4, 2, 3), nl.float32),
                                                                           ((4, 2, 3), nl.float32), ((4, 1), nl.int32)))
        scratch = nl.ndarray((6, 8), dtype=nl.float32, buffer=nl.private_hbm)
        nisa.dma_copy(dst=scratch, src=x)  # HBM -> HBM through a private scratch tensor
        t = nl.ndarray((4, 6), dtype=nl.float32)
        nisa.dma_copy(dst=t, src=scratch[nl.ds(1, 4), nl.ds(2, 6)])
        u = nl.ndarray((4, 3), dtype=nl.float32)
        nisa.tensor_copy(dst=u[0:2], src=t[nl.ds(0, 2), 0:6:2])  # engines stay on their partitions
        nisa.dma_copy(dst=o_ds, src=u[0:2])
        p = nl.ndarray((4, 2, 3), dtype=nl.float32)
        nisa.tensor_copy(dst=p, src=t.reshape((4, 3, 2)).permute((0, 2, 1)))
        nisa.dma_copy(dst=o_perm, src=p)
        b = nl.ndarray((4, 2, 3), dtype=nl.float32)
        nisa.tensor_copy(dst=b, src=t[0:4, 0:3].reshape((4, 1, 3)).broadcast(1, 2))
        nisa.dma_copy(dst=o_bc, src=b)
        i = nl.ndarray((4, 1), dtype=nl.int32)
        nisa.tensor_copy(dst=i, src=t.view(nl.int32)[0:4, 0:1])  # same bits, reinterpreted
        nisa.dma_copy(dst=o_bits, src=i)
        return o_ds, o_perm, o_bc, o_bits

    g_ds, g_perm, g_bc, g_bits = _run(body, a)
    t = a[1:5, 2:8]
    np.testing.assert_array_equal(g_ds, t[0:2, 0:6:2])
    np.testing.assert_array_equal(g_perm, t.reshape(4, 3, 2).transpose(0, 2, 1))
    np.testing.assert_array_equal(g_bc, np.broadcast_to(t[:, None, 0:3], (4, 2, 3)))
    np.testing.assert_array_equal(g_bits[:, 0], t[:, 0].view(np.int32))


def test_scale_formats_convert_exactly_and_reciprocal():
    """ue8m0 bytes are powers of two 2^(e-127); e4m3fn bytes widen exactly to bf16 on a DMA."""
    e8 = np.array([[127, 130, 1, 200]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    f8 = np.array([[0x38, 0xC4, 0x7E, 0x01]], np.uint8).view(ml_dtypes.float8_e4m3fn)  # 1, -3, 448, 2^-9

    def body(s, w):
        o_s, o_w, o_r = _copy_kernel_out((1, 4), nl.float32), _copy_kernel_out((1, 4), nl.bfloat16), \
            _copy_kernel_out((1, 4), nl.float32)
        ts = nl.ndarray((1, 4), dtype=nl.float32)
        nisa.dma_copy(dst=ts, src=s)
        nisa.dma_copy(dst=o_s, src=ts)
        tw = nl.ndarray((1, 4), dtype=nl.bfloat16)
        nisa.dma_copy(dst=tw, src=w)
        nisa.dma_copy(dst=o_w, src=tw)
        r = nl.ndarray((1, 4), dtype=nl.float32)
        nisa.reciprocal(dst=r, data=tw)
        nisa.dma_copy(dst=o_r, src=r)
        return o_s, o_w, o_r

    with nki_sim.use_target("trn3"):  # e8m0 / e4m3fn tensors exist on NeuronCore-v4 only
        gs, gw, gr = _run(body, e8, f8)
    np.testing.assert_array_equal(gs[0], [1.0, 8.0, 2.0 ** -126, 2.0 ** 73])
    np.testing.assert_array_equal(gw[0].astype(np.float32), [1.0, -3.0, 448.0, 2.0 ** -9])
    np.testing.assert_array_equal(gr[0], np.array([1.0, -1 / 3, 1 / 448, 512.0], np.float32))  # fp32 1/x
