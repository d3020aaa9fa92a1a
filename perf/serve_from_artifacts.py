"""A static rank group started from the compile command's artifacts, against one that computes the
same rounds op by op: what `compiled_artifacts` gives a server, measured.

    python -m v4flash_backend compile --checkpoint models/v4flash-tiny --world-size 2 --out DIR
    .venv/bin/python perf/serve_from_artifacts.py --artifacts DIR

Both groups take the manifest's own settings (the settings the graphs were compiled for) and a
pinned step-cost table (step_cost_online off: both decide on the same costs). The group from the
artifacts starts with `compile_on_miss` off, so a graph it would have to trace or compile fails its
start; the reference runs the same StaticRunner with graph_backend none (rounds op by op, nothing
compiled). One greedy and one seeded request each. The last line:

    serve-from-artifacts: ready_s=<launch to ready> loaded=<graphs> traced=<n> compiled=<n>
        graphs_compiled=<n> static_steps=<n> same_ids=yes|no
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from v4flash_backend.engine.dspark_sched import SPSTable
from v4flash_backend.group.rank_group import RankGroup
from v4flash_backend.settings import Settings

KEEP = ("checkpoint_dir", "max_num_seqs", "max_model_len", "prefill_chunk", "warm_processed", "spec_mode",
        "fixed_len", "dspark_adaptive", "world_size")
PROMPT = [0, 17, 230, 5, 99]


def serve(settings: Settings):
    t0 = time.perf_counter()
    g = RankGroup.launch(settings)
    ready = time.perf_counter() - t0
    try:
        ids = [g.submit(PROMPT, {"max_tokens": 8, "temperature": t, "seed": 3, "ignore_eos": True})
               .result(timeout=600)["token_ids"] for t in (0.0, 0.8)]
        return ids, g.stats()["engine"], ready
    finally:
        g.shutdown(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifacts", required=True, help="the compile command's --out directory")
    args = ap.parse_args()
    st = json.loads((Path(args.artifacts) / "manifest.json").read_text())["settings"]
    with tempfile.TemporaryDirectory() as tmp:
        sps = str(Path(tmp) / "sps.json")
        SPSTable([1, 2, 4, 8, 16], [10.0, 9.8, 9.5, 9.0, 8.0]).save(sps)
        common = dict({k: st[k] for k in KEEP}, decode_graph="static", startup_timeout_s=3600.0,
                      collective_timeout_s=300.0, prefix_cache_bytes=0, step_cost_online=False, sps_path=sps)
        got, e, ready = serve(Settings(**common, graph_backend=st["graph_backend"], compiled_artifacts=args.artifacts,
                                       compile_on_miss=False))
        want, _, _ = serve(Settings(**common, graph_backend="none"))
    print(f"loaded group: {got}\nop-by-op group: {want}")
    print(f"serve-from-artifacts: ready_s={ready:.1f} loaded={e.get('startup_graphs_loaded')} "
          f"traced={e.get('startup_graphs_traced')} compiled={e.get('startup_graphs_compiled')} "
          f"graphs_compiled={e.get('graphs_compiled')} static_steps={e.get('static_steps')} "
          f"same_ids={'yes' if got == want else 'no'}", flush=True)


if __name__ == "__main__":
    main()
