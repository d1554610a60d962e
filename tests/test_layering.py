"""The layering of the package (README, "Layout"), checked on the source: engine (core,
scalify, ops, unit) -> probe -> store -> analysis -> viz -> notebook / report /
verification -> run_view (``ss.open_run``'s conveniences) -> the package root (``import
scalescope as ss``) -> the CLI. Each part imports only parts before it; data flows one
way. Every import counts, also one inside a function or under ``TYPE_CHECKING``. Within
the package only the CLI reaches the top-level folders `app/` and `sample_models/`;
`app/` reaches neither the CLI nor `sample_models/`, and `sample_models/` does not
import `app/` (the CLI hands the demo `app.serve`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "scalescope"

#: Parts of the package (a sub-package or a top-level module of `scalescope`), lowest
#: first; a part may import itself, a part of a lower rank, and `_version` (a leaf).
#: Parts on one rank do not import each other.
RANKS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("scalify",),
    ("ops",),
    ("unit",),
    ("probe",),
    ("store",),
    ("analysis",),
    ("viz",),
    ("notebook", "report", "verification"),
    ("run_view",),
    ("__init__",),
    ("cli",),
    ("__main__",),  # python -m scalescope: the CLI
)
LEAVES = ("_version",)
RANK = {part: i for i, parts in enumerate(RANKS) for part in parts}
TOP_LEVEL = ("app", "sample_models")


def module_name(path: Path, root: Path = ROOT) -> tuple[str, ...]:
    parts = path.relative_to(root).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported(path: Path, root: Path = ROOT) -> list[tuple[int, tuple[str, ...]]]:
    """``(line, dotted name as parts)`` of every module ``path`` imports, relative imports
    resolved (``from . import x`` names ``package.x``: x may be a module)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, tuple(a.name.split("."))) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            else:
                base = ()
            module = base + tuple((node.module or "").split(".") if node.module else ())
            out += [(node.lineno, module + (a.name,)) for a in node.names if a.name != "*"]
    return out


def part_of(module: tuple[str, ...]) -> str | None:
    """The part of `scalescope` (or the top-level folder) a dotted name belongs to; None
    for a third-party or standard-library module."""
    if module[0] in TOP_LEVEL:
        return module[0]
    if module[0] != "scalescope":
        return None
    if len(module) == 1:
        return "__init__"
    if module[1] in TOP_LEVEL:  # installed as scalescope.app, scalescope.sample_models
        return module[1]
    if module[1] in RANK or module[1] in LEAVES:
        return module[1]
    return "__init__"  # a name imported from the package root (``from scalescope import x``)


def sources(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """What ``path`` imports against the layering, one line each (empty: nothing)."""
    own = part_of(module_name(path, root))
    bad = []
    for line, module in imported(path, root):
        part = part_of(module)
        if part is None or part == own or part in LEAVES:
            continue
        where = f"{path.relative_to(root)}:{line} imports {'.'.join(module)}"
        if own in TOP_LEVEL:
            if part == "cli":
                bad.append(f"{where} (the CLI is the top)")
            elif own == "app" and part == "sample_models":
                bad.append(f"{where} (app/ does not reach sample_models/)")
            elif own == "sample_models" and part == "app":
                bad.append(f"{where} (only the CLI imports app/; the demo is handed app.serve)")
            continue
        if part in TOP_LEVEL:
            if own != "cli":
                bad.append(f"{where} (only the CLI imports {part}/)")
            continue
        if RANK[part] >= RANK[own]:
            bad.append(f"{where} ({own} sits below {part})")
    return bad


def test_every_part_of_the_package_is_ranked() -> None:
    """A new sub-package or top-level module must be placed in `RANKS` (or `LEAVES`)."""
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    parts |= {p.stem for p in PACKAGE.glob("*.py")}
    assert parts - set(RANK) - set(LEAVES) == set()


@pytest.mark.parametrize("part", [p for parts in RANKS for p in parts] + list(TOP_LEVEL))
def test_imports_go_down_only(part: str) -> None:
    if part in TOP_LEVEL:
        folder = ROOT / part
        files = sources(folder)
    elif (PACKAGE / part).is_dir():
        files = sources(PACKAGE / part)
    else:
        files = [PACKAGE / f"{part}.py"]
    assert files
    bad = [v for path in files for v in violations(path)]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize(
    ("part", "forbidden"),
    [
        ("store", ("analysis", "viz", "notebook", "report", "run_view", "app")),
        ("analysis", ("viz", "notebook", "report", "run_view", "app")),
        ("viz", ("notebook", "report", "run_view", "app")),
    ],
)
def test_storage_and_analysis_know_no_views(part: str, forbidden: tuple[str, ...]) -> None:
    """The brief of issue 17: the run store is pure storage, analysis draws nothing, the
    figures know no page (spelled out, on top of the rank check)."""
    hits = [
        f"{path.relative_to(ROOT)}:{line} imports {'.'.join(module)}"
        for path in sources(PACKAGE / part)
        for line, module in imported(path)
        if part_of(module) in forbidden
    ]
    assert hits == [], "\n".join(hits)


def test_no_part_imports_jax_internals() -> None:
    """Public JAX only (`jax`, `jax.extend`, `jax.experimental`, ...): `jax._src` moves
    between releases. A primitive JAX does not export is reached through its public
    function (`registry.primitive_in`) or the equation that binds it (`with_primitive`)."""
    folders = [PACKAGE, *(ROOT / p for p in TOP_LEVEL)]
    hits = [
        f"{path.relative_to(ROOT)}:{line} imports {'.'.join(module)}"
        for folder in folders
        for path in sources(folder)
        for line, module in imported(path)
        if module[:2] == ("jax", "_src")
    ]
    assert hits == [], "\n".join(hits)


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    """Lazy imports inside methods (how the reader used to reach the notebook and the
    analysis), absolute or relative, count; an import of a lower part does not."""
    store = tmp_path / "scalescope" / "store"
    store.mkdir(parents=True)
    (store / "reader.py").write_text(
        "from . import layout\n"
        "from ..core import formats\n"
        "class RunReader:\n"
        "    def hist(self):\n"
        "        from scalescope.notebook import hist_series\n"
        "    def advise(self):\n"
        "        from ..analysis import advise_run\n"
        "        from .. import viz\n"
    )
    bad = violations(store / "reader.py", root=tmp_path)
    assert len(bad) == 3, bad
    assert "scalescope.notebook.hist_series" in bad[0]
    assert "scalescope.analysis.advise_run" in bad[1]
    assert "scalescope.viz" in bad[2]


def test_importing_scalescope_starts_no_jax_backend() -> None:
    """`jax.distributed.initialize` (docs/store.md, several processes) must come before
    any backend starts; `import scalescope as ss` above it must not start one (an array
    made at import time to learn JAX's array type did)."""
    import subprocess
    import sys

    code = (
        "import scalescope\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge._backends, list(xla_bridge._backends)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
