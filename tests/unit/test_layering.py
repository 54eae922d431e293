"""The layering holds: ``seqplan`` (the framework-free plan both implementations share) and
``parity.core`` (and everything they import) load without any framework; the implementations
never import parity, nor each other; and no first-party module imports a private name of another one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("jax", "jaxlib", "flax", "optax", "torch", "jax_impl", "torch_impl")


def _loaded_after_import(module: str) -> set[str]:
    code = (f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return set(out.stdout.split())


def test_seqplan_loads_without_any_framework_or_implementation():
    """The shared plan (layouts, axes, schedule, validation, strategy, routing) is pure Python
    and NumPy: a fresh interpreter importing every module of it has no framework, no
    implementation and no parity in sys.modules."""
    modules = ["seqplan." + p.stem for p in (ROOT / "seqplan").glob("*.py") if p.stem != "__init__"]
    assert len(modules) >= 4, modules
    loaded = _loaded_after_import(", ".join(["seqplan", *modules]))
    assert "seqplan" in loaded and "numpy" in loaded  # the probe works
    assert not loaded & {*FRAMEWORKS, "parity"}, loaded & {*FRAMEWORKS, "parity"}


def _first_party_imports(folder: str) -> set[tuple[str, str]]:
    """(file, top-level package) of every absolute import in ``folder``."""
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            found |= {(str(path.relative_to(ROOT)), n.split(".")[0]) for n in names}
    return found


def test_imports_run_one_way_between_the_packages():
    """seqplan imports no other first-party package; jax_impl and torch_impl import seqplan but
    never parity, benchmarks or each other; parity.core may import seqplan (not the implementations)."""
    forbidden = {"seqplan": {"jax_impl", "torch_impl", "parity", "benchmarks"},
                 "jax_impl": {"torch_impl", "parity", "benchmarks"},
                 "torch_impl": {"jax_impl", "parity", "benchmarks"},
                 "parity/core": {"jax_impl", "torch_impl", "benchmarks"}}
    bad = [f"{path} imports {package}" for folder, no in forbidden.items()
           for path, package in _first_party_imports(folder) if package in no]
    assert not bad, bad
    for impl in ("jax_impl", "torch_impl"):
        assert any(package == "seqplan" for _, package in _first_party_imports(impl)), impl


def test_core_imports_numpy_but_no_framework():
    """A fresh interpreter importing every core module (and the accounting model and the
    training model, which core-level callers use) has no framework in sys.modules."""
    modules = ["parity.core." + p.stem for p in (ROOT / "parity" / "core").glob("*.py") if p.stem != "__init__"]
    modules += ["parity.accounting.model", "parity.accounting.hlo", "parity.training.traffic_model",
                "parity.training.reference", "parity.training.llama", "parity.capacity.bstar"]
    loaded = _loaded_after_import(", ".join(modules))
    assert "numpy" in loaded  # the probe works
    assert not loaded & set(FRAMEWORKS), loaded & set(FRAMEWORKS)


def test_runners_and_cli_import_without_frameworks():
    """Framework imports are lazy above the core too: the CLI and both runners load without
    jax or torch, so a missing framework is a skipped side, not an ImportError."""
    loaded = _loaded_after_import("parity.cli, parity.runners.jax_runner, parity.runners.torch_runner, "
                                  "parity.runners.pipeline, parity.probes.notebook_helpers, parity.checks.traffic")
    assert not loaded & set(FRAMEWORKS), loaded & set(FRAMEWORKS)


def test_no_first_party_module_imports_a_private_first_party_name():
    """Shared machinery is public (e.g. ``loop.py``, ``schedule.py``, ``torch_world.make_mesh``):
    an underscore name is private to its module, in every first-party package."""
    first_party = ("seqplan", "parity", "jax_impl", "torch_impl", "benchmarks")
    bad = []
    for path in (p for folder in first_party for p in (ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in first_party):
                bad += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names if a.name.startswith("_")]
                if any(part.startswith("_") and part != "__future__" for part in (node.module or "").split(".")):
                    bad.append(f"{path.relative_to(ROOT)}: module {node.module}")
    assert not bad, bad


def test_lower_layers_do_not_import_higher_ones():
    """core imports nothing else of parity; accounting only core; runners not training, capacity,
    probes, checks or the CLI; nothing imports the CLI."""
    allowed = {"core": {"core"}, "accounting": {"core", "accounting"},
               "runners": {"core", "accounting", "runners"},
               "training": {"core", "accounting", "runners", "training"},
               "capacity": {"core", "accounting", "runners", "training", "capacity"},
               "probes": {"core", "accounting", "runners", "probes"},
               "checks": {"core", "accounting", "runners", "training", "checks"}}
    bad = []
    for layer, ok in allowed.items():
        for path in (ROOT / "parity" / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level >= 1:
                    target = layer if node.level == 1 else (node.module or "").split(".")[0]
                    if node.level == 2 and target not in ok:
                        bad.append(f"{path.relative_to(ROOT)} imports parity.{node.module}")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("parity."):
                    if node.module.split(".")[1] not in ok:
                        bad.append(f"{path.relative_to(ROOT)} imports {node.module}")
    assert not bad, bad
