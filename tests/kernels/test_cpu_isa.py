"""Choosing the kernels' instruction set (kernels/cpu_isa.py): from the CPU's flags, forced
lower with `cpu_isa`, refused where the CPU lacks it; one build per level (kernels/build.py),
and `--dtype auto` following the level."""

from __future__ import annotations

import pytest
import torch

from tokenserve.config import KernelConfig
from tokenserve.kernels import build, cpu_isa
from tokenserve.model.precision import auto_dtype, resolve_dtype

AVX2_HOST = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
ZEN4_HOST = AVX2_HOST | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                         "avx512_bf16"}
SPR_HOST = ZEN4_HOST | {"amx_tile", "amx_bf16", "amx_int8"}


def test_levels_follow_the_flags():
    cpuinfo = "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma\nbugs\t\t: none\n"
    assert cpu_isa.parse_flags(cpuinfo) == {"fpu", "sse", "avx", "avx2", "fma"}
    assert cpu_isa.supported_levels(AVX2_HOST) == ["avx2"]
    assert cpu_isa.supported_levels(ZEN4_HOST) == ["avx2", "avx512", "avx512_bf16"]
    assert cpu_isa.supported_levels(SPR_HOST) == ["avx2", "avx512", "avx512_bf16", "amx"]
    # AVX-512 F without BW/VL (Knights Landing) is not the avx512 level.
    assert cpu_isa.best_level(AVX2_HOST | {"avx512f"}) == "avx2"
    # The bf16 levels build the 8-bit block kernel too: VNNI, which every CPU with
    # AVX512_BF16 has, is part of them.
    assert cpu_isa.best_level(ZEN4_HOST - {"avx512_vnni"}) == "avx512"


@pytest.mark.auto_dtype
def test_an_avx2_host_gets_avx2_kernels_and_float32(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: AVX2_HOST)
    assert cpu_isa.resolve("auto") == "avx2"
    assert auto_dtype() == torch.float32 and resolve_dtype("auto") == torch.float32
    # A level the CPU lacks would fault on its first instruction: refused, naming the flags.
    with pytest.raises(ValueError, match="does not have it.*avx512_bf16"):
        cpu_isa.resolve("avx512_bf16")
    with pytest.raises(ValueError, match="does not have it"):
        resolve_dtype("float32", "amx")  # whatever the dtype
    assert cpu_isa.resolve("native") == "native"


@pytest.mark.auto_dtype
@pytest.mark.parametrize(("flags", "dtype"), [(ZEN4_HOST, torch.bfloat16),
                                              (SPR_HOST, torch.bfloat16)])
def test_auto_dtype_is_bfloat16_where_it_is_native_unless_a_lower_level_is_forced(
    monkeypatch: pytest.MonkeyPatch, flags, dtype
):
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: flags)
    assert resolve_dtype("auto") == dtype
    assert resolve_dtype("auto", "avx512") == torch.float32
    assert resolve_dtype("auto", "avx2") == torch.float32
    assert resolve_dtype("float32") == torch.float32  # one flag away
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float64")


def test_unknown_levels_are_refused():
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        KernelConfig(cpu_isa="avx1024")
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        cpu_isa.resolve("sse2")


def test_one_build_per_level(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TOKENSERVE_CACHE_DIR", str(tmp_path))
    levels = cpu_isa.supported_levels()
    built = {level: build.build("layer_ops", level) for level in levels}
    assert len(set(built.values())) == len(levels)
    assert all(f"/layer_ops-{level}-" in path for level, path in built.items())
    # Unnamed, the selected level (the best the CPU has unless forced lower).
    previous = build.selected_isa()
    try:
        assert build.select_isa("auto") == levels[-1]
        assert build.build("layer_ops") == built[levels[-1]]
        build.select_isa(levels[0])
        assert build.build("layer_ops") == built[levels[0]]
    finally:
        build.select_isa(previous)
