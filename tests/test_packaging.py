"""The wheel: `app/` and `sample_models/` (top-level folders of the repository) install as
`scalescope.app` and `scalescope.sample_models`, never as top-level packages that would
collide with other projects' `app`; every sub-package and data file ships, and the
installed package imports without this checkout."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"scalescope.app": "app", "scalescope.sample_models": "sample_models"}


def test_pyproject_lists_every_package_and_maps_the_folders():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "scalescope").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert set(config["packages"]) == found | set(MAPPED)
    assert config["package-dir"] == MAPPED
    assert not any(p.split(".")[0] in ("app", "sample_models") for p in config["packages"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    (whl,) = out.glob("scalescope-*.whl")
    return whl


def test_wheel_holds_the_folders_under_the_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"scalescope", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    for needed in (
        "scalescope/app/server.py",
        "scalescope/app/dashboard.py",
        "scalescope/sample_models/train.py",
        "scalescope/sample_models/vendored/shakespeare_subset.txt.gz",
        "scalescope/probe/native/stats.cc",
        "scalescope/probe/native/common.h",
    ):
        assert needed in names, needed


def test_installed_wheel_imports_without_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    done = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    code = (
        "import importlib.util, scalescope, scalescope.app, scalescope.sample_models.train as t\n"
        f"assert scalescope.__file__.startswith({str(target)!r}), scalescope.__file__\n"
        "from scalescope.sample_models.data import VENDORED_SHAKESPEARE\n"
        "assert VENDORED_SHAKESPEARE.is_file(), VENDORED_SHAKESPEARE\n"
        "assert t.train and importlib.util.find_spec('sample_models') is None\n"
        "assert importlib.util.find_spec('app') is None\n"
        "print(scalescope.app.serve.__module__)\n"
    )
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "scalescope.app.server"
