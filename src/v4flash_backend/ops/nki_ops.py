"""The `nki-sim` and `nki` backends of `v4flash_backend.ops`: every op family runs the NKI kernel of
`v4flash_backend.kernels`.

Every kernel runs as a PyTorch custom op `torch.ops.v4flash.<kernel>` (`kernel_ops`): one node in a
captured graph, opaque to the host-sync counter.

- `nki-sim`: the kernel executes on CPU under a simulator -- ours (`nki_sim`) when the Neuron `nki`
  package is absent (or V4FLASH_NKI=sim), else the official one (`nki.simulate`). Tensors cross as NumPy
  arrays (bitwise for bf16 / fp8) and come back as CPU torch tensors.
- `nki`: the kernel runs on a NeuronCore through torch-neuronx (imported only on this path): device
  tensors go to the kernel as they are and results stay on the device; an input still on the host is
  copied and counted (`device_copies`), or refused under V4FLASH_NKI_STRICT=1.

Host-side work here is limited to free reshapes (flattening leading dims), dtype promotions the op contract
implies (linear_f32 operands to fp32), reinterpreting fp8 / e8m0 checkpoint tensors as their uint8 bytes
(trn2 has no such dtypes; the kernels decode the bytes) and padding the attention index width to a multiple
of 128 with -1. The launch grid is V4FLASH_NKI_GRID if set, else NEURON_LOGICAL_NC_CONFIG (default 2 on the
device, 1 in the simulator), read when the op runs: the grid must equal the LNC degree; kernels split their
work over the grid's programs.

Numerics: the kernels compute what the hardware computes -- fp32 PSUM / engine arithmetic at the official
reference's rounding points, i.e. the 'reference' numerics of `ops`; `ops.get_numerics()` is not consulted
(there is no fp64 'exact' mode on a NeuronCore). Attention slots outside [0, n) count as empty, like -1.
"""

import torch
import torch.nn.functional as F

from . import kernel_ops
from .kernel_ops import DEVICE, device_args, device_copies  # noqa: F401  (the nki path's API, re-exported)


def _op(name):
    """The custom op `v4flash::<name>`, registered for the active backend's route on first use."""
    kernel_ops.ensure()
    return kernel_ops.op(name)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


# ---- linear layers -------------------------------------------------------------------------------------
def _bytes(t):
    """Checkpoint fp8 / e8m0 tensors cross as their raw bytes (uint8): trn2 has no such tiles (NCC_EVRF051)."""
    return t.contiguous().view(torch.uint8)


def _stacked(fn, x, weight, scale):
    """A stack of experts [E, N, ..] on x [E, T, K]: one kernel call per expert."""
    return torch.stack([fn(x[e], weight[e], scale[e]) for e in range(weight.shape[0])])


def linear_fp8(x, weight, scale, experts=None):
    if experts is not None:  # fp8 experts (no config uses them): the entries gathered here, empty slots zeroed
        y = _stacked(linear_fp8, x, weight[experts.clamp_min(0)], scale[experts.clamp_min(0)])
        return torch.where((experts >= 0).view(-1, *[1] * (y.dim() - 1)), y, 0)
    if weight.dim() == 3:
        return _stacked(linear_fp8, x, weight, scale)
    y = _op("linear_fp8")(_rows(x), _bytes(weight), _bytes(scale))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_fp4(x, weight, scale, experts=None):
    """experts [S] (-1: an empty slot): the routed kernel reads slot s's expert from the whole stack on
    the device (indirect DMA; an empty slot reads nothing and gives zeros)."""
    if experts is not None:
        e = experts.to(torch.int32).reshape(-1, 1)
        return _op("linear_fp4_routed")(x.reshape(e.shape[0], -1, x.shape[-1]), weight, _bytes(scale), e)
    if weight.dim() == 3:
        return _stacked(linear_fp4, x, weight, scale)
    y = _op("linear_fp4")(_rows(x), weight, _bytes(scale))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_bf16(x, weight):
    """A 3-D weight [G, N, K] is a block-diagonal (grouped) projection: x [..., G, K] -> [..., G, N]."""
    xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    if weight.dim() == 3:
        g, n, kk = weight.shape
        y = _op("linear_bf16_grouped")(xb.reshape(-1, g, kk), wb)
        return y.reshape(*x.shape[:-1], n)
    y = _op("linear_bf16")(_rows(xb), wb)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_f32(x, weight):
    y = _op("linear_f32")(_rows(x).float(), weight.float())
    return y.reshape(*x.shape[:-1], weight.shape[0])


# ---- norms and elementwise ---------------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    return _op("rms_norm")(_rows(x), weight, float(eps)).reshape(x.shape)


def swiglu(gate, up, weight, limit):
    g, u = _rows(gate), _rows(up)
    if weight is None:
        y = _op("swiglu")(g, u, float(limit))
    else:
        w = weight.float().reshape(-1, 1)
        y = _op("swiglu_weighted")(g, u, w, float(limit))
    return y.reshape(gate.shape)


def engram_gate(h, key, value, qk_weight, eps):
    hc, d = h.shape[-2:]
    y = _op("engram_gate")(h.reshape(-1, hc, d), key.reshape(-1, hc, d), value.reshape(-1, d), qk_weight.float(),
                            float(eps))
    return y.reshape(h.shape)


# ---- attention ------------------------------------------------------------------------------------------
def sparse_attn(q, kv, sink, idxs, scale):
    width = idxs.shape[-1]
    pad = (-width) % 128 or (128 if width == 0 else 0)
    idx = idxs.to(torch.int32)
    if pad:
        idx = F.pad(idx, (0, pad), value=-1)
    return _op("sparse_attn")(q, kv, sink.float(), idx.contiguous(), float(scale))


def indexer_scores(q, k, w):
    return _op("indexer_scores")(q, k, w)


def softmax_pool(kv, score):
    r, d = kv.shape[-2:]
    y = _op("softmax_pool")(kv.float().reshape(-1, r, d), score.float().reshape(-1, r, d))
    return y.reshape(*kv.shape[:-2], d)


# ---- hyper-connections ---------------------------------------------------------------------------------------
def hc_mixes(x, fn, scale, base, hc, iters, hc_eps, norm_eps):
    lead = x.shape[:-2]
    pre, post, comb = _op("hc_mixes")(x.reshape(-1, x.shape[-2] * x.shape[-1]), fn.float(), scale.float(),
                                      base.float(), int(hc), int(iters), float(hc_eps), float(norm_eps))
    return pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc)


def hc_expand(x, hc):
    return _op("hc_expand")(_rows(x), int(hc)).reshape(*x.shape[:-1], hc, x.shape[-1])


def hc_collapse(x, mix):
    hc, d = x.shape[-2:]
    y = _op("hc_collapse")(x.reshape(-1, hc, d), mix.float().reshape(-1, hc))
    return y.reshape(*x.shape[:-2], d)


def hc_post(f, residual, post, comb):
    hc, d = residual.shape[-2:]
    y = _op("hc_post")(_rows(f), residual.reshape(-1, hc, d), post.float().reshape(-1, hc),
                       comb.float().reshape(-1, hc * hc))
    return y.reshape(residual.shape)
