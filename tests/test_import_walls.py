"""The walls between tokenserve's parts hold: the import-linter contracts of pyproject.toml
([tool.importlinter]) are kept. They forbid an import cycle among subpackages and modules
at any depth, keep the leaves (messages, sampling_params, ...) leaves and the package root
unimported, and keep core, model, entrypoints, sample and structured_output to the imports
their layer may make."""

from __future__ import annotations

import tomllib
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_import_contracts_are_kept(capsys):
    exit_code = lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True)
    assert exit_code == 0, capsys.readouterr().out


def test_lazy_and_type_checking_imports_count(tmp_path, monkeypatch):
    """A wall crossed inside a function or under `if TYPE_CHECKING:` is crossed all the
    same: grimp's graph has those imports unless told otherwise, and the config does not."""
    options = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    assert str(options.get("exclude_type_checking_imports", False)).lower() != "true"
    package = tmp_path / "walled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "upper.py").write_text("")
    (package / "lower.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from walled import upper\n"
        "def late():\n"
        "    from walled.upper import something\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("walled", cache_dir=None)
    details = graph.get_import_details(importer="walled.lower", imported="walled.upper")
    assert sorted(d["line_number"] for d in details) == [3, 5]
