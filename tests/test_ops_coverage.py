"""Every op family of the `ops` API has an NKI kernel and an `nki_ops` function with the torch backend's
signature, and the `nki-sim` / `nki` backends dispatch to `nki_ops`."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

from v4flash_backend import kernels, ops
from v4flash_backend.ops import nki_ops, torch_ops

# The op API (the seam's contract), listed here independently of ops.FAMILIES so that a family added to
# one and not the other fails.
API = ("linear_fp8", "linear_fp4", "linear_bf16", "linear_f32", "rms_norm", "sparse_attn", "indexer_scores",
       "softmax_pool", "hc_mixes", "hc_expand", "hc_collapse", "hc_post", "swiglu", "engram_gate")
KERNEL_DIR = Path(kernels.__file__).parent


def test_api_matches_the_ops_families():
    assert set(API) == set(ops.FAMILIES)


@pytest.mark.parametrize("name", sorted(set(API) | set(ops.FAMILIES)))
def test_every_family_has_a_kernel_and_an_nki_op(name):
    assert name in kernels.KERNELS, f"no NKI kernel for ops.{name}"
    impls = kernels.KERNELS[name]
    assert impls and all(callable(k) and hasattr(k, "__getitem__") for k in impls), "kernels must be @nki.jit"
    fn = getattr(nki_ops, name, None)
    assert callable(fn), f"nki_ops.{name} missing"
    assert inspect.signature(fn).parameters.keys() == inspect.signature(getattr(torch_ops, name)).parameters.keys()
    for p_nki, p_torch in zip(inspect.signature(fn).parameters.values(),
                              inspect.signature(getattr(torch_ops, name)).parameters.values()):
        assert p_nki.default == p_torch.default and p_nki.kind == p_torch.kind


def test_no_kernel_is_registered_twice_and_every_kernel_module_is_used():
    seen = [k for ks in kernels.KERNELS.values() for k in ks]
    assert len(seen) == len(set(map(id, seen)))
    for path in KERNEL_DIR.glob("*.py"):
        if path.stem.startswith("_"):
            continue
        module = getattr(kernels, path.stem)
        assert any(any(v is k for k in seen) for v in vars(module).values()), f"{path.name} registers no kernel"


@pytest.mark.parametrize("path", sorted(KERNEL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_kernel_sources_import_only_nki(path):
    """Kernel files are plain NKI sources: no torch / numpy (the device compiles them), imports of nki
    go through the `_nki` shim first."""
    tree = ast.parse(path.read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.append(node.module)
    if path.name == "_nki.py":  # the shim itself chooses between nki and nki_sim
        return
    roots = {m.split(".")[0] for m in imported}
    assert not roots & {"torch", "numpy", "nki_sim"}
    if "nki" in roots:
        first = next(n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
        assert isinstance(first, ast.ImportFrom) and first.level == 1 and [a.name for a in first.names] == ["_nki"]


def test_nki_backends_dispatch_to_nki_ops(monkeypatch):
    for name in ("nki-sim", "nki"):
        ops.set_backend(name)
        assert ops.backend_module() is nki_ops
    ops.set_backend("nki-sim")
    calls = []
    monkeypatch.setattr(nki_ops, "rms_norm", lambda *a: calls.append(a) or "nki")
    assert ops.rms_norm(1, 2, 3) == "nki" and calls == [(1, 2, 3)]


def test_nki_sim_backend_runs_the_kernel_through_ops():
    ops.set_numerics("reference")  # the kernels' fp32 numerics (conftest restores the mode)
    ops.set_backend("nki-sim")
    x = torch.randn(3, 64).to(torch.bfloat16)
    w = torch.full((64,), 2.0, dtype=torch.bfloat16)
    got = ops.rms_norm(x, w, 1e-6)
    ops.set_backend("torch")
    assert torch.equal(got, ops.rms_norm(x, w, 1e-6))


def test_device_backend_without_neuron_packages_fails_clearly():
    try:
        import torch_neuronx  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch-neuronx is installed: the device path is exercised on the device")
    ops.set_backend("nki")
    with pytest.raises(RuntimeError, match="torch-neuronx"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)
