"""Every import inside radixserve points down the layers (LAYERS below, drawn in
docs/ARCHITECTURE.md: entry > lang > offline > server > engine > request > model > sampling >
ground), and no imports go round in a circle.

The graph is built from the sources with ast (nothing is imported):
  - a node is a module of pysrc/radixserve (a package is its __init__.py), plus radixserve._C;
  - an edge is an import of another radixserve module written anywhere in the file: at module
    level AND inside functions or methods (a lazy import is still a dependency), and
    importlib.import_module("radixserve.<literal>"). Imports in the body of
    `if TYPE_CHECKING:` are exempt (they never run). `import a.b.c` and `from a.b import c`
    point at the deepest module named (a.b.c); the parent packages whose __init__ Python also
    runs are not edges (otherwise everything would import the package root);
    `from a.b import name` where name is not a module points at a.b.

What fails:
  - an upward import: a module imports one on a higher floor of LAYERS;
  - a circle: a cycle of such edges between modules, module- and function-level imports alike
    (issue 36's circles, model/runner <-> model/cuda_graph_runner and ops/_ext <->
    ops/kernel_status, were each closed by a lazy import), or a cycle between units of LAYERS
    (packages or top-level modules; once nothing points up only units of one floor can form
    one);
  - a module that no row of LAYERS places (a new package must choose its floor here).
Imports between modules of one unit, and sideways between units of one floor, are allowed as
long as they form no circle.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import pytest

import radixserve

PKG_DIR = os.path.dirname(os.path.abspath(radixserve.__file__))

# The floors, top to bottom: a unit may import units of its own floor or of any floor below.
# A unit is a package (with everything under it) or a top-level module; "radixserve" is the
# package root's __init__.py alone.
LAYERS: Sequence[Tuple[str, Sequence[str], str]] = (
    ("entry", ("radixserve", "radixserve.__main__", "radixserve.cli",
               "radixserve.launch_server", "radixserve.replicas", "radixserve.bench",
               "radixserve.env_report"),
     "entry points and tools: the package root (lazy radixserve.Engine), the CLI, "
     "launch_server, the --dp-size supervisor (replicas and the gateway in front), the "
     "packaged benchmarks (drive a server or the Engine), `radixserve env`"),
    ("lang", ("radixserve.lang",),
     "the frontend language: a client, of a server over HTTP (RuntimeEndpoint) or of the "
     "offline Engine in-process (EngineBackend)"),
    ("offline", ("radixserve.offline",),
     "the offline Engine: an AsyncEngine on its own loop; native() runs the server's native "
     "path (server/native_api) without HTTP"),
    ("server", ("radixserve.server",),
     "the starlette app: OpenAI + native routes, SSE, request schemas and validation"),
    ("engine", ("radixserve.engine",),
     "AsyncEngine, Scheduler, Req, ScheduleBatch, the request types and n expansion (io.py)"),
    ("request", ("radixserve.constrained", "radixserve.parsers"),
     "per-request text machinery the engine and the server use: grammars (xgrammar, "
     "jump-forward), reasoning and tool-call parsing"),
    ("model", ("radixserve.model",),
     "ModelRunner, the Llama-family model, loader, the engine-model seam (step_io)"),
    ("sampling", ("radixserve.sampling", "radixserve.quant"),
     "SamplingParams, SamplingInputs, the sampler and penalties; FP8 linear layers (quant/) "
     "used by the model"),
    ("ground", ("radixserve.ops", "radixserve._C", "radixserve.cache", "radixserve.tokenizer",
                "radixserve.config", "radixserve.errors", "radixserve.version",
                "radixserve.parallel", "radixserve.knobs"),
     "the op seam and the compiled extension, KV pool and radix tree, tokenizer, chat "
     "templates and role formats, ServerArgs, the shared error types, the version, the "
     "tensor-parallel rank group and its collectives (parallel/), the table of environment "
     "variables (knobs.py)"),
)

EXTENSION_MODULES = {"radixserve._C"}   # compiled: no source to read, imports nothing of ours


class Edge(NamedTuple):
    src: str
    dst: str
    path: str      # the importing file, relative to pysrc/
    line: int


# --------------------------------------------------------------------------- the graph

def module_files(pkg_dir: str) -> Dict[str, str]:
    """Dotted module name -> file, for every .py under pkg_dir (a package is its __init__)."""
    top = os.path.basename(pkg_dir)
    out = {}
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, os.path.dirname(pkg_dir))
        parts = rel.split(os.sep)
        assert parts[0] == top
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            name = parts + ([] if f == "__init__.py" else [f[:-3]])
            out[".".join(name)] = os.path.join(dirpath, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom / import_module("literal") call outside `if TYPE_CHECKING:`
    bodies, at any depth (functions included)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "import_module"))):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(module: str, is_pkg: bool, node: ast.AST, known: Set[str]) -> List[str]:
    """The modules `node` (in `module`) imports, as named (not yet checked against known)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.Call):
        return [node.args[0].value]
    if node.level:
        base = module.split(".")
        if not is_pkg:
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        frm = ".".join(base + ([node.module] if node.module else []))
    else:
        frm = node.module or ""
    out = []
    for a in node.names:
        sub = f"{frm}.{a.name}"
        out.append(sub if sub in known else frm)
    return out


def build_graph(pkg_dir: str, extension_modules=frozenset()) -> Tuple[Set[str], List[Edge]]:
    """(modules, edges) of the package at pkg_dir; see the module docstring for what counts."""
    files = module_files(pkg_dir)
    top = os.path.basename(pkg_dir)
    known = set(files) | set(extension_modules)
    root = os.path.dirname(pkg_dir)
    edges = []
    for module, path in sorted(files.items()):
        is_pkg = os.path.basename(path) == "__init__.py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in _import_nodes(tree):
            for target in _targets(module, is_pkg, node, known):
                if target != top and not target.startswith(top + "."):
                    continue
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]   # a name inside a module: that module
                if target != module:
                    edges.append(Edge(module, target, os.path.relpath(path, root), node.lineno))
    return known, sorted(set(edges))


# --------------------------------------------------------------------------- the checks

def unit_of(module: str, layers=LAYERS) -> Optional[Tuple[int, str]]:
    """(floor index, 0 = top; unit) of module, or None when no row places it."""
    best = None
    for i, (_, units, _) in enumerate(layers):
        for unit in units:
            root_only = "." not in unit
            if module == unit or (not root_only and module.startswith(unit + ".")):
                if best is None or len(unit) > len(best[1]):
                    best = (i, unit)
    return best


def upward_imports(edges: Sequence[Edge], layers=LAYERS) -> List[str]:
    out = []
    for e in edges:
        src, dst = unit_of(e.src, layers), unit_of(e.dst, layers)
        if src is None or dst is None:
            continue   # unplaced_modules names them
        if dst[0] < src[0]:
            out.append(f"{e.path}:{e.line}: {e.src} (floor {layers[src[0]][0]}) imports "
                       f"{e.dst} (floor {layers[dst[0]][0]}, above it)")
    return out


def unplaced_modules(modules: Set[str], layers=LAYERS) -> List[str]:
    return sorted(m for m in modules if unit_of(m, layers) is None)


def _cycles(nodes_edges: Dict[str, Dict[str, Edge]]) -> List[List[str]]:
    """One cycle (a closed path, first node repeated at the end) per strongly connected
    component with more than one node (Tarjan, iterative)."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    counter = 0
    for start in sorted(nodes_edges):
        if start in index:
            continue
        work = [(start, iter(sorted(nodes_edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(nodes_edges.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(set(comp))
    cycles = []
    for comp in comps:   # a shortest way back to the component's first node
        first = min(comp)
        prev, frontier = {first: None}, [first]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(nodes_edges.get(v, {})):
                    if w == first:
                        found = v
                        break
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path, v = [], found
        while v is not None:
            path.append(v)
            v = prev[v]
        cycles.append(path[::-1] + [first])
    return sorted(cycles)


def _describe(cycle: List[str], adj: Dict[str, Dict[str, Edge]]) -> str:
    hops = ", ".join(f"{adj[a][b].path}:{adj[a][b].line}" for a, b in zip(cycle, cycle[1:]))
    return " -> ".join(cycle) + f"  ({hops})"


def circles(edges: Sequence[Edge], layers=LAYERS) -> List[str]:
    """Module circles, then circles between units of LAYERS."""
    modules: Dict[str, Dict[str, Edge]] = defaultdict(dict)
    units: Dict[str, Dict[str, Edge]] = defaultdict(dict)
    for e in edges:
        modules[e.src].setdefault(e.dst, e)
        su, du = unit_of(e.src, layers), unit_of(e.dst, layers)
        if su and du and su[1] != du[1]:
            units[su[1]].setdefault(du[1], e)
    out = ["modules: " + _describe(c, modules) for c in _cycles(modules)]
    out += ["units: " + _describe(c, units) for c in _cycles(units)]
    return out


# --------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def graph():
    return build_graph(PKG_DIR, EXTENSION_MODULES)


def test_every_module_has_a_floor(graph):
    modules, _ = graph
    assert unplaced_modules(modules) == [], "place these in LAYERS (tests/unit/test_import_layers.py)"


def test_every_layer_row_names_a_real_unit(graph):
    modules, _ = graph
    stale = [u for _, units, _ in LAYERS for u in units
             if u not in modules and not any(m.startswith(u + ".") for m in modules)]
    assert stale == []


def test_no_upward_imports(graph):
    _, edges = graph
    assert edges, "the graph is empty: the scan is broken"
    assert upward_imports(edges) == []


def test_no_circles(graph):
    _, edges = graph
    assert circles(edges) == []


def _write(root, files: Dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root / "pkg")


TOY_LAYERS = (("top", ("pkg", "pkg.server"), ""), ("mid", ("pkg.engine",), ""),
              ("low", ("pkg.ops", "pkg.cache"), ""))


def test_the_check_names_an_upward_import_and_circles(tmp_path):
    """The checker itself, on a toy package: a lazy upward import, a TYPE_CHECKING one (exempt),
    a function-level module circle, a same-floor unit circle, and a module with no floor."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/server/__init__.py": "from pkg.engine import core\n",
        "pkg/engine/__init__.py": "",
        "pkg/engine/core.py": ("from typing import TYPE_CHECKING\n"
                               "if TYPE_CHECKING:\n    from pkg.server import app\n"
                               "def f():\n    from pkg.server import app\n"
                               "def g():\n    from . import helper\n"),
        "pkg/engine/helper.py": "def h():\n    import pkg.engine.core\n",
        "pkg/ops/__init__.py": "from pkg.cache import pool\n",
        "pkg/cache/__init__.py": "",
        "pkg/cache/pool.py": "def p():\n    from pkg import ops\n",
        "pkg/server/app.py": "",
        "pkg/stray.py": "",
    })
    modules, edges = build_graph(pkg)
    assert unplaced_modules(modules, TOY_LAYERS) == ["pkg.stray"]
    up = upward_imports(edges, TOY_LAYERS)
    assert up == [f"pkg/engine/core.py:5: pkg.engine.core (floor mid) imports pkg.server.app "
                  f"(floor top, above it)"]
    found = circles(edges, TOY_LAYERS)
    assert ("modules: pkg.cache.pool -> pkg.ops -> pkg.cache.pool  "
            "(pkg/cache/pool.py:2, pkg/ops/__init__.py:1)") in found
    assert ("modules: pkg.engine.core -> pkg.engine.helper -> pkg.engine.core  "
            "(pkg/engine/core.py:7, pkg/engine/helper.py:2)") in found
    assert any(c.startswith("units: pkg.cache -> pkg.ops -> pkg.cache") for c in found)
    assert any(c.startswith("units: pkg.engine -> pkg.server -> pkg.engine") for c in found)
    assert len(found) == 4
