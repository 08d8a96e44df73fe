"""The kernels' build cache: compile a C kernel once per machine and instruction set, and load it.

`build(name, isa)` compiles csrc/<name>.c with the system C compiler (`$CC`, else `cc`) for
one instruction-set level of cpu_isa.py (its `-m` flags) into `<cache root>/kernels`
(tokenserve/cache_dir.py), keyed by every source in csrc/ (a kernel may include the others),
the flags, the compiler and the CPU: a changed source, compiler or machine gets a fresh
build. `load(name, isa)` returns the loaded library, or None where it cannot be built
(callers then take their pure-torch code). The level defaults to the process's selection
(`select_isa`, from `KernelConfig.cpu_isa`; the best the CPU has unless forced lower). ctypes releases the GIL around each
call; the kernels use the OpenMP runtime torch has already loaded (libgomp is shared by
soname), so they run on torch's own threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

from tokenserve.cache_dir import cache_root
from tokenserve.kernels import cpu_isa

logger = logging.getLogger(__name__)

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
KERNELS = ("paged_attention", "layer_ops", "quant_linear", "decode_layer", "prompt_attention")
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# The level the kernels of this process are built for (None: the best the CPU has).
_selected_isa: str | None = None


def select_isa(isa: str | None) -> str:
    """Set the level the kernels load for (KernelConfig.cpu_isa: "auto" or a level, checked
    against the CPU); returns the resolved level. Call before the first kernel loads."""
    global _selected_isa
    _selected_isa = cpu_isa.resolve(isa)
    return _selected_isa


def selected_isa() -> str:
    """The level kernels load for when none is named."""
    return _selected_isa if _selected_isa is not None else cpu_isa.resolve(None)


def _flags(isa: str) -> list[str]:
    # -mtune=native: scheduling for this CPU, whatever the instruction set.
    tune = [] if isa == cpu_isa.NATIVE else ["-mtune=native"]
    return [*_FLAGS, *cpu_isa.compiler_flags(isa), *tune]


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str | None:
    # $CC is the toolchain's own convention (make, setuptools), not an engine setting.
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        with open("/proc/cpuinfo") as file:
            lines = [line for line in file if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def build(name: str, isa: str | None = None, source_dir: str = SOURCE_DIR) -> str:
    """Compile `name`.c for `isa` (default: the selected level) into the cache (if not
    there yet); returns the shared library's path. `source_dir`: another tree's csrc/, for
    benchmarks that set two builds of a kernel side by side."""
    isa = selected_isa() if isa is None else cpu_isa.resolve(isa)
    flags = _flags(isa)
    compiler = _compiler()
    if compiler is None:
        raise KernelBuildError(f"no C compiler found (looked for {os.environ.get('CC', 'cc')!r})")
    sources = []  # every source the kernel may include (decode_layer.c includes the others)
    for file_name in sorted(os.listdir(source_dir)):
        if file_name.endswith((".c", ".h")):
            with open(os.path.join(source_dir, file_name), "rb") as file:
                sources.append(file_name.encode() + b"\0" + file.read())
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    key = hashlib.sha256(
        b"\0".join([*sources, " ".join(flags).encode(), version.encode(), _cpu_identity().encode()])
    ).hexdigest()[:16]
    directory = os.path.join(cache_root(), "kernels")
    library = os.path.join(directory, f"{name}-{isa}-{key}.so")
    if os.path.exists(library):
        return library
    os.makedirs(directory, exist_ok=True)
    # Compile to a private name and rename into place: a racing process never loads a
    # half-written library.
    handle, partial = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=directory)
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *flags, os.path.join(source_dir, f"{name}.c"), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on {name}.c:\n{result.stderr.strip()}")
        os.replace(partial, library)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return library


def load(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel's library for `isa` (default: the selected level), built if need be; None
    (with a warning) where it cannot be."""
    return _load(name, selected_isa() if isa is None else cpu_isa.resolve(isa))


@functools.cache
def _load(name: str, isa: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(build(name, isa))
    except (OSError, KernelBuildError) as error:
        logger.warning("C kernel %r (%s) unavailable, using the pure-torch path: %s", name,
                       isa, error)
        return None
