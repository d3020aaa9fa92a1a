"""Random small V4.1 models and a per-layer, teacher-forced comparison of the nki-sim ops backend with the
torch ops backend ('reference' numerics), used by the issue-12 property test and reproduction.

- `random_config(rng)` draws a small, valid configuration; `build_model(cfg, seed, tmp)` draws weights
  with the golden fixture's recipe (README section 4), writes them with the project's checkpoint writer
  and loads them back through the normal loader, so the kernels see exactly the checkpoint formats.
- `LayerCompare` wraps a model: every backbone block, Engram layer, DSpark stage and the heads run first
  with the torch ops and then, on the same inputs and the same snapshot of the model state, with the
  nki-sim ops; the torch results are kept (teacher forcing), the differences are recorded per layer.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

# ---- model-side imports (paths move with the package restructure; keep them in this block) ----------
from v4flash_backend import ops
from v4flash_backend.config import ModelConfig
from v4flash_backend.formats.checkpoint import write_checkpoint
from v4flash_backend.model import transformer as model_mod
from v4flash_backend.model.dspark import DSparkDrafter
from v4flash_backend.model.engram_hash import bucket_primes, table_rows
from v4flash_backend.model.loading import load_model
from v4flash_backend.model.state import ModelState, make_segments
from v4flash_backend.training.params import export_tensors, init_masters

# -------------------------------------------------------------------------------------------------------

STRICT_ROW_TOL, STRICT_ROW_FRAC, PREMIX_TOL = 2e-3, 0.05, 1e-4  # golden README 6.3, check 2 (strict)

GOLDEN_TOKENIZER = Path(__file__).resolve().parents[1].parent / "shared" / "golden" / "v41-tiny" / "tokenizer.json"


# ---- configurations ------------------------------------------------------------------------------------
def config(**kw) -> ModelConfig:
    """A tiny config in the golden fixture's family; keyword overrides."""
    base = dict(vocab_size=1024, dim=128, moe_inter_dim=64, n_layers=10, n_mtp_layers=3, dspark_block_size=5,
                dspark_noise_token_id=1023, dspark_target_layer_ids=[7, 8, 9], dspark_markov_rank=32,
                dspark_n_routed_experts=4, dspark_n_activated_experts=2, n_heads=4, n_routed_experts=8,
                n_shared_experts=1, n_activated_experts=3, q_lora_rank=64, head_dim=64, rope_head_dim=16,
                o_groups=4, o_lora_rank=32, window_size=16, kv_source_layers=[2, 4, 6],
                index_source_layers=[2, 4, 6, 8], rope_factor=16, index_n_heads=8, index_head_dim=32,
                index_topk=8, candidate_source_layer=6, candidate_topk_blocks=4, candidate_block_size=4,
                engram_layer_ids=[1, 4], engram_vocab_size=500, engram_max_ngram_size=4, engram_pad_id=2,
                engram_compressed_vocab_size=672, engram_n_heads=2, engram_head_dim=64,
                compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0], vision_n_layers=0, image_token_id=1022)
    base.update(kw)
    n_tot = base["n_layers"] + base["n_mtp_layers"]
    assert len(base["compress_ratios"]) == n_tot
    ids = base["engram_layer_ids"]
    base["engram_num_embeddings"] = table_rows(bucket_primes(len(ids), base["engram_max_ngram_size"],
                                                             base["engram_n_heads"], base["engram_vocab_size"]))
    return ModelConfig.from_dict(base)


def unseen_like_config() -> ModelConfig:
    """The issue's description of the unseen fixture: 13 layers, dim 160, 8 heads x 32, window 8, 16 index
    heads x 64, compressed layers spread differently, DSpark block 4, YaRN factor 8."""
    return config(n_layers=13, dim=160, n_heads=8, head_dim=32, window_size=8, index_n_heads=16,
                  index_head_dim=64, dspark_block_size=4, rope_factor=8,
                  compress_ratios=[0, 2, 2, 2, 0, 2, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0],
                  kv_source_layers=[1, 3, 6], index_source_layers=[1, 3, 6, 8, 10],
                  candidate_source_layer=6, engram_layer_ids=[2, 9], dspark_target_layer_ids=[10, 11, 12],
                  o_groups=4, o_lora_rank=32)


def random_config(rng: random.Random) -> ModelConfig:
    """A random small configuration: dims, heads / head dims, window, compress ratios and their layer mix,
    index heads / top-k, candidate blocks, Engram layers, DSpark block and taps, vocab not a multiple of 128
    (and at most the 1024 ids of the golden tokenizer, which defines the Engram map)."""
    n_layers = rng.randint(4, 8)
    heads = rng.choice([2, 4, 8])
    o_groups = rng.choice([g for g in (1, 2, 4) if heads % g == 0])
    o_rank = rng.choice([r for r in (16, 32) if (o_groups * r) % 32 == 0])  # wo_b input: fp8 blocks of 32
    head_dim = rng.choice([32, 64])
    dim = rng.choice([64, 96, 128, 160])
    rope = rng.choice([16, 32]) if head_dim > 32 else 16
    # layer mix: window-only head layers, then compressed runs; every run starts with its source
    ratios, srcs, idx_srcs = [], [], []
    i = 0
    while len(ratios) < n_layers:
        r = rng.choice([0, 1, 2, 2, 4])
        run = rng.randint(1, 3)
        for j in range(run):
            if len(ratios) >= n_layers:
                break
            ratios.append(r)
            if r and j == 0:
                srcs.append(len(ratios) - 1)
                idx_srcs.append(len(ratios) - 1)
            elif r and rng.random() < 0.3:
                idx_srcs.append(len(ratios) - 1)
        i += 1
    # the candidate source: an index source of ratio 1 whose later index sources share its ratio
    cand = -1
    for s in idx_srcs:
        if ratios[s] == 1 and all(ratios[t] == 1 for t in idx_srcs if t > s) and rng.random() < 0.8:
            cand = s
            break
    cblock = rng.choice([2, 4])
    topk = rng.choice([4, 8, 12])
    cblocks = max(rng.choice([2, 3, 4]), -(-(topk - 1) // cblock) + 1)  # enough reachable candidates
    n_mtp = rng.choice([1, 2, 3])
    taps = sorted(rng.sample(range(n_layers), rng.randint(1, min(3, n_layers))))
    eng = sorted(rng.sample(range(n_layers), rng.randint(0, 2)))
    vocab = rng.choice([937, 1000, 1021])  # not a multiple of 128; <= the tokenizer's 1024 ids (Engram map)
    return config(
        vocab_size=vocab, dim=dim, n_layers=n_layers, n_mtp_layers=n_mtp, n_heads=heads, head_dim=head_dim,
        rope_head_dim=rope, o_groups=o_groups, o_lora_rank=o_rank, q_lora_rank=rng.choice([32, 64]),
        window_size=rng.choice([4, 8, 16]), compress_ratios=ratios + [0] * n_mtp, kv_source_layers=srcs,
        index_source_layers=idx_srcs, candidate_source_layer=cand, candidate_topk_blocks=cblocks,
        candidate_block_size=cblock, index_n_heads=rng.choice([2, 4, 8, 16]),
        index_head_dim=rng.choice([32, 64]), index_topk=topk, engram_layer_ids=eng,
        engram_n_heads=rng.choice([1, 2]), engram_head_dim=rng.choice([32, 64]),
        dspark_block_size=rng.choice([2, 3, 4, 5]), dspark_target_layer_ids=taps,
        dspark_noise_token_id=vocab - 1, dspark_markov_rank=rng.choice([16, 32]),
        n_routed_experts=rng.choice([4, 8]), n_activated_experts=2, dspark_n_routed_experts=4,
        dspark_n_activated_experts=2, moe_inter_dim=rng.choice([32, 64]),
        rope_factor=rng.choice([4, 8, 16]), image_token_id=vocab - 2,
    )


# ---- weights (golden README section 4 recipe) -----------------------------------------------------------
_GAINS = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 0.8, "gate": 2.9, "w1": 1.5, "w3": 1.5,
          "w2": 0.6, "head": 2.0}
_NORM_MEANS = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "k_norm": 0.5}


def _draw(name: str, shape, g: torch.Generator, cfg: ModelConfig) -> torch.Tensor:
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
    if name.endswith("norm.weight"):
        mean = 0.6 if ".compressor." in name else _NORM_MEANS.get(leaf, 1.0)
        return mean * (1 + 0.1 * torch.randn(shape, generator=g))
    if name.endswith(("q_weight", "k_weight")):
        return 1 + 0.1 * torch.randn(shape, generator=g)
    if name.endswith("attn_sink"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=g)
    if name.endswith("_scale"):
        return 0.1 + 0.4 * torch.rand(shape, generator=g)
    if name.endswith("_fn"):
        return torch.randn(shape, generator=g) / math.sqrt(cfg.hc_mult * cfg.dim)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1 * torch.randn(shape, generator=g)
    if name == "embed.weight" or ".engram.embed" in name or name.endswith("markov_head.embed.weight"):
        return torch.randn(shape, generator=g)
    if len(shape) >= 2:
        gain = 40.0 if (".compressor." in name and leaf == "wgate") else (
            0.5 if ".engram." in name and leaf == "wkv" else _GAINS.get(leaf, 1.0))
        return torch.randn(shape, generator=g) * (gain / math.sqrt(shape[-1]))
    return 0.1 * torch.randn(shape, generator=g)


def build_model(cfg: ModelConfig, seed: int, out_dir: Path):
    """Random weights -> official checkpoint (project writer) -> the normal loader."""
    import shutil

    masters = init_masters(cfg, seed)
    for i, name in enumerate(sorted(masters)):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        masters[name] = _draw(name, tuple(masters[name].shape), g, cfg).float()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out_dir, export_tensors(cfg, masters), overwrite=True)
    cfg.to_json(out_dir / "config.json")
    shutil.copy(GOLDEN_TOKENIZER, out_dir / "tokenizer.json")
    return load_model(out_dir)


# ---- per-layer teacher-forced comparison ------------------------------------------------------------------
def row_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a.float().reshape(a.shape[0], -1)
    b = b.float().reshape(b.shape[0], -1)
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)


@dataclass
class LayerDiff:
    where: str  # e.g. "prefill layers.3"
    rows: int
    errs: dict = field(default_factory=dict)  # name -> per-row rel errors (tensor)
    premix: float = 0.0
    premix_rows: object = None  # per-row max |d| of the FFN pre-mix (tensor)
    topk_rows: int = 0  # rows whose top-k set differs
    exact_other: dict = field(default_factory=dict)  # name -> bool (bit-identical extra tensors)

    def strict_ok(self) -> bool:
        for r in self.errs.values():
            if (r > STRICT_ROW_TOL).float().mean().item() > STRICT_ROW_FRAC:
                return False
        return self.premix <= PREMIX_TOL and self.topk_rows == 0

    def summary(self) -> str:
        e = " ".join(f"{k} med {v.median().item():.1e} max {v.max().item():.1e} >2e-3 {int((v > STRICT_ROW_TOL).sum())}"
                     for k, v in self.errs.items())
        return f"{self.where}: rows {self.rows} {e} premix {self.premix:.1e} topk rows {self.topk_rows}"


def _snapshot(state: ModelState):
    snap = {}
    for k, v in vars(state).items():
        if isinstance(v, torch.Tensor):
            snap[k] = v.clone()
        elif isinstance(v, dict) and v and all(isinstance(t, torch.Tensor) for t in v.values()):
            snap[k] = {kk: t.clone() for kk, t in v.items()}
    return snap


def _restore(state: ModelState, snap) -> None:
    for k, v in snap.items():
        cur = getattr(state, k)
        if isinstance(v, torch.Tensor):
            cur.copy_(v)
        else:
            for kk, t in v.items():
                cur[kk].copy_(t)


@contextlib.contextmanager
def backend(name: str):
    prev = ops.get_backend()
    ops.set_backend(name)
    try:
        yield
    finally:
        ops.set_backend(prev)


class LayerCompare:
    """Patch `model` so every block runs on both backends (torch result kept); `diffs` collects LayerDiffs."""

    def __init__(self, model, phase: str = ""):
        self.m, self.phase, self.diffs = model, phase, []
        self._orig_block = model.block
        self._orig_hc_block = model.hc_block
        self._orig_engram = model_mod.engram_mix
        self._orig_head = model.head_logits

    def __enter__(self):
        ops.set_numerics("reference")
        self.m.block = self._block
        self.m.hc_block = self._hc_block
        model_mod.engram_mix = self._engram
        self.m.head_logits = self._head
        return self

    def __exit__(self, *exc):
        self.m.block = self._orig_block
        self.m.hc_block = self._orig_hc_block
        model_mod.engram_mix = self._orig_engram
        self.m.head_logits = self._orig_head
        return False

    def _block(self, layer, h, pre_mix, segs, state, shared, positions, capture=None, *rest):
        # rest: the step's geometries, the layer's rope and the MoE form (V41Model.block's tail)
        snap = _snapshot(state)
        sh0 = [dict(s) for s in shared]
        cap_t, cap_n = {}, {}
        with backend("torch"):
            out_t, pre_t = self._orig_block(layer, h, pre_mix, segs, state, shared, positions, cap_t, *rest)
        snap_t = _snapshot(state)
        sh_t = [dict(s) for s in shared]
        _restore(state, snap)
        sh_n = [dict(s) for s in sh0]
        with backend("nki-sim"):
            out_n, pre_n = self._orig_block(layer, h, pre_mix, segs, state, sh_n, positions, cap_n, *rest)
        d = LayerDiff(f"{self.phase} layers.{layer}", h.shape[0])
        for k in ("attn_out", "ffn_out", "x_out"):
            d.errs[k] = row_rel(cap_n[k], cap_t[k])
        d.premix_rows = (pre_n - pre_t).abs().amax(-1)
        d.premix = d.premix_rows.max().item()
        for a, b in zip(sh_n, sh_t):
            if "topk" in b and "topk" in a:
                ta, tb = a["topk"], b["topk"]
                d.topk_rows += sum(set(ta[r].tolist()) != set(tb[r].tolist()) for r in range(tb.shape[0]))
            if "candidates" in b and "candidates" in a:
                d.exact_other["candidates"] = bool(torch.equal(a["candidates"], b["candidates"]))
        st_n = _snapshot(state)
        for k, v in snap_t.items():  # caches written by the block (window KV, compressed KV, index keys)
            if isinstance(v, dict):
                for kk, t in v.items():
                    if t.is_floating_point() and t.numel() and t.shape[-1] > 1:
                        a, b = st_n[k][kk].reshape(-1, t.shape[-1]), t.reshape(-1, t.shape[-1])
                        live = b.abs().sum(-1) > 0
                        if live.any() and torch.isfinite(b[live]).all():
                            d.errs.setdefault(f"state.{k}", torch.zeros(0))
                            r = row_rel(a[live], b[live])
                            d.errs[f"state.{k}"] = torch.cat([d.errs[f"state.{k}"], r])
        self.diffs.append(d)
        _restore(state, snap_t)
        shared[:] = sh_t
        if capture is not None:
            capture.update(cap_t)
        return out_t, pre_t

    def _hc_block(self, p, n_act, h, pre_mix, attn, capture=None, moe_form=None):
        if not p.startswith("mtp."):
            return self._orig_hc_block(p, n_act, h, pre_mix, attn, capture, moe_form)
        cap_t, cap_n = {}, {}
        with backend("torch"):
            out_t, pre_t = self._orig_hc_block(p, n_act, h, pre_mix, attn, cap_t, moe_form)
        with backend("nki-sim"):
            out_n, pre_n = self._orig_hc_block(p, n_act, h, pre_mix, attn, cap_n, moe_form)
        d = LayerDiff(f"{self.phase} {p}", h.shape[0])
        for k in ("attn_out", "ffn_out", "x_out"):
            d.errs[k] = row_rel(cap_n[k], cap_t[k])
        d.premix_rows = (pre_n - pre_t).abs().amax(-1)
        d.premix = d.premix_rows.max().item()
        self.diffs.append(d)
        if capture is not None:
            capture.update(cap_t)
        return out_t, pre_t

    def _engram(self, W, cfg, layer, h, rows):
        with backend("torch"):
            t = self._orig_engram(W, cfg, layer, h, rows)
        with backend("nki-sim"):
            n = self._orig_engram(W, cfg, layer, h, rows)
        d = LayerDiff(f"{self.phase} engram.{layer}", h.shape[0])
        d.errs["x_out"] = row_rel(n, t)
        self.diffs.append(d)
        return t

    def _head(self, h, pre_mix):
        return self.compare_fn("head", self._orig_head, h, pre_mix)

    def compare_fn(self, where: str, fn, *args):
        """Run fn(*args) on both backends; record row errors of (each) tensor result; return torch's."""
        with backend("torch"):
            t = fn(*args)
        with backend("nki-sim"):
            n = fn(*args)
        ts, ns = (t, n) if isinstance(t, tuple) else ((t,), (n,))
        d = LayerDiff(f"{self.phase} {where}", ts[0].shape[0])
        for i, (a, b) in enumerate(zip(ns, ts)):
            if isinstance(b, torch.Tensor) and b.is_floating_point():
                d.errs[f"out{i}"] = row_rel(a.reshape(b.shape[0], -1), b.reshape(b.shape[0], -1))
        self.diffs.append(d)
        return t


def run_scenario(m, prompt_len: int, decode_steps: int, seed: int, verify: int = 0):
    """Prefill a random prompt, decode `decode_steps` tokens, then one verification step of 1 + `verify`
    rows; DSpark taps -> rings -> a draft block after prefill and after every decode step. Each layer runs
    on both backends, teacher-forced on torch. Returns the LayerDiffs."""
    cfg = m.cfg
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(cfg.vocab_size, 1024) - 2, (prompt_len,), generator=g)
    ids[0] = 0
    total = prompt_len + decode_steps + verify + cfg.dspark_block_size + 8
    st = ModelState(cfg, 1, total)
    diffs = []
    dr = DSparkDrafter(m) if cfg.dspark_block_size and cfg.n_mtp_layers else None

    def step(phase, toks, start, rows):
        with LayerCompare(m, phase) as lc:
            out = m.forward(st, toks, make_segments([(0, start, len(toks))]), logits_rows=rows,
                            want_taps=dr is not None)
            logits = out.logits
            if dr is not None:
                main = lc.compare_fn("dspark main_x", dr.main_x, out.taps)
                lc.compare_fn("dspark ring", lambda: _ring_write(dr, st, main, start, len(toks)))
                dr.write_ring(st, 0, main, torch.arange(start, start + len(toks)))
                p = start + len(toks) - 1
                anchor = int(logits[-1].argmax())
                lc.compare_fn("dspark draft U", lambda: dr.draft(st, [(0, p, anchor)]).base_logits[0])
            diffs.extend(lc.diffs)
        return logits

    logits = step("prefill", ids, 0, "all")
    pos = prompt_len
    for k in range(decode_steps):
        nxt = logits[-1].argmax().view(1)
        logits = step(f"decode{k}", nxt, pos, "last")
        pos += 1
    if verify:
        toks = torch.cat([logits[-1].argmax().view(1), torch.randint(3, 1000, (verify,), generator=g)])
        step("verify", toks, pos, "all")
    return diffs


def _ring_write(dr, st, main, start, n):
    """The ring rows the stages would write for these positions (returned, not stored)."""
    W, cfg = dr.m.W, dr.cfg
    from v4flash_backend.formats import quant
    from v4flash_backend.model.weights import linear

    keep = min(n, cfg.window_size)
    positions = torch.arange(start, start + n)[-keep:]
    x = main[-keep:]
    rows = []
    for k in range(dr.n_stages):
        p = f"mtp.{k}.attn"
        kv = ops.rms_norm(linear(W, p + ".wkv", x), W[p + ".kv_norm.weight"], cfg.norm_eps)
        rows.append(quant.fp8_act_qdq(dr.m.ropes[dr.stage_layer(k)].apply(kv, positions)))
    return torch.cat(rows)



def strict_by_layer(diffs):
    """The golden README's strict per-layer level, applied per compared layer / tensor over all the rows of a
    scenario (prefill, decode and verification rows together, as golden-check's replay pools a layer's
    positions): at most STRICT_ROW_FRAC of the rows above STRICT_ROW_TOL relative error on every output, and
    the same row budget for rows whose pre-mix moved by more than PREMIX_TOL or whose top-k set differs.
    Returns {layer key: (ok, summary)}."""
    import collections

    groups = collections.defaultdict(list)
    for d in diffs:
        groups[d.where.split(" ", 1)[1]].append(d)
    out = {}
    for key, ds in groups.items():
        rows = sum(d.rows for d in ds)
        notes, ok = [], True
        names = sorted({n for d in ds for n in d.errs})
        for n in names:
            r = torch.cat([d.errs[n] for d in ds if n in d.errs])
            over = int((r > STRICT_ROW_TOL).sum())
            ok &= over <= STRICT_ROW_FRAC * r.numel()
            notes.append(f"{n} >2e-3 {over}/{r.numel()} max {r.max().item():.1e}")
        pm = [d.premix_rows for d in ds if d.premix_rows is not None]
        if pm:
            p = torch.cat(pm)
            over = int((p > PREMIX_TOL).sum())
            ok &= over <= STRICT_ROW_FRAC * p.numel()
            notes.append(f"premix >1e-4 {over}/{p.numel()} max {p.max().item():.1e}")
        tk = sum(d.topk_rows for d in ds)
        ok &= tk <= STRICT_ROW_FRAC * rows
        notes.append(f"top-k rows differing {tk}/{rows}")
        out[key] = (ok, f"{key}: " + ", ".join(notes))
    return out
