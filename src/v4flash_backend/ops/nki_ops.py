"""The `nki-sim` and `nki` backends of `v4flash_backend.ops`: every op family runs the NKI kernel of
`v4flash_backend.kernels`.

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
device, 1 in the simulator): the grid must equal the LNC degree; kernels split their work over the grid's
programs.

Numerics: the kernels compute what the hardware computes -- fp32 PSUM / engine arithmetic at the official
reference's rounding points, i.e. the 'reference' numerics of `ops`; `ops.get_numerics()` is not consulted
(there is no fp64 'exact' mode on a NeuronCore). Attention slots outside [0, n) count as empty, like -1.
"""

import os

import torch
import torch.nn.functional as F

_GRID_ENV = "V4FLASH_NKI_GRID"


def _backend():
    from v4flash_backend import ops

    return ops.get_backend()


def _grid(device):
    if os.environ.get(_GRID_ENV):
        return int(os.environ[_GRID_ENV])
    if device:
        return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"))  # the grid must equal the LNC degree


def _kernels():
    from v4flash_backend import kernels

    return kernels


def _launch(kernel, *tensors, **static):
    """Run `kernel` on the active backend; tensors positional (torch), non-tensor arguments by keyword.
    Returns torch tensors (a tuple when the kernel returns several)."""
    if _backend() == "nki":
        return _launch_device(kernel, tensors, static)
    from nki_sim._torch_bridge import numpy_to_torch, torch_to_numpy
    from v4flash_backend.kernels import _nki

    arrays = [torch_to_numpy(t) for t in tensors]
    if _nki.USING_SIMULATOR:
        res = kernel[_grid(False)](*arrays, **static)
    else:  # the Neuron package's own CPU simulator runs the same kernel source
        import nki

        res = nki.simulate(kernel[_grid(False)])(*arrays, **static)
    if isinstance(res, (tuple, list)):
        return tuple(numpy_to_torch(r) for r in res)
    return numpy_to_torch(res)


DEVICE = "neuron"
# inputs a kernel call had to copy to the device (by op family); a resident serving path keeps it 0
device_copies: dict[str, int] = {}


def device_args(tensors, kernel_name: str = "", device_type: str = DEVICE):
    """The kernel's arguments on the device: a tensor already there is passed as it is (weights and
    caches are placed on the device at load, activations are produced there); any other is copied,
    counted in `device_copies`, and refused when V4FLASH_NKI_STRICT=1 (the served path sets it: a
    weight or cache left on the host would be copied on every call, the pattern this backend avoids)."""
    out = []
    for t in tensors:
        if t.device.type == device_type:
            out.append(t)
            continue
        if os.environ.get("V4FLASH_NKI_STRICT") == "1":
            raise RuntimeError(f"{kernel_name}: a {tuple(t.shape)} {t.dtype} input on {t.device}, not on the "
                               f"{device_type} device (place weights and caches at load)")
        device_copies[kernel_name] = device_copies.get(kernel_name, 0) + 1
        out.append(t.to(device_type))
    return out


def _launch_device(kernel, tensors, static):
    try:
        import torch_neuronx  # noqa: F401  (registers the neuron device and nki.jit's torch path)
    except ImportError as e:
        raise RuntimeError("the 'nki' ops backend runs on Trainium and needs torch-neuronx and nki "
                           "(requirements-neuron.txt); use 'nki-sim' on CPU") from e

    name = getattr(kernel, "__name__", str(kernel))
    dev = device_args(tensors, name)
    res = kernel[_grid(True)](*[t.contiguous() for t in dev], **static)
    return tuple(res) if isinstance(res, (tuple, list)) else res  # results stay on the device


def _rows(x):
    return x.reshape(-1, x.shape[-1])


# ---- linear layers -------------------------------------------------------------------------------------
def _bytes(t):
    """Checkpoint fp8 / e8m0 tensors cross as their raw bytes (uint8): trn2 has no such tiles (NCC_EVRF051)."""
    return t.contiguous().view(torch.uint8)


def linear_fp8(x, weight, scale):
    k = _kernels()
    y = _launch(k.linear.linear_fp8_kernel, _rows(x), _bytes(weight), _bytes(scale))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_fp4(x, weight, scale):
    k = _kernels()
    y = _launch(k.linear.linear_fp4_kernel, _rows(x), weight, _bytes(scale))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_bf16(x, weight):
    """A 3-D weight [G, N, K] is a block-diagonal (grouped) projection: x [..., G, K] -> [..., G, N]."""
    k = _kernels()
    xb, wb = x.to(torch.bfloat16), weight.to(torch.bfloat16)
    if weight.dim() == 3:
        g, n, kk = weight.shape
        y = _launch(k.linear.linear_bf16_grouped_kernel, xb.reshape(-1, g, kk), wb)
        return y.reshape(*x.shape[:-1], n)
    y = _launch(k.linear.linear_bf16_kernel, _rows(xb), wb)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_f32(x, weight):
    k = _kernels()
    y = _launch(k.linear.linear_f32_kernel, _rows(x).float(), weight.float())
    return y.reshape(*x.shape[:-1], weight.shape[0])


# ---- norms and elementwise ---------------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    k = _kernels()
    return _launch(k.rms_norm.rms_norm_kernel, _rows(x), weight, eps=float(eps)).reshape(x.shape)


def swiglu(gate, up, weight, limit):
    k = _kernels()
    g, u = _rows(gate), _rows(up)
    if weight is None:
        y = _launch(k.swiglu.swiglu_kernel, g, u, limit=float(limit))
    else:
        w = weight.float().reshape(-1, 1)
        y = _launch(k.swiglu.swiglu_weighted_kernel, g, u, w, limit=float(limit))
    return y.reshape(gate.shape)


def engram_gate(h, key, value, qk_weight, eps):
    k = _kernels()
    hc, d = h.shape[-2:]
    y = _launch(k.engram.engram_gate_kernel, h.reshape(-1, hc, d), key.reshape(-1, hc, d), value.reshape(-1, d),
                qk_weight.float(), eps=float(eps))
    return y.reshape(h.shape)


# ---- attention ------------------------------------------------------------------------------------------
def sparse_attn(q, kv, sink, idxs, scale):
    k = _kernels()
    width = idxs.shape[-1]
    pad = (-width) % 128 or (128 if width == 0 else 0)
    idx = idxs.to(torch.int32)
    if pad:
        idx = F.pad(idx, (0, pad), value=-1)
    return _launch(k.sparse_attn.sparse_attn_kernel, q, kv, sink.float(), idx.contiguous(), scale=float(scale))


def indexer_scores(q, k, w):
    kern = _kernels()
    return _launch(kern.indexer.indexer_scores_kernel, q, k, w)


def softmax_pool(kv, score):
    k = _kernels()
    r, d = kv.shape[-2:]
    y = _launch(k.softmax_pool.softmax_pool_kernel, kv.float().reshape(-1, r, d), score.float().reshape(-1, r, d))
    return y.reshape(*kv.shape[:-2], d)


# ---- hyper-connections ---------------------------------------------------------------------------------------
def hc_mixes(x, fn, scale, base, hc, iters, hc_eps, norm_eps):
    k = _kernels()
    lead = x.shape[:-2]
    pre, post, comb = _launch(k.hc.hc_mixes_kernel, x.reshape(-1, x.shape[-2] * x.shape[-1]), fn.float(),
                              scale.float(), base.float(), hc=int(hc), iters=int(iters), hc_eps=float(hc_eps),
                              norm_eps=float(norm_eps))
    return pre.reshape(*lead, hc), post.reshape(*lead, hc), comb.reshape(*lead, hc, hc)


def hc_expand(x, hc):
    k = _kernels()
    return _launch(k.hc.hc_expand_kernel, _rows(x), hc=int(hc)).reshape(*x.shape[:-1], hc, x.shape[-1])


def hc_collapse(x, mix):
    k = _kernels()
    hc, d = x.shape[-2:]
    y = _launch(k.hc.hc_collapse_kernel, x.reshape(-1, hc, d), mix.float().reshape(-1, hc))
    return y.reshape(*x.shape[:-2], d)


def hc_post(f, residual, post, comb):
    k = _kernels()
    hc, d = residual.shape[-2:]
    y = _launch(k.hc.hc_post_kernel, _rows(f), residual.reshape(-1, hc, d), post.float().reshape(-1, hc),
                comb.float().reshape(-1, hc * hc))
    return y.reshape(residual.shape)
