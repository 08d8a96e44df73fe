"""Which instruction set the C kernels are built for: read from the CPU's flags, or forced.

The kernels in csrc/ are plain C with GCC vector extensions, so one source compiles to each
x86-64 target below with its own `-m` flags (build.py keeps one library per target). The
levels are ordered; a CPU runs every level up to the best it has, and `--cpu-isa` forces a
lower one (for comparison, or to test a path on a host that has a better one). Off x86-64
the only level is "native" (`-march=native`, what the compiler finds on the host).

    avx2         AVX2 + FMA + F16C (Haswell, Zen 1 on)
    avx512       + AVX-512 F/BW/VL/DQ (Skylake-SP, Zen 4 on)
    avx512_bf16  + AVX512_BF16 (and AVX512-VNNI, which every such CPU has): native bf16 dot
                 products (Cooper Lake, Sapphire Rapids, Zen 4)
    amx          + AMX tiles with bf16 (Sapphire Rapids on)

`native_bf16(isa)` is what `--dtype auto` asks: whether the selected level computes bf16
natively (avx512_bf16 or amx), so that a bf16 matmul runs at about twice float32's rate.
"""

from __future__ import annotations

import functools
import platform

from tokenserve.config import CPU_ISAS

# Levels, lowest first → (the /proc/cpuinfo flags they need, the compiler flags).
ISA_LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "avx512": (
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
    ),
    "avx512_bf16": (
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
         "avx512_bf16"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni", "-mavx512bf16"),
    ),
    "amx": (
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
         "avx512_bf16", "amx_tile", "amx_bf16"),
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
    ),
}
NATIVE = "native"  # off x86-64, or an x86-64 CPU without AVX2: -march=native
CPU_ISA_CHOICES = CPU_ISAS  # "auto", the levels above, "native"
_BF16_LEVELS = ("avx512_bf16", "amx")


def parse_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo's first `flags` line (x86 Linux)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def parse_vendor(cpuinfo: str) -> str:
    """The vendor of /proc/cpuinfo's first `vendor_id` line ("GenuineIntel",
    "AuthenticAMD"; "" where there is none)."""
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            return line.partition(":")[2].strip()
    return ""


@functools.cache
def cpu_vendor() -> str:
    """This CPU's vendor (empty where /proc/cpuinfo cannot say)."""
    try:
        with open("/proc/cpuinfo") as file:
            return parse_vendor(file.read())
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo cannot say)."""
    try:
        with open("/proc/cpuinfo") as file:
            return parse_flags(file.read())
    except OSError:
        return frozenset()


def supported_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels a CPU with `flags` (default: this one) runs, lowest first; ["native"]
    where it runs none of the x86-64 ones."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() not in ("x86_64", "amd64") and not flags:
        return [NATIVE]
    levels = [name for name, (needed, _) in ISA_LEVELS.items() if set(needed) <= flags]
    return levels or [NATIVE]


def best_level(flags: frozenset[str] | None = None) -> str:
    return supported_levels(flags)[-1]


def resolve(isa: str | None) -> str:
    """"auto" (or None) → the best level this CPU runs; a forced level is checked: a CPU
    that lacks it would fault on its first instruction, so that is a ValueError."""
    if isa is None or isa == "auto":
        return best_level()
    if isa not in CPU_ISA_CHOICES:
        raise ValueError(f"cpu_isa must be one of {list(CPU_ISA_CHOICES)}, got {isa!r}.")
    if isa == NATIVE:
        return NATIVE  # whatever the compiler finds on this host
    levels = supported_levels()
    if isa not in levels:
        raise ValueError(
            f"cpu_isa={isa!r}: this CPU does not have it (it runs {levels}; flags needed: "
            f"{', '.join(ISA_LEVELS.get(isa, ((), ()))[0]) or '-march=native'})."
        )
    return isa


def compiler_flags(isa: str) -> list[str]:
    """The compiler's target flags for a resolved level."""
    if isa == NATIVE:
        return ["-march=native"]
    return list(ISA_LEVELS[isa][1])


def native_bf16(isa: str | None = None) -> bool:
    """Whether the (resolved) level computes bf16 natively: what `--dtype auto` asks."""
    return resolve(isa) in _BF16_LEVELS
