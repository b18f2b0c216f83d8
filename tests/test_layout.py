"""The card's layout: common/, coordinator/, workers/ and bench/ at the root, importable as mserve.*.

pyproject.toml maps them with package-dir; these tests keep that list in step with the folders and
check that a built wheel holds the same modules under the same names, and no generic top-level name.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAPPED = ("common", "coordinator", "workers", "bench")


def _setuptools() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_folders() -> dict[str, Path]:
    """Every folder with an __init__.py that should install, by its dotted mserve.* name."""
    found = {}
    for top in ("mserve", *MAPPED):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            if "lab" in rel.parts:  # bench/lab: measurement scripts, not shipped
                continue
            parts = rel.parts if top == "mserve" else ("mserve", *rel.parts)
            found[".".join(parts)] = init.parent
    return found


def test_card_folders_at_the_root():
    for name in ("common", "coordinator", "workers", "bench", "deploy", "tests", "docs"):
        assert (ROOT / name).is_dir(), name
    assert not (ROOT / "mserve" / "common").exists()


def test_pyproject_lists_every_package_folder():
    settings = _setuptools()
    assert sorted(settings["packages"]) == sorted(_package_folders())
    assert settings["package-dir"] == {"mserve": "mserve", **{f"mserve.{d}": d for d in MAPPED}}


@pytest.mark.parametrize("name", ["mserve.common", "mserve.coordinator", "mserve.workers",
                                  "mserve.bench", "mserve.gateway", "mserve.autoscale"])
def test_namespace_imports_from_this_checkout(name):
    module = importlib.import_module(name)
    expected = _package_folders()[name]
    assert Path(module.__file__).resolve().parent == expected.resolve()


def test_no_generic_top_level_name(tmp_path):
    """The install adds `mserve` only: run from an empty folder, `import common` (etc.) fails."""
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", probe, *MAPPED], cwd=tmp_path, timeout=60)
    assert done.returncode == 0, f"one of {MAPPED} is importable as a top-level name"


@pytest.mark.slow
def test_wheel_holds_the_same_modules(tmp_path):
    """`pip wheel .` packs every mapped folder as mserve/<folder>/ and nothing else at the top."""
    source = tmp_path / "src"  # a copy: an in-tree build would leave build/ and *.egg-info behind
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for top in ("mserve", *MAPPED):
        shutil.copytree(ROOT / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(source)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("mserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"mserve", next(t for t in tops if t.endswith(".dist-info"))}
    for name, folder in _package_folders().items():
        for source in folder.glob("*.py"):
            packed = "/".join(name.split(".")) + "/" + source.name
            assert packed in names, packed
    assert not [n for n in names if "/lab/" in n]
