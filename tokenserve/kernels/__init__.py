"""Small C kernels for the CPU path, compiled on the machine that runs them.

The C sources are in csrc/: paged decode attention and K/V writes (paged_attention.c), the
fused element-wise operators of a layer (layer_ops.c), products with GGUF-quantized weights
(quant_linear.c), and a whole decoder layer of a few-row decode step built from those three
(decode_layer.c). `build.py` is the build cache (compile once per source, flags, compiler
and CPU, one library per instruction-set level of `cpu_isa.py`; load with ctypes); each kernel has one binding module of the same name whose
`load()` returns its operators, or None where it cannot be built: callers then take their
pure-torch code (slower, the same results up to float rounding). Whether to use the kernels
at all is the caller's setting (`EngineConfig.kernel_config`), never read here.
`python -m tokenserve.kernels` builds them ahead of time (scripts/install.sh).
"""
