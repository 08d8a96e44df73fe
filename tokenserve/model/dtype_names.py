"""What `--dtype` and `--kv-cache-dtype` resolve to, as names ("float32", "bfloat16",
"float16"): the configuration holds names (config.py, `DTYPE_SIZES`), so that the API
process, which resolves the flags too, imports no torch. model/precision.py gives the
torch dtypes and what each part of a model computes in (engine side).
"""

from __future__ import annotations

from typing import Any

from tokenserve.kernels import cpu_isa

# --dtype's accepted names → the dtype's name (a key of config.DTYPE_SIZES).
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def auto_dtype_name(isa: str | None = None) -> str:
    """bfloat16 where the level `isa` (default: the CPU's best) computes it natively."""
    return "bfloat16" if cpu_isa.native_bf16(isa) else "float32"


def resolve_dtype_name(dtype: Any, isa: str | None = None) -> str:
    """--dtype ("auto", a name of DTYPE_ALIASES, or a torch dtype) → the model's dtype's
    name. `isa` is checked against the CPU whatever the dtype, so that a forced level it
    lacks fails here."""
    cpu_isa.resolve(isa)
    if dtype == "auto":
        return auto_dtype_name(isa)
    # A torch dtype (offline callers pass them) by its name: str(torch.bfloat16) is
    # "torch.bfloat16", and testing its type would import torch.
    name = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
    try:
        return DTYPE_ALIASES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype must be 'auto' or one of {sorted(DTYPE_ALIASES)}, got {dtype!r}."
        ) from None
