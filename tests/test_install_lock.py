"""The locks that scripts/install.sh installs from agree with pyproject.toml and with the
environment the suite runs in (refresh them with `bash scripts/lock.sh`)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
TEST_LOCK = ROOT / "requirements" / "lock-test.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", re.MULTILINE)


def pins(lock: Path) -> dict[str, Version]:
    return {canonicalize_name(name): Version(v) for name, v in PIN.findall(lock.read_text())}


def project_requirements(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    return [Requirement(spec) for spec in specs]


def unmet(requirements: list[Requirement], locked: dict[str, Version]) -> list[str]:
    problems = []
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = locked.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req} is not in the lock")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req} but the lock pins {version}")
    return problems


@pytest.mark.parametrize(
    ("lock", "extras"), [(LOCK, ()), (TEST_LOCK, ("test", "bench", "ray"))], ids=["engine", "test"]
)
def test_every_project_requirement_is_pinned_within_its_range(lock, extras):
    assert unmet(project_requirements(*extras), pins(lock)) == []


def test_every_pin_carries_a_hash():
    for lock in (LOCK, TEST_LOCK):
        entries = re.split(r"\n(?=[A-Za-z0-9])", lock.read_text().split("\n", 1)[1])
        for entry in entries:
            if PIN.match(entry):
                assert "--hash=sha256:" in entry, f"{lock.name}: {entry.splitlines()[0]}"


def test_the_test_lock_extends_the_engine_lock_without_changing_it():
    engine, test = pins(LOCK), pins(TEST_LOCK)
    assert {name: test.get(name) for name in engine} == engine


def test_torch_is_locked_to_its_cpu_build():
    assert pins(LOCK)["torch"].local == "cpu"


def test_the_running_environment_is_the_test_lock():
    """The suite runs on exactly what the lock pins (`.ci/run` installs through it)."""
    drift = {}
    for name, version in pins(TEST_LOCK).items():
        try:
            installed = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            drift[name] = f"not installed, locked {version}"
            continue
        if installed != version:
            drift[name] = f"installed {installed}, locked {version}"
    assert drift == {}


# Imported only by a feature that names its extra when the package is missing.
OPTIONAL_IMPORTS = {"ray": "ray", "matplotlib": "bench"}


def imported_packages() -> set[str]:
    """The top-level names of the third-party modules tokenserve's code imports."""
    names = set()
    for path in (ROOT / "tokenserve").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"tokenserve", "__future__"}


def test_what_the_code_imports_is_in_the_engine_lock_or_its_extra():
    """A command that imports a package the README's install lacks fails for its users
    (as `bench startup` did without psutil): every package tokenserve imports is pinned in
    the engine lock, or is an optional import whose extra names it."""
    distributions = metadata.packages_distributions()
    engine, test = pins(LOCK), pins(TEST_LOCK)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    problems = []
    for module in sorted(imported_packages()):
        names = [canonicalize_name(d) for d in distributions.get(module, [])]
        if not names:
            problems.append(f"{module}: no installed distribution provides it")
        elif module in OPTIONAL_IMPORTS:
            extra = OPTIONAL_IMPORTS[module]
            named = {canonicalize_name(Requirement(spec).name) for spec in extras[extra]}
            if not set(names) & named & set(test):
                problems.append(f"{module}: not pinned through the {extra!r} extra")
        elif not any(name in engine for name in names):
            problems.append(f"{module}: imported, but {names} not in requirements/lock.txt")
    assert problems == []
