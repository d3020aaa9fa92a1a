"""The package layout: the layers of DESIGN.md section 2 as subpackages, checked from the sources.

- at most 12 modules at the top level of src/v4flash_backend/;
- no import circles between modules, counting imports inside functions too (a lazy import that
  closes a circle is still a circle: serving/backend.py <-> serving/rank_group_backend.py was one);
- every import goes to the same layer or one above it (LAYERS below, the order of the package
  docstring and the README);
- importing the serving side (what the Triton models load) loads no training module;
- the op seam's functions are written out (go-to-definition works) with the reference's signatures.
- no module of the package over 500 lines; the socket protocol built by its one module;
- openai_api/ (the OpenAI frontend) imports nothing of the package outside itself, and loading it
  loads neither another module of the package nor torch;
- engine/ imports nothing from trn2/ (the round plan types the engine builds and reads are its own,
  `engine.round_plan`, which imports nothing but the dtype policy and the sampling constants), and no
  module but those types reads a packed column of a round's read-back.
The checkers themselves are shown to catch a deliberate violation.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "v4flash_backend"

# Layer order: a module may import its own layer or any layer listed before it.
LAYERS = ["config", "settings_values", "settings", "request", "formats", "kernels", "ops", "model", "parallel",
          "engine", "trn2", "group", "serving", "checks", "training", "cli", "client", "openai_api", "__main__",
          "__init__"]
# the OpenAI frontend stands beside tritonserver: it imports nothing of the package outside itself
# (no engine, no model, no second tokenizer; it talks to Triton over gRPC)
FRONTEND = "v4flash_backend.openai_api"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """{module: modules of the package it imports} from the ASTs of every source file."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                # `from pkg import name`: name may be a submodule
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            for t in targets:
                while t and t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != mod and t.startswith("v4flash_backend"):
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def layer(mod: str) -> int:
    parts = mod.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "__init__")


# the static round's plan and read-back types: the engine's (it builds the plan and reads the result;
# trn2/ imports them from there); they import torch and the engine's dtype policy, nothing of the graphs
PLAN_TYPES = "v4flash_backend.engine.round_plan"
PLAN_TYPES_IMPORTS = {"v4flash_backend.engine.precision", "v4flash_backend.engine.sampling"}


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    # package __init__ files (which only hold docstrings) are not edges of the layering
    return sorted((a, b) for a, bs in graph.items() for b in bs if b.count(".") >= 1 and layer(b) > layer(a))


def engine_reaches_into_trn2(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Edges from engine/ into trn2/ (none: the plan types are the engine's), and plan-type imports
    beyond theirs."""
    out = [(a, b) for a, bs in graph.items() if a.startswith("v4flash_backend.engine.")
           for b in bs if b.startswith("v4flash_backend.trn2")]
    return sorted(set(out + [(PLAN_TYPES, b) for b in graph.get(PLAN_TYPES, ()) if b not in PLAN_TYPES_IMPORTS]))


# what reading or writing a column of a round's packed read-back takes: its column-layout names and
# the bit-casts of its float columns (defined in engine/precision.py, used by the plan types alone)
COLUMN_NAMES = {"LOGPROB_COLS", "RESULT_FIXED", "pack_bits", "unpack_bits"}
COLUMN_OWNERS = {PLAN_TYPES, "v4flash_backend.engine.precision"}


def column_readers(sources: dict[str, str]) -> list[tuple[str, str]]:
    """(module, what) for every module outside COLUMN_OWNERS that names a column-layout name (as a
    name, an attribute or an import) or indexes a `row` by the block size G (`row[G + 1]`,
    `row[2 * G + 5:]`: the arithmetic the engine used before the plan types)."""
    out = []
    for mod, text in sources.items():
        if mod in COLUMN_OWNERS:
            continue
        for node in ast.walk(ast.parse(text)):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else None)
            if isinstance(node, ast.alias):
                name = node.name
            if name in COLUMN_NAMES:
                out.append((mod, name))
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "row"
                    and any(isinstance(n, ast.Name) and n.id == "G" for n in ast.walk(node.slice))):
                out.append((mod, ast.unparse(node)))
    return sorted(set(out))


def package_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in PKG.rglob("*.py")}


def test_at_most_12_top_level_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top


def test_every_subpackage_says_what_it_holds():
    for init in PKG.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(REPO)} needs a docstring saying what it holds"
        assert init.parent.name in LAYERS, f"{init.parent.name} is not placed in the layer order"


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_imports_follow_the_layers():
    assert layer_violations(import_graph()) == []


def test_the_checkers_catch_a_deliberate_violation():
    g = import_graph()
    g["v4flash_backend.model.transformer"].add("v4flash_backend.engine.runner")  # model importing the engine
    assert ("v4flash_backend.model.transformer", "v4flash_backend.engine.runner") in layer_violations(g)
    # engine.runner imports model.transformer: the added edge closes a circle
    assert any({"v4flash_backend.model.transformer", "v4flash_backend.engine.runner"} <= set(c) for c in cycles(g))


def test_readme_and_package_docstring_list_every_subpackage():
    readme = (REPO / "README.md").read_text()
    doc = ast.get_docstring(ast.parse((PKG / "__init__.py").read_text()))
    for init in PKG.glob("*/__init__.py"):
        name = init.parent.name
        assert f"`{name}/`" in readme, f"README's layer list lacks {name}/"
        assert f"{name}/" in doc, f"the package docstring lacks {name}/"


def _fresh_python(code: str) -> str:
    """What `code` prints in a fresh interpreter that sees only this tree's src/ (stripped)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_serving_loads_no_training_module():
    code = ("import sys, v4flash_backend.serving.model_setup, v4flash_backend.serving.prepost, "
            "v4flash_backend.serving.engine_rank_group, v4flash_backend.group.worker\n"
            "print(sorted(m for m in sys.modules if m.startswith('v4flash_backend.training')))")
    assert _fresh_python(code) == "[]"


def frontend_leaks(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of openai_api/ modules that reach outside openai_api/."""
    return sorted((a, b) for a, bs in graph.items() if a.startswith(FRONTEND) for b in bs
                  if not b.startswith(FRONTEND))


def test_the_openai_frontend_imports_nothing_of_the_package_outside_itself():
    g = import_graph()
    assert "v4flash_backend.openai_api.triton" in g["v4flash_backend.openai_api.app"]  # the walk sees its edges
    assert frontend_leaks(g) == []
    g["v4flash_backend.openai_api.triton"].add("v4flash_backend.client")  # a deliberate violation is caught
    assert frontend_leaks(g) == [("v4flash_backend.openai_api.triton", "v4flash_backend.client")]
    # at run time too: the app, its chat formats and its command load nothing else of the package
    code = ("import sys, v4flash_backend.openai_api.app, v4flash_backend.openai_api.__main__\n"
            "print(sorted(m for m in sys.modules if m.startswith('v4flash_backend') "
            "and not m.startswith('v4flash_backend.openai_api')), 'torch' in sys.modules)")
    assert _fresh_python(code) == "['v4flash_backend'] False"


def test_op_functions_are_explicit_with_the_reference_signatures():
    from v4flash_backend import ops
    from v4flash_backend.ops import torch_ops

    for name in ops.FAMILIES:
        fn = getattr(ops, name)
        assert inspect.getsourcefile(fn) == str(PKG / "ops" / "__init__.py"), name
        assert fn.__name__ == name
        ref = inspect.signature(getattr(torch_ops, name)).parameters
        assert list(inspect.signature(fn).parameters) == list(ref), name


def test_no_module_over_500_lines():
    """Every module of the package by concern, none over 500 lines (engine/, trn2/, group/ and
    checks/ were split in issue 31; settings.py by concern in issue 46: the value parsing in
    settings_values.py, `Settings` still the one schema), and the split modules are where they say."""
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert {"engine/engine.py", "engine/round_plan.py", "trn2/compiler.py", "trn2/graphs.py",
            "trn2/static_runner.py", "group/worker.py", "settings.py", "settings_values.py"} <= set(sizes)
    assert "trn2/neuron.py" not in sizes  # the re-export shim is gone: importers name the modules
    assert not {k: v for k, v in sizes.items() if v > 500}, sizes
    # the CPU simulator of the NKI kernels too (its helpers left isa.py for _isa_helpers.py)
    sim = {p.name: len(p.read_text().splitlines()) for p in (PKG.parent / "nki_sim").glob("*.py")}
    assert {"isa.py", "_isa_helpers.py", "_tensor.py"} <= set(sim)
    assert not {k: v for k, v in sim.items() if v > 500}, sim


def test_engine_imports_nothing_from_trn2():
    g = import_graph()
    assert PLAN_TYPES in g["v4flash_backend.engine.round_step"]  # the plan types are the engine's own
    assert any(PLAN_TYPES in g[m] for m in g if m.startswith("v4flash_backend.trn2."))  # trn2 imports them
    assert engine_reaches_into_trn2(g) == []


def test_only_the_plan_types_read_a_packed_column():
    sources = package_sources()
    assert "unpack_bits" in sources[PLAN_TYPES]  # the owners do name them: the walk would see them
    assert column_readers(sources) == []


def test_the_plan_checkers_catch_a_deliberate_violation():
    g = import_graph()
    g["v4flash_backend.engine.round_step"].add("v4flash_backend.trn2.static_round")
    g[PLAN_TYPES].add("v4flash_backend.trn2.static_step")
    assert engine_reaches_into_trn2(g) == sorted([
        ("v4flash_backend.engine.round_step", "v4flash_backend.trn2.static_round"),
        (PLAN_TYPES, "v4flash_backend.trn2.static_step")])
    assert ("v4flash_backend.engine.round_step", "v4flash_backend.trn2.static_round") in layer_violations(g)
    # the engine's former column arithmetic, in a module of the engine
    bad = {"v4flash_backend.engine.round_step": (
        "from v4flash_backend.engine.round_plan import LOGPROB_COLS\n"
        "from v4flash_backend.engine import precision\n"
        "G = (n - 5 - LOGPROB_COLS) // (2 + LOGPROB_COLS)\n"
        "k, conf = row[G + 1], precision.unpack_bits(row[G + 5:2 * G + 5])\n")}
    found = column_readers(bad)
    assert {name for _, name in found} >= {"LOGPROB_COLS", "unpack_bits", "row[G + 1]", "row[G + 5:2 * G + 5]"}, found


def test_the_socket_messages_are_built_by_the_protocol_module():
    """The rank-group socket's messages have one owner (group/protocol.py, where they are documented):
    the server and the client build theirs with it instead of spelling dicts out."""
    for name in ("server.py", "rank_group.py"):
        text = (PKG / "group" / name).read_text()
        for spelled in ('"event": "error"', '"op": "submit"', '"op": "cancel"', "json.dumps("):
            assert spelled not in text, (name, spelled)
