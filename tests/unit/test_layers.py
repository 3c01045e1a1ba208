"""The package's layers, bottom to top:

    spec < cost < plan < sim < planner < data < runtime < megatron < commands

A module may import its own layer and the layers below it, never one above: the engines (every
layer but ``commands``) import no command code, and ``commands`` (the CLI: parsing, launching,
printing, the files written for the user) sits on top. Every import counts, at module level or
inside a function: a lazy import still runs upward when it is called.

Where each module of ``megatron_ext/`` belongs: ``megatron_ext/<layer>/...`` is in ``<layer>``;
of the top-level modules, ``spec.py`` is the ``spec`` layer and the small shared leaves in
``LEAVES`` (``errors.py``, ``text.py``, ``lifetime.py``) and the package's ``__init__.py`` are the
bottom, below ``spec``: they may import only each other. A new top-level module must be given a
place here (``TOP_LEVEL``), or the test fails naming it.

The pure layers (spec, cost, plan, sim, planner: functions of lengths, cost models and plans) must
not import ``torch.distributed`` or Megatron (megatron-core / Megatron-LM's ``megatron`` package, or
``megatron_ext.megatron``). ``PURE_ALLOWED`` names the one exception and why.

No two modules may import each other, directly or round a loop (lazy imports count too).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ext"
LAYERS = ("spec", "cost", "plan", "sim", "planner", "data", "runtime", "megatron", "commands")
BOTTOM = "bottom"  # below every layer: the shared leaves
LEAVES = ("errors", "text", "lifetime", "files")
TOP_LEVEL = {"__init__": BOTTOM, "spec": "spec", **{name: BOTTOM for name in LEAVES}}
RANK = {BOTTOM: -1, **{name: i for i, name in enumerate(LAYERS)}}
PURE = ("spec", "cost", "plan", "sim", "planner")
# (pure-layer module's imported module, why): allowed inside a function only, so that the package
# still imports without megatron-core.
PURE_ALLOWED = {
    "megatron.core.pipeline_parallel.hybrid_cp_schedule":
        "the megatron_balanced_cp baseline (planner) runs megatron-core's own BalancedCPScheduler, a pure "
        "scheduling function, imported when that baseline is asked for",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    """The layer of a ``megatron_ext`` module (None: a top-level module without a place)."""
    parts = module.split(".")
    if parts == ["megatron_ext"]:
        return TOP_LEVEL["__init__"]
    if (PACKAGE / parts[1]).is_dir():
        return parts[1] if parts[1] in LAYERS else None
    return TOP_LEVEL.get(parts[1])


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str, bool]]:
    """Every import of ``source`` (the text of ``module``): (line, imported module, at module
    level). ``from P import name`` gives ``P.name`` where P is this package (``from megatron_ext
    import errors``), else P; relative imports are resolved."""
    tree = ast.parse(source)
    out = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            inside = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    here = module.split(".") if is_package else module.split(".")[:-1]
                    here = here[:len(here) - child.level + 1]
                    base = ".".join(here + ([base] if base else []))
                if base in ("megatron_ext", "torch"):  # a submodule by name: megatron_ext.errors, torch.distributed
                    out.extend((child.lineno, f"{base}.{a.name}", top) for a in child.names)
                else:
                    out.append((child.lineno, base, top))
            visit(child, inside)

    visit(tree, True)
    return out


def violations(path: Path, source: str | None = None) -> list[str]:
    """What ``path`` (or ``source``, as if it were that file) imports against the layers."""
    module = module_name(path)
    mine = layer_of(module)
    where = path.relative_to(PACKAGE.parent)
    if mine is None:
        return [f"{where}: {module} has no layer: put it in a layer's folder, or give it a place in "
                f"tests/unit/test_layers.py's TOP_LEVEL"]
    found = []
    for line, target, top in imports(source if source is not None else path.read_text(), module,
                                     path.name == "__init__.py"):
        root = target.split(".")[0]
        if root == "megatron_ext":
            theirs = layer_of(target)
            if theirs is None:
                found.append(f"{where}:{line}: imports {target}, which has no layer")
            elif RANK[theirs] > RANK[mine]:
                found.append(f"{where}:{line}: {module} ({mine}) imports {target} ({theirs}), a layer above")
        if mine in PURE:
            megatron = root == "megatron" or target.startswith("megatron_ext.megatron")
            distributed = target == "torch.distributed" or target.startswith("torch.distributed.")
            if (megatron or distributed) and not (target in PURE_ALLOWED and not top):
                what = "torch.distributed" if distributed else "Megatron"
                found.append(f"{where}:{line}: {module} ({mine}, a pure layer) imports {target} ({what})")
    return found


def test_no_import_runs_upward_and_pure_layers_stay_pure():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    found = [v for f in files for v in violations(f)]
    assert not found, "imports against the layers (tests/unit/test_layers.py's docstring):\n" + "\n".join(found)


def test_every_layer_has_its_folder():
    assert all((PACKAGE / name).is_dir() for name in LAYERS if name != "spec")
    assert (PACKAGE / "spec.py").is_file()


def test_the_check_sees_what_it_must():
    """Lazy, relative and ``from megatron_ext import`` imports count; module-level only for the
    allowed Megatron import; a top-level module without a place is named."""
    sim = PACKAGE / "sim" / "engine.py"
    assert violations(sim, "def f():\n    from megatron_ext.planner import api\n") == [
        "megatron_ext/sim/engine.py:2: megatron_ext.sim.engine (sim) imports megatron_ext.planner (planner), "
        "a layer above"]
    assert len(violations(sim, "from ..commands import plan\n")) == 1
    assert len(violations(sim, "from megatron_ext import commands\n")) == 1
    assert violations(sim, "from megatron_ext import errors, text\nfrom . import simulator\n") == []
    assert len(violations(sim, "from torch import distributed\n")) == 1
    assert len(violations(sim, "import torch.distributed as dist\n")) == 1
    assert len(violations(sim, "import megatron.core\n")) == 1
    allowed = "import megatron.core.pipeline_parallel.hybrid_cp_schedule\n"
    assert len(violations(sim, allowed)) == 1  # at module level: the package would need megatron-core
    assert violations(sim, "def f():\n    " + allowed) == []
    assert violations(PACKAGE / "runtime" / "device.py", "import torch.distributed\nimport megatron.core\n") == []
    assert violations(PACKAGE / "errors.py", "from megatron_ext.spec import ModelSpec\n") != []
    assert "has no layer" in violations(PACKAGE / "helpers.py", "")[0]


def import_cycles(package: Path) -> list[list[str]]:
    """The import cycles among the modules of ``package`` (every import counted, lazy ones too):
    each strongly connected group of two or more modules, sorted."""
    files = {".".join(f.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): f
             for f in sorted(package.rglob("*.py"))}

    def resolve(target: str) -> str | None:  # megatron_ext.plan.validate.checked_batch_lengths -> the module
        while target and target not in files:
            target = target.rpartition(".")[0]
        return target or None

    graph = {m: {t for _, imp, _ in imports(f.read_text(), m, f.name == "__init__.py")
                 if imp.startswith(package.name) and (t := resolve(imp)) not in (None, m)}
             for m, f in files.items()}
    index, low, stack, cycles = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = import_cycles(PACKAGE)
    assert not cycles, "modules that import each other (directly or round a loop):\n" + "\n".join(map(str, cycles))


def test_the_cycle_check_sees_a_cycle(tmp_path):
    pkg = tmp_path / "megatron_ext" / "sim"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from megatron_ext.sim.b import g\n")
    (pkg / "b.py").write_text("from megatron_ext.sim.a import f\n")
    (pkg / "c.py").write_text("from megatron_ext.sim.a import f\n")
    assert import_cycles(tmp_path / "megatron_ext") == [["megatron_ext.sim.a", "megatron_ext.sim.b"]]
    (pkg / "a.py").write_text("")
    assert import_cycles(tmp_path / "megatron_ext") == []
