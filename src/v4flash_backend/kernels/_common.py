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


def transpose(dst, src, p0=0):
    """dst[f, p] = src[p, f] through the Tensor Engine (PSUM) for one tile of at most 128x128; `p0` is the
    first partition of dst (the PSUM staging tile uses the same partitions)."""
    p, f = src.shape[0], src.shape[1]
    tp = nl.ndarray((P, P), dtype=src.dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=tp[p0:p0 + f, 0:p], data=src)
    nisa.tensor_copy(dst=dst, src=tp[p0:p0 + f, 0:p])
