"""NKI kernels (nki >= 0.6: @nki.jit, outputs in shared_hbm, dst= keyword ISA calls), one module per op
family. Importing this package selects the NKI implementation (see `_nki`): the Neuron `nki` package when
present, else the `nki_sim` CPU simulator installed under the same module names.

`KERNELS` maps every function of the `ops` API to the kernel(s) implementing it.
"""

from . import _nki  # noqa: F401  (first: installs the simulator when needed)
from . import engram, hc, indexer, linear, rms_norm, softmax_pool, sparse_attn, swiglu

KERNELS = {
    "linear_fp8": (linear.linear_fp8_kernel,),
    "linear_fp4": (linear.linear_fp4_kernel, linear.linear_fp4_routed_kernel),
    "linear_bf16": (linear.linear_bf16_kernel, linear.linear_bf16_grouped_kernel),
    "linear_f32": (linear.linear_f32_kernel,),
    "rms_norm": (rms_norm.rms_norm_kernel,),
    "sparse_attn": (sparse_attn.sparse_attn_kernel,),
    "indexer_scores": (indexer.indexer_scores_kernel,),
    "softmax_pool": (softmax_pool.softmax_pool_kernel,),
    "hc_mixes": (hc.hc_mixes_kernel,),
    "hc_expand": (hc.hc_expand_kernel,),
    "hc_collapse": (hc.hc_collapse_kernel,),
    "hc_post": (hc.hc_post_kernel,),
    "swiglu": (swiglu.swiglu_kernel, swiglu.swiglu_weighted_kernel),
    "engram_gate": (engram.engram_gate_kernel,),
}

__all__ = ["KERNELS", "engram", "hc", "indexer", "linear", "rms_norm", "softmax_pool", "sparse_attn", "swiglu"]
