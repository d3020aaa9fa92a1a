"""Where a compiled graph's inputs come from, written down so that a later process can call the
graph's artifact without dynamo (`trn2.artifacts`: a rank that starts from compiled artifacts).

A graph dynamo captured takes a flat list of tensors; for each, dynamo knows its *source*: an
argument of the traced function (`L['slot']`, `L['a'][5]`), or something the function reaches
from its closure and globals (`L['dec'].state.window[0]`, a weight `dict.__getitem__(L['dec'].m.W,
list(dict.keys(L['dec'].m.W))[42])`, a dequantized copy `G['__import_..torch_ops']._cache._d[<id>][1]`).
Those names are guard expressions of one process: a dict's key by position, an entry of a cache
keyed by `id()`, a module under the alias dynamo injected into the frame's globals. `portable`
rewrites one into a path that means the same object in any process built the same way, walking
the live objects of the frame being traced to do it:

    ["L", name] | ["G", name] | ["module", dotted name]     the root: a local (argument or closure
                                                             variable), a global, an imported module
    ["attr", name], ["item", key or index]                   then attributes and items
    ["id_item", path]                                        the item keyed by id() of the object at
                                                             `path` (the dequantized-weight caches)

`resolve` follows a path on the live objects of another process (`scope`). What dynamo's guards
checked on every call -- that these are the objects and shapes the graph was traced with -- is
stood in for by the artifacts' manifest (the settings, model config, world size, compiler and
versions the graphs were compiled for; `ArtifactStore.check`) and by `trn2.express`'s check of every
bound input's shape, stride, dtype and device against the recorded ones when it binds.
"""

from __future__ import annotations

import importlib

import torch

_IMPORT = "__import_"  # dynamo's alias of a module it imported into the traced frame's globals


class Unbindable(ValueError):
    """A source with no portable path (a slice, an unknown source kind, a key that is not a constant)."""


def _module_of(alias: str) -> str:
    return alias[len(_IMPORT):].replace("_dot_", ".")


def _live(path: list, scope: dict):
    obj = None
    for step in path:
        kind, arg = step
        if kind == "L":
            obj = scope["L"][arg]
        elif kind == "G":
            obj = scope["G"][arg]
        elif kind == "module":
            obj = importlib.import_module(arg)
        elif kind == "attr":
            obj = getattr(obj, arg)
        elif kind == "item":
            obj = obj[arg]
        elif kind == "id_item":
            key = _live(arg, scope)
            entry = obj[id(key)]
            if isinstance(entry, tuple) and entry and entry[0] is not key:  # a stale id (a recycled address)
                raise KeyError(f"the entry of id({_show(arg)}) is another object's")
            obj = entry
        else:
            raise Unbindable(f"unknown path step {kind!r}")
    return obj


def resolve(path: list, scope: dict):
    """The object `path` names among `scope` ({"L": locals, "G": globals})."""
    try:
        return _live(path, scope)
    except (KeyError, IndexError, AttributeError, TypeError) as e:
        raise LookupError(f"{_show(path)}: {type(e).__name__}: {e}") from e


def scope_of(fn) -> dict:
    """What a bound graph's captured paths are resolved in: the closure variables of the traced
    function `fn` (its arguments are the call's, bound per call) and its globals."""
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return {"L": cells, "G": fn.__globals__}


def _show(path: list) -> str:
    out = ""
    for kind, arg in path:
        out += {"L": f"L[{arg!r}]", "G": f"G[{arg!r}]", "module": f"<{arg}>", "attr": f".{arg}",
                "item": f"[{arg!r}]", "id_item": f"[id({_show(arg) if isinstance(arg, list) else arg})]"}[kind]
    return out


def show(path: list) -> str:
    """A path as text (in messages)."""
    return _show(path)


def _steps(src) -> list:
    """The chain of a dynamo source, root first."""
    chain = []
    while src is not None:
        chain.append(src)
        src = getattr(src, "base", None)
    return chain[::-1]


def portable_paths(sources: list, scope: dict) -> list[list]:
    """The portable path of each source (module docstring), walking the objects of `scope` (the
    frame being traced). Raises Unbindable."""
    dicts = []  # (path, dict) of every dict passed on the way: where an id-keyed entry's key is found
    raw = [_translate(s, scope, dicts) for s in sources]
    ident = {}
    for path, d in dicts:
        for k, v in d.items():
            if isinstance(v, torch.Tensor) and isinstance(k, (str, int)):
                ident.setdefault(id(v), path + [["item", k]])
    needed = {arg for path in raw for kind, arg in path if kind == "id?" and arg not in ident}
    if needed:  # e.g. a stack of experts' weights held beside the weights (W.meta): searched for
        ident.update(_find(needed, scope))
    out = []
    for path in raw:
        fixed = []
        for kind, arg in path:
            if kind == "id?":  # an int item of a dict: an id() key where it is one of a known tensor's
                if arg not in ident:
                    raise Unbindable(f"{_show(fixed)}[{arg}]: an int key that is no known tensor's id()")
                fixed.append(["id_item", ident[arg]])
            else:
                fixed.append([kind, arg])
        out.append(fixed)
    return out


def _translate(src, scope: dict, dicts: list) -> list:
    from torch._dynamo import source as S

    path, obj = [], None
    for s in _steps(src):
        if isinstance(s, S.LocalSource):
            path, obj = [["L", s.local_name]], scope["L"][s.local_name]
        elif isinstance(s, S.GlobalSource):
            name = s.global_name
            path = [["module", _module_of(name)]] if name.startswith(_IMPORT) else [["G", name]]
            obj = scope["G"][name]
            if path[0][0] == "module" and importlib.import_module(path[0][1]) is not obj:
                raise Unbindable(f"global {name} is not module {path[0][1]}")
        elif isinstance(s, S.AttrSource):
            path, obj = path + [["attr", s.member]], getattr(obj, s.member)
        elif isinstance(s, (S.DictGetItemSource, S.DictSubclassGetItemSource)):
            key = s.index
            if isinstance(key, S.ConstDictKeySource):
                key = list(dict.keys(obj))[key.index]
            if not isinstance(key, (str, int)):
                raise Unbindable(f"{_show(path)}: a dict key of type {type(key).__name__}")
            path = _item(path, obj, key, dicts)
            obj = obj[key]
        elif isinstance(s, S.GetItemSource) and not s.index_is_slice and isinstance(s.index, (int, str)):
            path = _item(path, obj, s.index, dicts)
            obj = obj[s.index]
        else:
            raise Unbindable(f"a {type(s).__name__} ({s.name if hasattr(s, 'name') else s})")
    return path


def _item(path: list, obj, key, dicts: list) -> list:
    """path + item `key` of `obj`; an int key of a dict beyond any index is taken for an id() (the
    dequantized-weight caches key by the weight's id): resolved once every dict passed is known."""
    if isinstance(obj, dict) and isinstance(key, int) and not isinstance(key, bool) and key >= 1 << 16:
        return path + [["id?", key]]
    if isinstance(obj, dict):
        dicts.append((path, obj))
    return path + [["item", key]]


_LEAVES = (torch.Tensor, str, bytes, int, float, bool, type(None), type, type(importlib))


def _find(ids: set, scope: dict, depth: int = 8) -> dict:
    """{id: path} of the objects with these ids reachable from the locals of `scope` through
    attributes, dict items and list items (breadth first: the shortest path, the same in every
    process that builds the objects the same way)."""
    found, seen = {}, set()
    level = [([["L", k]], v) for k, v in scope["L"].items()]
    for _ in range(depth):
        nxt = []
        for path, obj in level:
            if id(obj) in ids and id(obj) not in found:
                found[id(obj)] = path
            if id(obj) in seen or isinstance(obj, _LEAVES) or callable(obj) and not hasattr(obj, "__dict__"):
                continue
            seen.add(id(obj))
            if isinstance(obj, dict):
                nxt += [(path + [["item", k]], v) for k, v in obj.items() if isinstance(k, (str, int))]
            elif isinstance(obj, (list, tuple)):
                nxt += [(path + [["item", i]], v) for i, v in enumerate(obj)]
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict) and not isinstance(obj, type(importlib)):
                nxt += [(path + [["attr", k]], v) for k, v in attrs.items() if not k.startswith("__")]
        if len(found) == len(ids) or not nxt:
            break
        level = nxt
    return found
