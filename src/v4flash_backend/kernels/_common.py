"""Small helpers shared by the kernels (plain Python evaluated at trace time; they only emit nki calls)."""

from . import _nki  # noqa: F401  (must precede the nki imports: installs the simulator if needed)
import nki.isa as nisa
import nki.language as nl

P = 128  # partitions (nl.tile_size.pmax)
PSUM_N = 512  # fp32 columns of one PSUM bank = the matmul moving free size limit


def cdiv(a, b):
    return (a + b - 1) // b


def my_share(n):
    """The items 0..n-1 this program handles: round-robin over the launch grid (LNC=2 -> 2 programs)."""
    return range(nl.program_id(0), n, nl.num_programs(0))


def row_tiles(n_rows):
    """(first row, row count) of the 128-row tiles this program handles."""
    return [(t * P, min(P, n_rows - t * P)) for t in my_share(cdiv(n_rows, P))]


def load_bcast(dst, src, nrows, ncols, offset=0):
    """DMA `ncols` contiguous elements of the flattened HBM tensor `src` (from `offset`) into each of the
    first `nrows` partitions of `dst` (a partition broadcast; the source pattern steps 0 per partition)."""
    nisa.dma_copy(dst=dst, src=src.ap(pattern=[[0, nrows], [1, ncols]], offset=offset))


def transpose(dst, src):
    """dst[f, p] = src[p, f] through the Tensor Engine (PSUM) for one tile of at most 128x128. Both sides start
    at partition 0: a Tensor Engine transpose without tile_position reads PE rows 0.. and writes PSUM
    partitions 0.. (nki_sim rule R6)."""
    p, f = src.shape[0], src.shape[1]
    tp = nl.ndarray((P, P), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=tp[0:f, 0:p], data=src)
    nisa.tensor_copy(dst=dst, src=tp[0:f, 0:p])


def div_const(dst, src, n, m):
    """dst = src / n for fp32 rows src[0:m] and a compile-time integer n > 0, correctly rounded (the fp32
    division the reference performs) with multiplies and adds only (the ALU has no divide).

    n = 2^k * o with o odd < 2^11. q0 = src * fl(1/o) is within 2 ulps; its residual e = src - q0 * o is
    computed exactly (Veltkamp split of q0 into two 12-bit halves, whose products with o are exact, and
    Sterbenz-exact subtractions); q = q0 + e * fl(1/o) is then the correctly rounded quotient, because
    src / o is never closer than ulp / 2^12 to a rounding midpoint while the correction is accurate to
    ~2^-22 ulp. The final * 2^-k is exact. Valid for finite src whose quotient is normal."""
    o, k = int(n), 0
    assert o > 0
    while o % 2 == 0:
        o, k = o // 2, k + 1
    f32 = nl.float32
    if o == 1:
        nisa.tensor_scalar(dst=dst, data=src, op0=nl.multiply, operand0=2.0 ** -k)
        return
    assert o < 2 ** 11, "div_const: the odd part of the divisor must stay below 2^11"
    r = 1.0 / o  # an immediate operand: the engine rounds it to fp32, fl(1/o)
    free = src.shape[1:]
    shape = (P,) + tuple(free)

    def tile():
        return nl.ndarray(shape, dtype=f32, buffer=nl.sbuf)[0:m]

    q0, c, t, qh = tile(), tile(), tile(), tile()
    nisa.tensor_scalar(dst=q0, data=src, op0=nl.multiply, operand0=r)
    nisa.tensor_scalar(dst=c, data=q0, op0=nl.multiply, operand0=4097.0)  # Veltkamp: 2^12 + 1
    nisa.tensor_tensor(dst=t, data1=c, data2=q0, op=nl.subtract)
    nisa.tensor_tensor(dst=qh, data1=c, data2=t, op=nl.subtract)  # high 12 bits of q0
    nisa.tensor_tensor(dst=t, data1=q0, data2=qh, op=nl.subtract)  # low bits: q0 = qh + t exactly
    nisa.scalar_tensor_tensor(dst=c, data=qh, op0=nl.multiply, operand0=-float(o), op1=nl.add, operand1=src)
    nisa.scalar_tensor_tensor(dst=c, data=t, op0=nl.multiply, operand0=-float(o), op1=nl.add, operand1=c)
    nisa.scalar_tensor_tensor(dst=c, data=c, op0=nl.multiply, operand0=r, op1=nl.add, operand1=q0)
    nisa.tensor_scalar(dst=dst, data=c, op0=nl.multiply, operand0=2.0 ** -k)


def _split(dst_hi, dst_lo, x, tmp):
    """Veltkamp: x = hi + lo exactly, hi with 12 significant bits, lo with at most 12 (fp32 RNE ops)."""
    nisa.tensor_scalar(dst=tmp, data=x, op0=nl.multiply, operand0=4097.0)
    nisa.tensor_tensor(dst=dst_lo, data1=tmp, data2=x, op=nl.subtract)
    nisa.tensor_tensor(dst=dst_hi, data1=tmp, data2=dst_lo, op=nl.subtract)
    nisa.tensor_tensor(dst=dst_lo, data1=x, data2=dst_hi, op=nl.subtract)


def div_exact(dst, a, d, m, bcast):
    """dst = a / d for fp32 tiles, rounded like the reference's fp32 division, without a divide instruction.

    a: a [m, ...] view; d: the divisor tile ([m, ...] of its own, smaller shape); bcast(view of d's shape) ->
    view broadcast to a's shape. q0 = a * reciprocal(d); the residual e = a - q0 * d is computed exactly
    (Dekker's product q0 * d = p + err from Veltkamp halves, Sterbenz-exact a - p); q = q0 + e * (1 / d).
    The result is the correctly rounded quotient unless a / d lies within ~2^-21 ulp of a rounding midpoint
    (probability ~1e-6 per element with a correctly rounded reciprocal); the error is then one ulp.
    Divisors above 2^114 (an infinite denominator: the sparse attention's empty rows) count as 2^114, where a
    zero numerator still gives 0. Otherwise requires finite values with normal products."""
    f32 = nl.float32
    ash = (P,) + tuple(a.shape[1:])
    dsh = (P,) + tuple(d.shape[1:])

    def at():
        return nl.ndarray(ash, dtype=f32, buffer=nl.sbuf)[0:m]

    def dt():
        return nl.ndarray(dsh, dtype=f32, buffer=nl.sbuf)[0:m]

    r, dh, dl, dtmp, dc = dt(), dt(), dt(), dt(), dt()
    nisa.tensor_scalar(dst=dc, data=d, op0=nl.minimum, operand0=2.0 ** 114)  # keeps the splits finite
    d = dc
    nisa.reciprocal(dst=r, data=d)
    _split(dh, dl, d, dtmp)
    q0, qh, ql, t, p, err = at(), at(), at(), at(), at(), at()
    nisa.tensor_tensor(dst=q0, data1=a, data2=bcast(r), op=nl.multiply)
    _split(qh, ql, q0, t)
    nisa.tensor_tensor(dst=p, data1=q0, data2=bcast(d), op=nl.multiply)  # fl(q0 * d)
    # err = ((qh*dh - p) + qh*dl + ql*dh) + ql*dl: the exact rounding error of p (Dekker)
    nisa.tensor_tensor(dst=err, data1=qh, data2=bcast(dh), op=nl.multiply)
    nisa.tensor_tensor(dst=err, data1=err, data2=p, op=nl.subtract)
    nisa.tensor_tensor(dst=t, data1=qh, data2=bcast(dl), op=nl.multiply)
    nisa.tensor_tensor(dst=err, data1=err, data2=t, op=nl.add)
    nisa.tensor_tensor(dst=t, data1=ql, data2=bcast(dh), op=nl.multiply)
    nisa.tensor_tensor(dst=err, data1=err, data2=t, op=nl.add)
    nisa.tensor_tensor(dst=t, data1=ql, data2=bcast(dl), op=nl.multiply)
    nisa.tensor_tensor(dst=err, data1=err, data2=t, op=nl.add)
    nisa.tensor_tensor(dst=t, data1=a, data2=p, op=nl.subtract)  # exact: p is within 2 ulps of a
    nisa.tensor_tensor(dst=t, data1=t, data2=err, op=nl.subtract)  # e = a - q0 * d, exact
    nisa.tensor_tensor(dst=t, data1=t, data2=bcast(r), op=nl.multiply)
    nisa.tensor_tensor(dst=dst, data1=q0, data2=t, op=nl.add)


def bytes_to_i32(dst_i32, src_u8):
    """uint8 codes -> int32 (engine conversion through fp32: exact for 0..255)."""
    nisa.tensor_copy(dst=dst_i32, src=src_u8)


def e8m0_to_f32(dst_f32, codes_i32):
    """ue8m0 codes (int32 0..254) -> fp32 2^(code - 127) in place of their bits: code << 23 viewed as fp32 (a
    bitvec shift, exact; code 0 would be 2^-127, a subnormal, and decodes to 0 -- checkpoint scales never are)."""
    nisa.tensor_scalar(dst=codes_i32, data=codes_i32, op0=nl.left_shift, operand0=23)
    nisa.tensor_copy(dst=dst_f32, src=codes_i32.view(nl.float32))


def e4m3fn_to_f32(dst_f32, codes_i32, m):
    """OCP e4m3fn bytes (int32 0..255, rows 0:m) -> their exact fp32 values, with bitvec and fp32 ops only.

    magnitude bits (b & 0x7F) << 20 put the 4 exponent / 3 mantissa bits at the top of an fp32 mantissa; OR-ing
    16 into the exponent field (no carry: the field is < 16) makes it the normal fp32 2^(e-111) (1 + m/8), and
    * 2^104 gives 2^(e-7) (1 + m/8), the e4m3fn value for e >= 1. For e = 0 the code is the subnormal m * 2^-9
    = 2 y - 2^-6, i.e. y + (y - 2^-6); both steps are exact. The sign bit multiplies by -1. Codes 0x7F / 0xFF
    (NaN) decode as +-480; the checkpoint's saturating quantizer never writes them."""
    f32, i32 = nl.float32, nl.int32
    shape = (P,) + tuple(codes_i32.shape[1:])
    bits = nl.ndarray(shape, dtype=i32, buffer=nl.sbuf)[0:m]
    nisa.tensor_scalar(dst=bits, data=codes_i32, op0=nl.bitwise_and, operand0=0x7F, op1=nl.left_shift, operand1=20)
    nisa.tensor_scalar(dst=bits, data=bits, op0=nl.bitwise_or, operand0=16 << 23)
    y = nl.ndarray(shape, dtype=f32, buffer=nl.sbuf)[0:m]
    nisa.tensor_scalar(dst=y, data=bits.view(f32), op0=nl.multiply, operand0=2.0 ** 104)
    ex = nl.ndarray(shape, dtype=i32, buffer=nl.sbuf)[0:m]
    nisa.tensor_scalar(dst=ex, data=codes_i32, op0=nl.bitwise_and, operand0=0x78)
    sub = nl.ndarray(shape, dtype=f32, buffer=nl.sbuf)[0:m]
    nisa.tensor_scalar(dst=sub, data=ex, op0=nl.equal, operand0=0.0)  # 1.0 for subnormal codes
    corr = nl.ndarray(shape, dtype=f32, buffer=nl.sbuf)[0:m]
    nisa.tensor_scalar(dst=corr, data=y, op0=nl.subtract, operand0=2.0 ** -6)
    nisa.tensor_tensor(dst=corr, data1=corr, data2=sub, op=nl.multiply)
    nisa.tensor_tensor(dst=y, data1=y, data2=corr, op=nl.add)
    nisa.tensor_scalar(dst=ex, data=codes_i32, op0=nl.right_shift, operand0=7)
    sg = nl.ndarray(shape, dtype=f32, buffer=nl.sbuf)[0:m]
    nisa.tensor_scalar(dst=sg, data=ex, op0=nl.multiply, operand0=-2.0, op1=nl.add, operand1=1.0)
    nisa.tensor_tensor(dst=dst_f32, data1=y, data2=sg, op=nl.multiply)
