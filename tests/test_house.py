"""The package's import structure, read from the code: floors, no circle, no private reach-in.

Every import counts (module level, inside functions and under ``TYPE_CHECKING``), as in
``shared/tools/house.py``: each one is a dependency a reader must hold in mind. ``FLOORS`` lists the
package's modules, bottom floor first: a new module must be given its floor here.
Within the listed modules an import may only go to the same floor or one below, never up, the graph
has no circle, and no module reaches into another module's private members. Drawn package by package
(``PACKAGE_FLOORS``), no import runs up a package floor either, and no engine module imports a wing.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "src" / "mirrorax"

#: Bottom floor first. A module may import modules of its own floor (no circle) or of a floor below.
FLOORS: list[tuple[str, ...]] = [
    ("_checks", "_host", "_version", "front_end", "steps", "steps.first_call", "steps.binding",
     "steps.distributed_batch", "cluster.output",
     "cluster.discovery", "cluster.watchdog", "cluster.failure", "cluster.preemption", "cluster.verdict",
     "cluster.ray_wait", "integrity",
     "checkpoint.integrity_item", "checkpoint.orbax_quirks", "checkpoint.dir_lock", "checkpoint.snapshot_io",
     "checkpoint.errors", "checkpoint.storage", "checkpoint.stored", "checkpoint.record", "checkpoint.policy",
     "cluster.restarts", "keras", "keras._internals", "keras.callbacks", "keras.env", "steps.replica", "batch_sums",
     "results", "train_state", "as_made", "fit", "fit.hooks", "fit.progress", "fit.cache", "traffic",
     "fit.utilisation", "fit.auto_steps"),
    ("cluster.ray_train", "cluster.join", "cluster", "cluster.standby", "cluster.launch", "cluster.resolver",
     "checkpoint.job", "checkpoint.reader"),
    ("cluster.consistency", "checkpoint.snapshot"),
    ("mesh",),
    ("steps.dispatch", "steps.padding", "keras.masking", "steps.split_merge", "steps.held", "steps.stateful",
     "keras.stateful",
     "nnx.split_merge"),
    ("inputs.checks", "inputs", "inputs.source", "inputs.batch", "inputs.position", "inputs.reading", "keras.order",
     "keras.data",
     "inputs.streams", "inputs.placement", "inputs.prefetch", "inputs.arrays", "inputs.iterables", "inputs.make",
     "inputs.distributed"),
    ("models", "models.base", "models.loss_scale", "keras.targets", "keras.metrics", "keras.custom",
     "models.functional", "keras.adapter", "keras.front_end", "nnx.model", "models.adapters"),
    ("strategy",),
    ("fit.functions",),
    ("fit.device_state",),
    ("checkpoint.checkpointer", "checkpoint", "keras.checkpoint"),
    ("checkpoint.resume",),
    ("fit.epoch", "fit.elastic", "fit.saving", "fit.meter"),
    ("fit.planner", "fit.fit_plan", "fit.loop"),
    ("trainer",),
    ("keras.fit",),
    ("nnx",),  # the Flax NNX wing's door (imports flax); its modules stand on the engine's floors
    ("mirrorax",),  # the package's __init__: the public API, re-exported
    ("zoo",),
    ("cli",),
    ("__main__",),  # python -m mirrorax: the cli, run
]
FLOOR = {m if m == "mirrorax" else f"mirrorax.{m}": i for i, floor in enumerate(FLOORS) for m in floor}
#: Names whose private members belong to another module's object (as the house tool reads them).
OWNERS = ("strategy", "trainer", "adapter", "source", "stream", "state", "saver", "checkpointer", "mesh",
          "window")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        out[name] = f
    return out


def scan(name: str, text: str, modules: set[str]) -> tuple[set[str], list[str]]:
    """The package modules that module ``name`` imports, and its reaches into private members."""

    def target(dotted: str) -> str:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    imports: set[str] = set()
    reaches: list[str] = []
    aliases: set[str] = set()  # names bound to a package module here (``import mirrorax.cluster.join as cluster``)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mirrorax":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    imports.add(full)
                    aliases.add(a.asname or a.name)
                    continue
                imports.add(target(node.module))
                if a.name.startswith("_") and not a.name.startswith("__"):
                    reaches.append(f"{name}:{node.lineno} imports {full}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mirrorax":
                    imports.add(target(a.name))
                    if a.asname:
                        aliases.add(a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base in ("self", "cls"):
                continue
            if base in aliases or any(k in base.lower() for k in OWNERS):
                reaches.append(f"{name}:{node.lineno} reaches {base}.{node.attr}")
    imports.discard(name)
    imports.discard("")
    return imports, reaches


@pytest.fixture(scope="module")
def house() -> dict[str, tuple[set[str], list[str]]]:
    modules = _modules()
    names = set(modules)
    return {m: scan(m, f.read_text(), names) for m, f in modules.items()}


def test_every_listed_module_exists(house):
    assert set(FLOOR) <= set(house), sorted(set(FLOOR) - set(house))


def test_every_module_has_a_floor(house):
    # A module added without a floor would escape every check below.
    assert set(house) <= set(FLOOR), f"give these modules a floor in FLOORS: {sorted(set(house) - set(FLOOR))}"


def test_no_import_runs_up_a_floor_or_out_of_the_rebuilt_house(house):
    def where(t: str) -> str:
        return f"floor {FLOOR[t]}" if t in FLOOR else "not rebuilt yet"

    wrong = [f"{m} (floor {FLOOR[m]}) imports {t} ({where(t)})"
             for m in FLOOR for t in sorted(house[m][0]) if t not in FLOOR or FLOOR[t] > FLOOR[m]]
    assert not wrong, "\n".join(wrong)


def test_no_circle_among_the_rebuilt_modules(house):
    graph = {m: sorted(t for t in house[m][0] if t in FLOOR) for m in FLOOR}
    assert find_circle(graph) is None, find_circle(graph)


def test_no_private_reach_in(house):
    reaches = [r for m in FLOOR for r in house[m][1]]
    assert not reaches, "\n".join(reaches)


def test_every_module_is_in_the_test_index(house):
    # tests/README.md's "Which file tests what": a reader finds a module's tests from its name.
    readme = (ROOT.parent.parent / "tests" / "README.md").read_text()
    table = readme.split("## Which file tests what", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ", 1) for line in table.splitlines() if line.startswith("| ") and " | " in line]
    named = {m for first, _ in rows for m in re.findall(r"`([\w.]+)`", first)}
    missing = sorted(m for m in house if (m if m == "mirrorax" else m.removeprefix("mirrorax.")) not in named)
    assert not missing, f"name these modules in tests/README.md's index: {missing}"
    files = {f for _, rest in rows for f in re.findall(r"`(test_\w+\.py)`", rest)}
    absent = sorted(f for f in files if not (ROOT.parent.parent / "tests" / f).exists())
    assert not absent, f"tests/README.md's index names files that do not exist: {absent}"


#: The house drawn package by package (a package, or a top-level module), bottom floor first: a package may
#: import packages of its own floor or below, so a reader learns the packages in this order.
PACKAGE_FLOORS: list[tuple[str, ...]] = [
    ("_checks", "_host", "_version", "front_end", "integrity", "results", "batch_sums", "train_state", "as_made",
     "traffic"),
    ("cluster",),  # the job's processes: joining, discovery, launch, failure, restarts
    ("mesh",),
    ("steps",),  # the dispatch window, strategy.jit / run and their batches
    ("inputs", "models"),
    ("checkpoint",),
    ("strategy",),
    ("fit",),  # the Trainer's parts: its steps, fit's preparation, the loop
    ("trainer",),
    ("keras", "nnx"),  # the wings
    ("mirrorax", "zoo"),
    ("cli",),
    ("__main__",),
]
PACKAGE_FLOOR = {p: i for i, floor in enumerate(PACKAGE_FLOORS) for p in floor}


def package_of(module: str) -> str:
    """The package (or top-level module) ``module`` belongs to: ``mirrorax.fit.loop`` -> ``fit``."""
    return "mirrorax" if module == "mirrorax" else module.split(".")[1]


def package_climbs(house: dict[str, tuple[set[str], list[str]]]) -> list[str]:
    """Every import from one package to another on a higher package floor, as ``"module (pkg, floor i) imports
    target (pkg, floor j)"``."""
    out = []
    for m, (imports, _) in sorted(house.items()):
        a = package_of(m)
        for t in sorted(imports):
            b = package_of(t)
            if a != b and PACKAGE_FLOOR[b] > PACKAGE_FLOOR[a]:
                out.append(f"{m} ({a}, floor {PACKAGE_FLOOR[a]}) imports {t} ({b}, floor {PACKAGE_FLOOR[b]})")
    return out


def test_every_package_has_a_package_floor(house):
    packages = {package_of(m) for m in house}
    assert packages == set(PACKAGE_FLOOR), (f"unfloored: {sorted(packages - set(PACKAGE_FLOOR))}; "
                                           f"listed but absent: {sorted(set(PACKAGE_FLOOR) - packages)}")


def test_no_import_runs_up_a_package_floor(house):
    climbs = package_climbs(house)
    assert not climbs, "\n".join(climbs)
    graph: dict[str, set[str]] = {}
    for m, (imports, _) in house.items():
        graph.setdefault(package_of(m), set()).update(package_of(t) for t in imports)
    graph = {p: sorted(t for t in ts if t != p) for p, ts in graph.items()}
    assert find_circle(graph) is None, find_circle(graph)


def test_the_package_check_sees_an_import_up_a_package_floor():
    # The check above can fail: the dispatch window's own source with an import of fit's loop added is reported.
    modules = set(_modules())
    text = (ROOT / "steps" / "dispatch.py").read_text() + "\ndef f():\n    from mirrorax.fit import loop\n"
    climbs = package_climbs({"mirrorax.steps.dispatch": scan("mirrorax.steps.dispatch", text, modules)})
    assert climbs == ["mirrorax.steps.dispatch (steps, floor 3) imports mirrorax.fit.loop (fit, floor 7)"], climbs


#: The front-ends' wings: each stands on the engine's floors, and no engine module stands on them.
WINGS = ("mirrorax.keras", "mirrorax.nnx")


def _in_wing(module: str) -> bool:
    return any(module == w or module.startswith(f"{w}.") for w in WINGS)


#: The engine's modules that may import a wing: the package's ``__init__``, which re-exports the public API and
#: registers each wing lazily (``front_end.register_lazy``: its record and its split/merge protocol).
REGISTRATION_POINTS = {"mirrorax"}


def wing_imports(house: dict[str, tuple[set[str], list[str]]]) -> list[str]:
    """Every import of a wing's module by an engine module (any module outside the wings but the
    registration points), as ``"module imports wing.module"``."""
    return [f"{m} imports {t}" for m, (imports, _) in sorted(house.items())
            if not _in_wing(m) and m not in REGISTRATION_POINTS for t in sorted(imports) if _in_wing(t)]


def test_the_engine_imports_no_wing(house):
    # The engine reaches a front-end only through what the package registers (front_end.register_lazy: its
    # record, with adapter, callbacks, metric masking, BackupAndRestore's epoch, and its split/merge protocol),
    # and through the objects handed to it (mx.Trainer(reading=...)).
    wrong = wing_imports(house)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("added", [
    "from mirrorax.keras import _internals as keras_internals\n",
    "def f():\n    from mirrorax.keras.order import pass_order\n",
    "if TYPE_CHECKING:\n    import mirrorax.nnx.model\n",
    "from mirrorax.nnx import NnxModel\n",
])
def test_the_wing_check_sees_an_engine_module_import_a_wing(added):
    # The check above can fail: the loop's own source with one import of a wing added is reported.
    modules = set(_modules())
    text = (ROOT / "fit" / "loop.py").read_text() + "\n" + added
    house = {"mirrorax.fit.loop": scan("mirrorax.fit.loop", text, modules),
             "mirrorax": scan("mirrorax", added, modules)}
    wrong = wing_imports(house)
    assert len(wrong) == 1 and wrong[0].startswith("mirrorax.fit.loop imports mirrorax.") and \
        _in_wing(wrong[0].split()[-1]), wrong
    loop = scan("mirrorax.fit.loop", (ROOT / "fit" / "loop.py").read_text(), modules)
    assert not wing_imports({"mirrorax.fit.loop": loop})


#: The one module that may import ``keras.src`` and read private members of Keras objects.
DOOR = "mirrorax.keras._internals"
#: Private members read outside the door that are not Keras's (module, what is read): the standard library's
#: (``threading._register_atexit``: the one hook that runs before Python stops its executors, which Orbax's
#: last save of a program needs), and JAX's cluster registry behind ``cluster.discovery``'s own accessor.
NOT_KERAS = {("mirrorax.cluster.failure", "os._exit"), ("mirrorax.cluster.discovery", "os._Environ"),
             # A Flax Variable's value slot, written past Flax's per-write trace check after a held call (the
             # check costs more than the step on small models; mirrorax.nnx.split_merge.NnxHeld.write)
             ("mirrorax.nnx.split_merge", "object.__setattr__(variable, '_raw_value')"),
             # mirrorax's own cache on a Keras model (its trainer), set past Keras's attribute tracking
             ("mirrorax.keras.fit", "object.__setattr__(model, '_mirrorax_trainer')"),
             ("mirrorax.checkpoint.orbax_quirks", "getattr(threading, '_register_atexit')"),
             ("mirrorax.cluster.discovery",
              "getattr(getattr(private_jax('clusters'), 'ClusterEnv', None), '_cluster_types')"),
             # Ray Train's elastic policy counting only the live nodes' workers, and set in its controller: the
             # two methods of Ray's own classes that a subclass overrides (mirrorax.cluster.ray_train)
             ("mirrorax.cluster.ray_train", "super()._count_possible_workers"),
             ("mirrorax.cluster.ray_train", "super()._initialize_and_run_controller")}


def private_reaches(name: str, text: str) -> list[str]:
    """Where module ``name`` imports ``keras.src`` or reads a private member of anything but ``self`` / ``cls``.

    A module cannot tell a Keras object from another by its name (``model``, ``v``, ``holder``), so outside
    the door no private member of a foreign object is read at all: ``x._name`` (read, assigned or deleted),
    ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr`` with a private name, and any import of ``keras.src``
    (module level or in a function).
    """
    found = []
    for node in ast.walk(ast.parse(text)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(m == "keras.src" or m.startswith("keras.src.") for m in modules):
            found.append(f"{name}:{node.lineno} imports keras.src")
            continue
        what = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                and ast.unparse(node.value) not in ("self", "cls"):
            what = ast.unparse(node)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "getattr", "hasattr", "setattr", "delattr", "object.__setattr__", "object.__getattribute__",
                "object.__delattr__") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                node.args[1].value.startswith("_") and not node.args[1].value.startswith("__") and \
                ast.unparse(node.args[0]) not in ("self", "cls"):
            what = f"{ast.unparse(node.func)}({ast.unparse(node.args[0])}, {node.args[1].value!r})"
        if what is not None and (name, what) not in NOT_KERAS:
            found.append(f"{name}:{node.lineno} reads {what}")
    return found


def test_keras_internals_are_reached_through_the_door_alone():
    # Every reach into Keras's internals is a named function of mirrorax/keras/_internals.py: a Keras release
    # that moves one is mended there. Elsewhere: call the door's function, or add one to it.
    reaches = [r for m, f in _modules().items() if m != DOOR for r in private_reaches(m, f.read_text())]
    assert not reaches, "\n".join(reaches)


@pytest.mark.parametrize(("source", "found"), [
    ("from keras.src.trainers.trainer import Trainer\n", ["imports keras.src"]),
    ("def f():\n    import keras.src.utils as u\n", ["imports keras.src"]),
    ("from keras import src\n", ["imports keras.src"]),
    ("def f(model):\n    return model._compile_loss\n", ["reads model._compile_loss"]),
    ("def f(v, a):\n    v._value = a\n", ["reads v._value"]),
    ("def f(self):\n    return self.model._compile_loss\n", ["reads self.model._compile_loss"]),
    ("def f(m):\n    return getattr(m, '_jax_state', None)\n", ["reads getattr(m, '_jax_state')"]),
    ("def f(layer):\n    del layer._moments\n", ["reads layer._moments"]),
    ("import keras\ndef f(self, v):\n    return self._x, v.value, keras.ops, getattr(v, 'name'), v.__class__\n", []),
])
def test_the_door_check_sees_a_reach(source, found):
    # The check above can fail: each of these, in any module but the door, is a reach it reports.
    assert [r.split(" ", 1)[1] for r in private_reaches("mirrorax.somewhere", source)] == found


def find_circle(graph: dict[str, list[str]]) -> list[str] | None:
    """One circle of ``graph`` (as the modules along it), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in graph.get(v, ()):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        path.pop()
        return None

    for v in graph:
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_scan_sees_what_it_checks():
    # The checks above can fail: a circle, a private import, a reach through a module alias or an owner.
    assert find_circle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_circle({"a": ["b"], "b": []}) is None
    modules = {"mirrorax", "mirrorax.cluster.join", "mirrorax.mesh"}
    imports, reaches = scan("mirrorax.mesh", (
        "import mirrorax.cluster.join as cluster\n"
        "from mirrorax.cluster.join import _client\n"
        "def f(strategy):\n"
        "    if TYPE_CHECKING: from mirrorax import mesh\n"
        "    return cluster._state, strategy._window, self._own\n"), modules)
    assert imports == {"mirrorax.cluster.join"}
    assert [r.split(" ", 1)[1] for r in reaches] == [
        "imports mirrorax.cluster.join._client", "reaches cluster._state", "reaches strategy._window"]
