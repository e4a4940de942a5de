"""The package's shape: one folder per layer, lowest first ``mechanisms`` (each one file a user
can copy), ``core``, ``models``, ``measure``, ``gate``, then the interface: ``cli`` (a module
per subcommand) with the package's top modules (the report, the plugin). A module's layer is its folder, so a new module is placed
by where it is saved; imports point one way only, down, and no module imports, at load time or
inside a function, anything that imports it back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hookbench"
# The layers, lowest first: a module may import its own layer and those below, never above.
# The last, the interface, holds the package's top modules too.
LAYERS = ("mechanisms", "core", "models", "measure", "engines", "gate", "cli")
MECHANISMS = tuple(sorted(p.stem for p in (PACKAGE / "mechanisms").glob("*.py")
                          if p.stem != "__init__"))


def _layer(module: str) -> int:
    parts = module.split(".")[1:]  # hookbench.measure.peers.x: measure
    folder = parts[0] if len(parts) > 1 or (parts and parts[0] in LAYERS) else LAYERS[-1]
    return LAYERS.index(folder)


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The hookbench modules ``path`` imports anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "hookbench"}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"  # absolute, by convention
            if node.module and node.module.split(".")[0] == "hookbench":
                # "from hookbench.measure.peers import deepspeed_zero2" names a module (the one
                # the cycle faults -> deepspeed_zero2 -> zero2_runs -> faults went through,
                # unseen while only "from hookbench import x" was read so); "from
                # hookbench.x import y", y a name in it, names x
                found |= {f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}")
                          else node.module for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:  # on the current path: back to it is a cycle
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_mechanism_imports_nothing_from_hookbench(mechanism):
    assert _imports(PACKAGE / "mechanisms" / f"{mechanism}.py") == set()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_mechanism_file_works_copied_out_of_the_package(mechanism, tmp_path):
    # Copied under another name into a folder of the user's, with hookbench unimportable.
    copy = tmp_path / f"my_{mechanism}.py"
    copy.write_text((PACKAGE / "mechanisms" / f"{mechanism}.py").read_text())
    code = ("import sys; sys.modules['hookbench'] = None; import my_{0}; "
            "assert not [m for m in sys.modules if m.startswith('hookbench.')]").format(mechanism)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert {"hookbench.gate", "hookbench.measure.zero2_runs",
            "hookbench.measure.peers.microsoft_mup"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _upward(graph: dict[str, set[str]]) -> list[str]:
    def named(module: str) -> str:
        layer = _layer(module)
        return f"{module} ({'interface' if layer == len(LAYERS) - 1 else LAYERS[layer]})"

    return sorted(f"{named(a)} imports {named(b)}" for a, imported in graph.items()
                  for b in imported if _layer(b) > _layer(a))


@pytest.mark.smoke
def test_every_folder_is_a_layer_and_imports_point_down():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(LAYERS)  # a new folder is a new layer: placed on purpose
    assert MECHANISMS == ("activation_capture", "activation_offload", "optimizer_in_backward",
                          "zero2")
    assert _upward(_graph()) == []


def test_the_layer_check_finds_an_upward_import():
    # What issue 14 found: the gate taking the report's constants from the command line layer.
    graph = _graph()
    graph["hookbench.gate"] = graph["hookbench.gate"] | {"hookbench.report"}
    assert _upward(graph) == ["hookbench.gate (gate) imports hookbench.report (interface)"]
    # and within the layers: a mechanism taking the workload from the layer above it
    graph = _graph()
    graph["hookbench.mechanisms.zero2"] |= {"hookbench.core.workload"}
    assert _upward(graph) == ["hookbench.mechanisms.zero2 (mechanisms) imports "
                              "hookbench.core.workload (core)"]


def test_an_import_of_a_submodule_from_its_package_is_an_edge(tmp_path):
    # The form the faults -> deepspeed_zero2 -> zero2_runs -> faults cycle hid behind.
    source = tmp_path / "m.py"
    source.write_text("from hookbench.measure.peers import deepspeed_zero2\n"
                      "from hookbench.measure.parity import compare\n")
    assert _imports(source) == {"hookbench.measure.peers.deepspeed_zero2",
                                "hookbench.measure.parity"}


def test_the_cycle_finder_finds_a_cycle():
    # The check above must be able to fail: zero2 importing its harness back is the cycle this
    # layout removed (zero2 -> parity -> zero2 before).
    graph = _graph()
    graph["hookbench.mechanisms.zero2"] |= {"hookbench.measure.zero2_runs"}
    cycle = _cycle(graph)
    assert cycle[0] == cycle[-1]
    assert {"hookbench.mechanisms.zero2", "hookbench.measure.zero2_runs"} <= set(cycle)
    assert all(b in graph[a] for a, b in zip(cycle, cycle[1:]))


@pytest.mark.parametrize("helper", ["reentrant_checkpoint_in_graph", "unnamed", "_is_named"])
def test_the_helpers_zero2_copies_match_their_originals(helper):
    # Copied so that zero2.py stands alone; a fix to one copy must reach the other.
    def body(module: str) -> list[str]:
        tree = ast.parse((PACKAGE / "mechanisms" / f"{module}.py").read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == helper)
        statements = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(
            fn.body[0].value, ast.Constant) else fn.body  # without the docstring
        return [ast.dump(s) for s in statements]

    assert body("zero2") == body("optimizer_in_backward")


def test_the_public_names_import_from_the_top_and_only_when_used():
    # `import hookbench` (the plugin's entry point does) must not import torch; each name is
    # its mechanism's own class, loaded on first use.
    code = ("import sys, hookbench; assert 'torch' not in sys.modules, 'torch at import'; "
            "from hookbench import ActivationCapture, ActivationOffload, OptimizerInBackward, "
            "Workload, Zero2; "
            "assert [c.__module__ for c in (ActivationCapture, ActivationOffload, "
            "OptimizerInBackward, Workload, Zero2)] == ["
            "'hookbench.mechanisms.activation_capture', "
            "'hookbench.mechanisms.activation_offload', "
            "'hookbench.mechanisms.optimizer_in_backward', "
            "'hookbench.core.workload', 'hookbench.mechanisms.zero2']; "
            "import hookbench as h; assert sorted(h.__all__) == h.__all__ and set(h.__all__) <= "
            "set(dir(h))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(AttributeError, match="has no attribute 'Zero3'"):
        import hookbench

        hookbench.Zero3  # noqa: B018


def _unmirrored(tests: Path, package: Path) -> list[str]:
    """tests/'s folders that are no folder of the package: the tests mirror its layers."""
    def folders(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*")
                if p.is_dir() and "__pycache__" not in p.parts}

    return sorted(folders(tests) - folders(package))


def test_the_tests_mirror_the_package(tmp_path):
    tests = PACKAGE.parent / "tests"
    assert _unmirrored(tests, PACKAGE) == []
    assert {p.name for p in tests.iterdir() if p.is_dir()} >= set(LAYERS)  # every layer tested
    # and the check sees a folder of tests that is none of the package's
    (tmp_path / "gate").mkdir()
    (tmp_path / "misc").mkdir()
    assert _unmirrored(tmp_path, PACKAGE) == ["misc"]
