import subprocess
import sys

import torch

from v4flash_backend.engine.single import generate_single as generate
from v4flash_backend.model.state import ModelState, make_segments


def test_greedy_generate_is_the_argmax_chain(tiny_model):
    prompt = [0, 17, 300, 42, 9]
    g = generate(tiny_model, prompt, 6, ignore_eos=True)
    # independent path: recompute the whole sequence from scratch at every step
    seq = list(prompt)
    for _ in range(6):
        st = ModelState(tiny_model.cfg, 1, 64)
        logits = tiny_model.forward(st, torch.tensor(seq), make_segments([(0, 0, len(seq))])).logits[0]
        seq.append(int(logits.argmax()))
    assert g.tokens == seq[len(prompt):] and g.finish_reason == "length"


def test_sampled_generate_is_seeded(tiny_model):
    a = generate(tiny_model, [0, 5, 6], 5, temperature=1.0, seed=123, ignore_eos=True)
    b = generate(tiny_model, [0, 5, 6], 5, temperature=1.0, seed=123, ignore_eos=True)
    c = generate(tiny_model, [0, 5, 6], 5, temperature=1.0, seed=124, ignore_eos=True)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_cli_generate_and_errors(golden_dir):
    cmd = [sys.executable, "-m", "v4flash_backend", "generate", "--checkpoint", str(golden_dir)]
    r = subprocess.run(cmd + ["--prompt-ids", "0,5,6", "--max-tokens", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("output_ids: ") and len(r.stdout.split("\n")[0].split()) == 4
    r = subprocess.run(cmd + ["--prompt-ids", "0,5,99999"], capture_output=True, text=True)
    assert r.returncode == 2 and "outside the vocabulary" in r.stderr
    r = subprocess.run(cmd + ["--prompt-ids", "0,5", "--max-tokens", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "max_tokens" in r.stderr
