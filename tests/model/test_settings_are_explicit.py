"""Settings reach the model, the attention backend and the kernels through EngineConfig
(`kernel_config`), from engine arguments and command-line flags; none of that code reads
the environment (the kernels' build cache keeps the toolchain's $CC)."""

from __future__ import annotations

import argparse
import pathlib
import re

import tokenserve
from tokenserve.config import KernelConfig
from tokenserve.engine.cli_args import add_engine_arguments, engine_args_from
from tokenserve.engine.engine_args import EngineArgs

PACKAGE = pathlib.Path(tokenserve.__file__).parent
ENVIRONMENT = re.compile(r"os\.environ|getenv|TOKENSERVE_")
# Where the compiler comes from is the toolchain's convention ($CC), not an engine setting.
ALLOWED = {"kernels/build.py": {'os.environ.get("CC", "cc")', "os.environ.get('CC', 'cc')"}}


def test_model_attention_and_kernels_read_no_environment():
    found = []
    for package in ("model", "attention", "kernels"):
        for path in sorted((PACKAGE / package).rglob("*.py")):
            relative = path.relative_to(PACKAGE).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if ENVIRONMENT.search(line) and not any(
                    allowed in line for allowed in ALLOWED.get(relative, ())
                ):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []


def test_kernel_flags_reach_the_engine_config(tiny_model_dirs):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, positional_model=True)
    args = parser.parse_args([
        tiny_model_dirs["llama"], "--disable-c-kernels", "--disable-onednn",
        "--disable-fused-decode", "--quantized-max-rows", "4", "--quantized-gemm-max-rows", "0",
    ])
    config = engine_args_from(args).create_engine_config()
    assert config.kernel_config == KernelConfig(
        disable_c_kernels=True, disable_onednn=True, disable_fused_decode=True,
        quantized_max_rows=4, quantized_gemm_max_rows=0,
    )
    defaults = EngineArgs(model=tiny_model_dirs["llama"]).create_engine_config().kernel_config
    assert defaults == KernelConfig()
