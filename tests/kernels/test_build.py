"""The kernels' build cache (kernels/build.py): one build per source, flags, compiler and
CPU; no kernels, and a warning, where there is no compiler; `python -m tokenserve.kernels`
builds them all."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from tests.kernel_sources import other_kernel_sources
from tokenserve.kernels import build


def test_build_is_cached_and_keyed_by_machine(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TOKENSERVE_CACHE_DIR", str(tmp_path))
    first = build.build("layer_ops")
    assert first.startswith(str(tmp_path)) and first.endswith(".so")
    modified = (tmp_path / "kernels").stat().st_mtime_ns
    assert build.build("layer_ops") == first  # cached: not rebuilt
    assert (tmp_path / "kernels").stat().st_mtime_ns == modified
    monkeypatch.setattr(build, "_cpu_identity", lambda: "another machine")
    assert build.build("layer_ops") != first


def test_another_source_directory_gets_its_own_build(tmp_path, monkeypatch: pytest.MonkeyPatch):
    # As benchmarks/decode_step_cost.py --other-csrc builds another tree's kernels.
    monkeypatch.setenv("TOKENSERVE_CACHE_DIR", str(tmp_path / "cache"))
    other = other_kernel_sources(tmp_path, "layer_ops.c",
                                 "int ts_other_tree(void) { return 7; }\n")
    ours, theirs = build.build("layer_ops"), build.build("layer_ops", source_dir=str(other))
    assert ours != theirs
    assert ctypes.CDLL(theirs).ts_other_tree() == 7
    assert not hasattr(ctypes.CDLL(ours), "ts_other_tree")


def test_without_a_compiler_the_kernels_are_none(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture):
    monkeypatch.setenv("TOKENSERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    build._load.cache_clear()
    try:
        with pytest.raises(build.KernelBuildError, match="no C compiler"):
            build.build("layer_ops")
        assert build.load("layer_ops") is None
        assert "pure-torch" in caplog.text
    finally:
        build._load.cache_clear()


def test_module_command_builds_every_kernel():
    # As scripts/install.sh runs it (into the usual cache: built already, or built now).
    result = subprocess.run(
        [sys.executable, "-m", "tokenserve.kernels"], capture_output=True, text=True, check=True
    )
    built = [line for line in result.stdout.splitlines() if line.startswith("Built ")]
    assert len(built) == len(build.KERNELS) == 5
    assert all(f"/{name}-" in line for name, line in zip(build.KERNELS, built))
