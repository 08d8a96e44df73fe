"""Every kernel test runs once per instruction-set level (kernels/cpu_isa.py) this host has,
including the lower ones forced (AVX2 on an AVX-512 host); a level the host lacks is skipped
with the flags it misses (its code would fault on the first instruction)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenserve.kernels import build, cpu_isa


def select_level(level: str) -> Iterator[str]:
    """Select `level` for the kernels loaded meanwhile (restored after); skip where the host
    lacks it. For fixtures over levels (`yield from`)."""
    missing = sorted(set(cpu_isa.ISA_LEVELS[level][0]) - cpu_isa.cpu_flags())
    if missing:
        pytest.skip(f"this CPU lacks {level} (no {', '.join(missing)} in /proc/cpuinfo)")
    previous = build.selected_isa()
    build.select_isa(level)
    yield level
    build.select_isa(previous)


@pytest.fixture(scope="module", params=list(cpu_isa.ISA_LEVELS))
def cpu_isa_level(request: pytest.FixtureRequest):
    """Select `level` for the kernels loaded in the test (restored after)."""
    yield from select_level(request.param)
