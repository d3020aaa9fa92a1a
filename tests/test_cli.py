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


def test_generate_flags_come_from_the_settings_schema():
    """`generate` keeps every flag it had before its setting flags were generated from `Settings`
    (issue 31), they land in the run's Settings, and a value outside a setting's choices is refused
    by the parser with the schema's choice list."""
    import argparse

    import pytest

    from v4flash_backend import cli
    from v4flash_backend.settings import DECODE_GRAPHS, OPS_BACKENDS, SPEC_MODES

    ap = argparse.ArgumentParser()
    cli.add_generate_arguments(ap)
    ns = ap.parse_args(["--checkpoint", "ck", "--ops", "nki-sim", "--world-size", "4", "--decode-graph", "eager",
                        "--graph-backend", "none", "--spec-mode", "fixed", "--pipeline-parallel", "2",
                        "--sequence-parallel", "--sps-path", "sps.json", "--step-report", "--prompt", "hi",
                        "--prompt-ids", "1,2", "--max-tokens", "3", "--temperature", "0.5", "--top-k", "3",
                        "--top-p", "0.9", "--seed", "7", "--ignore-eos", "--address", "h:1",
                        "--group-secret-file", "secret", "--python", "py"])
    s = cli.generate_settings(ns, [1, 2])
    assert (s.checkpoint_dir, s.ops_backend, s.world_size, s.decode_graph, s.graph_backend, s.spec_mode,
            s.pipeline_parallel, s.sequence_parallel, s.sps_path, s.count_host_syncs, s.max_model_len) == (
        "ck", "nki-sim", 4, "eager", "none", "fixed", 2, True, "sps.json", True, 2 + 3 + 8)
    assert cli.generate_params(ns) == {"max_tokens": 3, "temperature": 0.5, "top_k": 3, "top_p": 0.9,
                                       "ignore_eos": True, "seed": 7}
    assert (ns.address, ns.group_secret_file, ns.python, ns.prompt, ns.prompt_ids) == ("h:1", "secret", "py", "hi",
                                                                                       [1, 2])
    plain = ap.parse_args(["--checkpoint", "ck"])  # unset: the Settings defaults, the CPU's ops
    assert (plain.ops_backend, plain.world_size, plain.decode_graph, plain.sequence_parallel) == ("torch", None,
                                                                                                  None, None)
    for flag, choices in (("--ops", OPS_BACKENDS), ("--decode-graph", DECODE_GRAPHS), ("--spec-mode", SPEC_MODES)):
        action = next(a for a in ap._actions if flag in a.option_strings)
        assert list(action.choices) == list(choices), flag
        with pytest.raises(SystemExit):
            ap.parse_args(["--checkpoint", "ck", flag, "bogus"])
    with pytest.raises(SystemExit):
        ap.parse_args(["--prompt-ids", "1"])  # a run needs its checkpoint


def test_every_subcommand_prints_its_help(capsys):
    """`--help` of every subcommand (argparse formats help strings with %: a setting's doc that says
    "3 %" made `compile --help` raise TypeError)."""
    import pytest

    from v4flash_backend.cli import main

    for cmd in ("golden-check", "generate", "placement", "release-check", "trn2-check", "compile", "device-standin"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0, cmd
        assert capsys.readouterr().out.startswith("usage:"), cmd
