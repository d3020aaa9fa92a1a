"""A rank group's warm-up cannot time out (trn2/startup.py), at W = 2 over gloo.

Each rank compiles (`compile_step`, dynamo + the `eager` backend) two graphs that hold a functional
all-reduce over the world, as the static round graphs do; rank 1's backend sleeps DELAY_S, longer
than the collective timeout (TIMEOUT_S), in its first compile -- a slow neuronx-cc compile.

- `run_in_phases` (what every static rank group runs at start): every graph compiled under
  `compile_only` (nothing runs, no collective), a control-plane barrier, then the first runs: both
  ranks start cleanly, the all-reduces give the sum over the ranks (exact: small integers), and
  rank 0 waited for rank 1 at the barrier, not in a first run (without the barrier the raised
  collective timeout would let the wait pass there);
- the old order (each graph compiled and run in turn, as `StaticGraphs.warm_up` did before): rank 0
  runs its first graph's all-reduce while rank 1 still compiles, and the collective times out.

Run as a script under torchrun, this file is the per-rank side of those tests.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3.0
DELAY_S = 8.0


def _rank_main(order: str, out: str) -> None:
    import torch
    import torch._dynamo

    from v4flash_backend.parallel.collectives import init_distributed
    from v4flash_backend.trn2.compiler import CompileStats, compile_step
    from v4flash_backend.trn2.launch import NeuronSettings
    from v4flash_backend.trn2.startup import run_in_phases

    lay, coll = init_distributed("gloo", TIMEOUT_S)
    eager = torch._dynamo.lookup_backend("eager")
    delayed = []

    def slow_backend(gm, example_inputs):  # rank 1's first compile outlasts the collective timeout
        if lay.rank == 1 and not delayed:
            delayed.append(1)
            time.sleep(DELAY_S)
        return eager(gm, example_inputs)

    torch._dynamo.lookup_backend = lambda name: slow_backend
    stats, s = CompileStats(), NeuronSettings(backend="eager")
    g1 = compile_step(lambda x: coll.all_reduce(x * 2, "world"), s, stats, name="g1")
    g2 = compile_step(lambda x: coll.all_reduce(x + 1, "world") * 3, s, stats, name="g2")
    x = torch.full((4,), float(lay.rank + 1))
    outs = {}
    steps = [("g1", lambda: outs.__setitem__("g1", g1(x))), ("g2", lambda: outs.__setitem__("g2", g2(x)))]
    res = {"rank": lay.rank}
    t0 = time.perf_counter()
    try:
        if order == "phases":
            t = run_in_phases(steps, coll=coll, warmup_timeout_s=60.0, collective_timeout_s=TIMEOUT_S)
            res["run_s"] = t["run_s"]
        else:  # the old order: compile, then run, graph by graph
            for _, step in steps:
                step()
        res.update(ok=True, g1=outs["g1"].tolist(), g2=outs["g2"].tolist(), compiled=stats.graphs)
    except Exception as e:  # noqa: BLE001 - the failure is the result
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    res["seconds"] = time.perf_counter() - t0
    with open(f"{out}.{lay.rank}", "w") as f:
        json.dump(res, f)
    if res["ok"]:
        import torch.distributed as dist

        dist.destroy_process_group()
    else:
        os._exit(0)  # a timed-out group cannot be torn down cleanly; the result file says what happened


def _run(order: str, tmp_path) -> list[dict]:
    out = str(tmp_path / f"res-{order}")
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    from v4flash_backend.group.rank_group import free_port

    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                    "127.0.0.1", "--master-port", str(free_port()), __file__, order, out], env=env,
                   capture_output=True, text=True, timeout=300)
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2) if Path(f"{out}.{r}").exists()]


def test_compile_meet_run_starts_cleanly_with_a_compile_slower_than_the_timeout(tmp_path):
    res = _run("phases", tmp_path)
    assert len(res) == 2 and all(r["ok"] for r in res), res
    # (1 + 2) * 2 and ((1 + 1) + (2 + 1)) * 3 on both ranks: the collectives ran, once every rank had compiled
    assert all(r["g1"] == [6.0] * 4 and r["g2"] == [15.0] * 4 and r["compiled"] == 2 for r in res), res
    assert res[0]["seconds"] > DELAY_S  # rank 0 waited for rank 1's compile ...
    # ... at the barrier, not in a first run's collective (the raised timeout alone would let that wait pass)
    assert all(r["run_s"] < DELAY_S / 2 for r in res), res


def test_the_old_order_times_out_on_the_same_ranks(tmp_path):
    res = _run("old", tmp_path)
    r0 = next(r for r in res if r["rank"] == 0)
    assert not r0["ok"] and ("timed out" in r0["error"].lower() or "timeout" in r0["error"].lower()), res


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
