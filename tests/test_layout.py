"""The package's shape: the mechanisms stand alone (each one file a user can copy), imports
point one way only, from the command line down to the mechanisms, and no module imports, at
load time or inside a function, anything that imports it back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hookbench"
MECHANISMS = ("optimizer_in_backward", "activation_capture", "zero2", "activation_offload")
# The layers, lowest first: a module may import its own layer and those below, never above.
LAYERS = {
    "mechanisms": MECHANISMS,
    "foundations": ("prerequisites", "launch", "leak_guard", "vision", "mup", "workload"),
    "models": ("zoo",),
    "measurement": ("parity", "memory", "hook_contract", "saved_tensor_contract", "coord_check",
                    "faults", "zero2_runs",
                    "zero_paper", "plot", "peers", "peers.microsoft_mup",
                    "peers.deepspeed_zero2"),
    "gate": ("checks", "baselines", "checkpoints", "collectives", "compiled_hooks",
             "emitted_warnings", "workload_checks", "gate"),
    "interface": ("report", "cli", "__main__", "pytest_plugin", ""),
}
LAYER = {f"hookbench.{m}".rstrip("."): i for i, (_, modules) in enumerate(LAYERS.items())
         for m in modules}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The hookbench modules ``path`` imports anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "hookbench"}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"  # absolute, by convention
            if node.module and node.module.split(".")[0] == "hookbench":
                # "from hookbench import zero2" names a module; "from hookbench.x import y" x
                found |= ({f"{node.module}.{a.name}" for a in node.names}
                          if node.module == "hookbench" else {node.module})
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
    assert _imports(PACKAGE / f"{mechanism}.py") == set()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_mechanism_file_works_copied_out_of_the_package(mechanism, tmp_path):
    # Copied under another name into a folder of the user's, with hookbench unimportable.
    copy = tmp_path / f"my_{mechanism}.py"
    copy.write_text((PACKAGE / f"{mechanism}.py").read_text())
    code = ("import sys; sys.modules['hookbench'] = None; import my_{0}; "
            "assert not [m for m in sys.modules if m.startswith('hookbench.')]").format(mechanism)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert {"hookbench.gate", "hookbench.zero2_runs", "hookbench.peers.microsoft_mup"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({list(LAYERS)[LAYER[a]]}) imports {b} ({list(LAYERS)[LAYER[b]]})"
                  for a, imported in graph.items() for b in imported if LAYER[b] > LAYER[a])


@pytest.mark.smoke
def test_every_module_has_a_layer_and_imports_point_down():
    graph = _graph()
    assert sorted(set(graph) - set(LAYER)) == []  # a new module is placed on purpose
    assert sorted(set(LAYER) - set(graph)) == []
    assert _upward(graph) == []


def test_the_layer_check_finds_an_upward_import():
    # What issue 14 found: the gate taking the report's constants from the command line layer.
    graph = _graph()
    graph["hookbench.gate"] = graph["hookbench.gate"] | {"hookbench.report"}
    assert _upward(graph) == ["hookbench.gate (gate) imports hookbench.report (interface)"]


def test_the_cycle_finder_finds_a_cycle():
    # The check above must be able to fail: zero2 importing its harness back is the cycle this
    # layout removed (zero2 -> parity -> zero2 before).
    graph = _graph()
    graph["hookbench.zero2"] = graph["hookbench.zero2"] | {"hookbench.zero2_runs"}
    cycle = _cycle(graph)
    assert cycle[0] == cycle[-1] and {"hookbench.zero2", "hookbench.zero2_runs"} <= set(cycle)
    assert all(b in graph[a] for a, b in zip(cycle, cycle[1:]))


@pytest.mark.parametrize("helper", ["reentrant_checkpoint_in_graph", "unnamed", "_is_named"])
def test_the_helpers_zero2_copies_match_their_originals(helper):
    # Copied so that zero2.py stands alone; a fix to one copy must reach the other.
    def body(module: str) -> list[str]:
        tree = ast.parse((PACKAGE / f"{module}.py").read_text())
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
            "OptimizerInBackward, Workload, Zero2)] == ['hookbench.activation_capture', "
            "'hookbench.activation_offload', 'hookbench.optimizer_in_backward', "
            "'hookbench.workload', 'hookbench.zero2']; "
            "import hookbench as h; assert sorted(h.__all__) == h.__all__ and set(h.__all__) <= "
            "set(dir(h))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with pytest.raises(AttributeError, match="has no attribute 'Zero3'"):
        import hookbench

        hookbench.Zero3  # noqa: B018
