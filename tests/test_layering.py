"""The house's rules: fedmed/ never imports nvflare (statically, and at run time: importing every module of the
package leaves nvflare out of sys.modules); layers and no import circles; fedmed_flare imports nothing of the CLI;
every exception derives from FedmedError; no method or signature kind is named outside its own module."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append(str(node.args[0].value))
    return out


def test_no_module_of_fedmed_names_nvflare_in_an_import():
    files = sorted((ROOT / "fedmed").rglob("*.py"))
    assert len(files) > 30
    bad = [f"{f.relative_to(ROOT)}: {m}" for f in files for m in _imports(f) if m == "nvflare" or m.startswith("nvflare.")]
    assert bad == []


def test_the_static_check_would_catch_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from nvflare.app_common.abstract.fl_model import FLModel\n    import importlib\n"
                 "    importlib.import_module('nvflare.client')\n")
    assert _imports(f) == ["nvflare.app_common.abstract.fl_model", "importlib", "nvflare.client"]


def test_importing_every_fedmed_module_leaves_nvflare_out():
    code = ("import importlib, pkgutil, sys, fedmed\n"
            "names = [m.name for m in pkgutil.walk_packages(fedmed.__path__, 'fedmed.') if not m.name.endswith('__main__')]\n"
            "[importlib.import_module(n) for n in names]\n"
            "print(len(names), sorted(m for m in sys.modules if m == 'nvflare' or m.startswith('nvflare.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    n, mods = out.split(" ", 1)
    assert int(n) > 30 and mods.strip() == "[]"


# the layers of fedmed, lowest first: a module may import from its own layer and those below it, never above
LAYERS = ["core", "data", "algorithms", "nn", "site", "report", "workflows", "methods", "config", "run", "cli"]


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT / "fedmed").parts
    return rel[0] if len(rel) > 1 else path.stem


def _upward_imports(files) -> list[str]:
    bad = []
    for f in files:
        src = _layer(f)
        if src not in LAYERS:
            continue
        for m in _imports(f):
            parts = m.split(".")
            if parts[0] != "fedmed" or len(parts) < 2 or parts[1] not in LAYERS:
                continue
            if LAYERS.index(parts[1]) > LAYERS.index(src):
                bad.append(f"{f.relative_to(ROOT)} ({src}) imports {m}")
    return bad


def test_fedmeds_subpackages_import_only_their_own_layer_and_those_below():
    """core < data < algorithms (the papers' math) < nn < site < report < workflows < methods < config < run < cli —
    also in function-level imports."""
    files = sorted((ROOT / "fedmed").rglob("*.py"))
    assert {_layer(f) for f in files} >= set(LAYERS)
    assert _upward_imports(files) == []


def test_the_layer_check_would_catch_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "fedmed" / "algorithms"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from fedmed.site.runner import SiteRunner\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _upward_imports([pkg / "x.py"]) == ["fedmed/algorithms/x.py (algorithms) imports fedmed.site.runner"]


def test_every_subpackage_has_a_public_face():
    """Each subpackage's ``__init__`` names what it offers (``__all__``), and every name there resolves."""
    code = ("import importlib\n"
            f"for pkg in {LAYERS[:-4] + ['workflows', 'run', 'cli']!r}:\n"
            "    m = importlib.import_module('fedmed.' + pkg)\n"
            "    assert m.__all__, pkg\n"
            "    [getattr(m, n) for n in m.__all__]\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_benchmarks_use_only_public_names_of_fedmed():
    """A benchmark imports what a user could: no ``_private`` name of a fedmed module."""
    bad = []
    for f in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fedmed"):
                bad += [f"{f.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []


def test_one_table_of_methods_for_the_config_and_the_workflows():
    """Every workflow an experiment config can name has one registry entry (server workflow, options, site tasks) and
    one config model, and nothing else; a built-in method's own server workflow is in its own module of
    fedmed/methods/ (#88: they were in fedmed/workflows/, named again in a second table there)."""
    from fedmed.config import WORKFLOWS
    from fedmed.methods import METHODS, server_workflow_path
    from fedmed.workflows import server_workflow

    assert WORKFLOWS is METHODS
    for name, cls in METHODS.items():  # a plugin registered by another test of this process runs its own workflow
        workflow = server_workflow(server_workflow_path(cls))
        # a built-in's own workflow sits in its own module, as a plugin's does (FedAvg's loop is the common base)
        own = {c.__module__ for c in cls.__mro__ if c.__module__.startswith("fedmed.methods.")}  # its base: PACFL's is
        # a plugin's: its own module, or a workflow it inherits from a built-in method (a new kind of signature)
        assert workflow.__module__ in (*((cls.plugin,) if cls.plugin else ()), *own, "fedmed.workflows.fedavg"), name


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_circles(files) -> list[list[str]]:
    """The import circles among ``files`` (modules that reach each other through their imports, function-level ones
    too): the strongly connected components of more than one module (Tarjan)."""
    mods = {_module_name(f): f for f in files}
    graph = {}
    for m, f in mods.items():
        named = set(_imports(f))
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                named |= {f"{node.module}.{a.name}" for a in node.names}  # from package import module
        graph[m] = {d for d in named if d in mods and d != m and not m.startswith(d + ".")}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_fedmed():
    """No two modules of fedmed import each other, directly or through others (``site/runner.py`` and
    ``site/seg.py`` / ``site/mae.py`` did: the reply loop is now ``site/reply.py``)."""
    assert import_circles(sorted((ROOT / "fedmed").rglob("*.py"))) == []


def test_the_circle_check_would_catch_one(tmp_path):
    pkg = tmp_path / "fedmed" / "site"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from fedmed.site.b import g\n")
    (pkg / "b.py").write_text("from fedmed.site import c\n")
    (pkg / "c.py").write_text("import fedmed.site.a\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert import_circles(sorted(pkg.glob("*.py"))) == [["fedmed.site.a", "fedmed.site.b", "fedmed.site.c"]]
    finally:
        ROOT = old


def test_no_import_circle_in_the_flare_adapters_nor_between_them_and_fedmed():
    """fedmed_flare/ is checked as fedmed/ is: ``tracking.py`` and ``mlflow_receiver.py`` imported each other (the
    receivers' policy checks now live in ``destinations.py``, which imports no receiver)."""
    files = sorted((ROOT / "fedmed_flare").glob("*.py"))
    assert len(files) >= 7
    assert import_circles(files + sorted((ROOT / "fedmed").rglob("*.py"))) == []


def test_fedmed_never_imports_its_flare_adapters():
    """The adapters sit above the library: a fedmed module never names fedmed_flare (it starts FLARE jobs by command)."""
    bad = [f"{f.relative_to(ROOT)}: {m}" for f in sorted((ROOT / "fedmed").rglob("*.py")) for m in _imports(f)
           if m.split(".")[0] == "fedmed_flare"]
    assert bad == []


def test_the_circle_check_sees_the_adapters_old_tracking_circle(tmp_path):
    """The layout before: ``tracking.receivers`` imported the MLflow receiver inside a function, and the receiver
    imported ``tracking``'s checks at the top."""
    pkg = tmp_path / "fedmed_flare"
    pkg.mkdir()
    (pkg / "tracking.py").write_text("def receivers():\n    from fedmed_flare.mlflow_receiver import MLflowReceiver\n")
    (pkg / "mlflow_receiver.py").write_text("from fedmed_flare.tracking import check_receiver\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert import_circles(sorted(pkg.glob("*.py"))) == [["fedmed_flare.mlflow_receiver", "fedmed_flare.tracking"]]
    finally:
        ROOT = old


def test_fedmed_flare_imports_nothing_of_the_command_line():
    """#88: the FLARE side (a site's executor, the server's controller, the job builder and runner) imported
    ``fedmed.cli.help`` for a help formatter: two floors up. It needs nothing of the CLI."""
    files = sorted((ROOT / "fedmed_flare").rglob("*.py"))
    assert len(files) > 5
    bad = [f"{f.relative_to(ROOT)}: {m}" for f in files for m in _imports(f) if m == "fedmed.cli" or
           m.startswith("fedmed.cli.")]
    assert bad == []


def test_every_exception_fedmed_defines_derives_from_fedmed_error():
    """#88: 21 exception classes over 6 stdlib bases and no common one, so the CLI caught (ValueError, TypeError,
    OSError, RuntimeError). Every class fedmed (and fedmed_flare) defines that is an exception derives from
    FedmedError, its stdlib base kept as a second parent."""
    code = ("import importlib, inspect, pkgutil, fedmed, fedmed_flare\n"
            "from fedmed.core.errors import FedmedError\n"
            "bad, n = [], 0\n"
            "for pkg in (fedmed, fedmed_flare):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        if m.name.endswith('__main__'): continue\n"
            "        mod = importlib.import_module(m.name)\n"
            "        for name, c in vars(mod).items():\n"
            "            if inspect.isclass(c) and issubclass(c, BaseException) and c.__module__ == m.name:\n"
            "                n += 1\n"
            "                if not issubclass(c, FedmedError): bad.append(m.name + '.' + name)\n"
            "print(n, bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    n, bad = out.split(" ", 1)
    assert int(n) >= 20 and bad.strip() == "[]", out


# ------------------------------------------------------------------ a method owns its slice (#55)

def _name_branches(source: str, names: set) -> list[int]:
    """Lines of ``source`` that compare a ``workflow`` or a ``kind`` (an attribute or a variable of that name, or
    ``.method``) with a built-in method's or signature kind's name, or look one up by name (``METHODS["flux"]``,
    ``method_class("ifca")``)."""
    import ast

    def consts(node):
        return [n.lineno for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names]

    def names_a_workflow(node):
        return any(isinstance(n, ast.Attribute) and n.attr in ("workflow", "method", "kind")
                   or isinstance(n, ast.Name) and n.id in ("workflow", "kind")
                   or isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value == "kind"
                   for n in ast.walk(node))

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_a_workflow(x) for x in [node.left, *node.comparators]):
            out += consts(node)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("METHODS",
                                                                                                     "WORKFLOWS"):
            out += consts(node.slice)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "method_class", "server_workflow", "workflows_for"):
            out += [ln for a in node.args for ln in consts(a)]
    return sorted(out)


def test_no_built_in_method_is_named_outside_its_own_slice():
    """What a method needs elsewhere (checks of the experiment, the files it names, the server's files, how its
    assignment is read back, its part in `fedmed ssl`, its kind of signature: what a site sends, its distance, whether
    it needs labels, its warnings) is a hook of its class or its kind in its own module of fedmed/methods/; no other
    module of fedmed, fedmed_flare or jobs/ compares a workflow or a signature kind with a built-in method's name or
    looks one up by name (#88: ``if kind == "fmcl" ... elif kind == "pacfl"`` stood in the CLI, the clustering math,
    the privacy math and the site's signature task)."""
    from fedmed.algorithms.signatures import SIGNATURE_KINDS
    from fedmed.methods import METHODS

    names = {w for w, c in METHODS.items() if c.plugin is None} | set(SIGNATURE_KINDS)
    assert _name_branches('if m.workflow == "fedbn" and x:\n    pass\nc = METHODS["flux"]\n'
                          'ok = workflow in ("fedmae", "finetune")\nmethod_class("ifca")\n', names) == [1, 3, 4, 4, 5]
    assert _name_branches('kind = sig["kind"]\nif kind == "fmcl":\n    pass\nif sc.kind == "pacfl" and x:\n    pass\n'
                          'y = sig["kind"] in ("fecfl",)\n', names) == [2, 4, 6]  # a signature kind, three ways
    files = [f for f in sorted((ROOT / "fedmed").rglob("*.py")) if "methods" not in f.parts]
    files += sorted((ROOT / "fedmed_flare").rglob("*.py")) + sorted((ROOT / "jobs").rglob("*.py"))
    bad = [f"{f.relative_to(ROOT)}:{ln}" for f in files for ln in _name_branches(f.read_text(), names)]
    assert bad == []
