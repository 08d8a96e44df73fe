"""What each process of `tokenserve serve` imports, checked in fresh interpreters.

The command line module is imported again by the engine-core process (multiprocessing's
spawn), so it must stay light; the API process serves HTTP and never runs the model; the
engine-core process imports the model code but not the HTTP stack. Features the default
path does not use (structured outputs' grammar engine, LoRA, spec decode's proposers,
pooling references, plotting) are imported when first used. A test here fails when someone
adds an eager import of one of them (docs/STARTUP.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tokenserve.model.loader import load_tokenizer, resolve_model

# Never imported by `import tokenserve.entrypoints.cli` (nor `import tokenserve`).
HEAVY = ["torch", "transformers", "numpy", "fastapi", "uvicorn", "zmq", "gguf"]
# Imported by no process of a server on the default path until a request uses them (the
# n-gram proposer, a few lines of numpy the runner's spec-decode helpers sit beside, may be).
FEATURES = [
    "xgrammar", "llguidance", "peft", "sentence_transformers", "matplotlib",
    "tokenserve.structured_output.grammar", "tokenserve.spec_decode.draft_model_proposer",
    "tokenserve.entrypoints.llm",
]
# The API process runs no model: no worker, executor or engine core.
MODEL_SIDE = ["tokenserve.worker", "tokenserve.executor", "tokenserve.core.engine_core"]
# `tokenserve serve` parses its own flags only: the other subcommands' code stays out.
OTHER_COMMANDS = ["tokenserve.simulator", "tokenserve.benchmarks"]
# The engine-core process serves no HTTP.
HTTP_SIDE = ["fastapi", "uvicorn", "starlette", "tokenserve.entrypoints.openai"]
# Model classes: imported when a model is built, the one it needs only (model/architectures.py).
MODEL_CODE = [
    "tokenserve.model.llama", "tokenserve.model.qwen3", "tokenserve.model.llava",
    "tokenserve.model.idefics3", "tokenserve.model.bert", "tokenserve.model.decoder_pooling",
]
# What transformers' LlamaConfig (its type validators) and activations import: most of a
# second of a start, for nothing a llama GGUF model uses.
DISTRIBUTED_TENSOR = ["torch.distributed.tensor", "sympy", "transformers.activations"]


def imported_after(code: str, timeout: float = 600) -> set[str]:
    """The modules in sys.modules after `code` runs in a fresh interpreter."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True,
        timeout=timeout, env=os.environ,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def found(modules: set[str], names: list[str]) -> list[str]:
    """The names (or submodules of them) present in `modules`."""
    return sorted(m for m in modules for n in names if m == n or m.startswith(n + "."))


def test_cli_module_imports_nothing_heavy():
    modules = imported_after("import tokenserve.entrypoints.cli")
    assert found(modules, HEAVY + FEATURES + MODEL_SIDE + HTTP_SIDE) == []


def test_the_engine_process_starts_before_anything_but_the_standard_library_is_imported():
    # `tokenserve serve` spawns the engine-core process first thing; whatever is imported
    # before the spawn (~0.1 s for asyncio, zmq and the messages) delays the whole start.
    modules = imported_after("import tokenserve.engine.core_process")
    packages = {"tokenserve", "tokenserve.version", "tokenserve.engine"}  # the lazy roots
    ours = sorted(m for m in modules if m.startswith("tokenserve.") and m not in packages)
    assert ours == ["tokenserve.engine.core_process"]
    assert found(modules, HEAVY + ["asyncio", "msgspec"]) == []


def test_package_root_is_lazy_and_complete():
    modules = imported_after(
        "import tokenserve\n"
        "assert tokenserve.__version__\n"
        "assert sorted(dir(tokenserve)) == sorted(tokenserve.__all__)\n"
    )
    assert found(modules, HEAVY) == []
    # Every public name still resolves, to the class its module defines.
    modules = imported_after(
        "import tokenserve\n"
        "from tokenserve import SamplingParams, LLM\n"
        "from tokenserve.entrypoints.llm import LLM as Defined\n"
        "assert LLM is Defined and all(getattr(tokenserve, n) for n in tokenserve.__all__)\n"
    )
    assert "tokenserve.entrypoints.llm" in modules


def test_parsing_the_serve_flags_imports_no_fastapi():
    # The API process sends the engine process its arguments once it has parsed them; the
    # engine process waits for them, so the parse must not wait for the HTTP stack (fastapi
    # comes after, with the app).
    modules = imported_after(
        "from tokenserve.entrypoints.cli import build_parser\n"
        "from tokenserve.engine.cli_args import engine_args_from\n"
        "engine_args_from(build_parser(serve_only=True).parse_args(['serve']))\n"
    )
    assert found(modules, ["fastapi", "uvicorn", "tokenserve.entrypoints.openai.errors"]) == []


def test_engine_core_process_imports_no_http_and_no_features():
    # What the pre-started engine-core process imports before it is configured.
    modules = imported_after(
        "from tokenserve.executor.backends import import_executor_class\n"
        "import tokenserve.core.engine_core_proc\n"
        "import_executor_class('uni')\n"
    )
    assert "tokenserve.worker.model_runner" in modules  # the preload does preload
    assert found(modules, HTTP_SIDE + FEATURES + MODEL_CODE) == []


def test_the_default_models_configuration_and_code_skip_transformers():
    # The engine-core process's path on the default model (the API process's is a part),
    # up to its model class's module: no transformers (GGUFLlamaConfig, and the scaled-RoPE
    # initialisers only for a scaled rope_type), hence no torch.distributed.tensor either.
    modules = imported_after(
        "from tokenserve.executor.backends import import_executor_class\n"
        "import_executor_class('uni')\n"
        "from tokenserve.engine.engine_args import EngineArgs\n"
        "from tokenserve.model.architectures import model_class_for\n"
        "model_config = EngineArgs().create_engine_config().model_config\n"
        "model_class_for(model_config.architecture, model_config.runner)\n"
    )
    assert "tokenserve.model.llama" in modules
    other_models = [name for name in MODEL_CODE if name != "tokenserve.model.llama"]
    assert found(modules, ["transformers", *DISTRIBUTED_TENSOR, *other_models]) == []


def test_the_engine_process_of_a_gguf_model_configures_itself_without_transformers():
    # transformers' base is ~0.5 s of the engine process's start: a GGUF model's config is a
    # GGUFLlamaConfig (model/gguf_config.py), hf_loader comes with a Hugging Face directory;
    # the gguf package (~0.1 s) is not needed for the header (model/gguf_file.py).
    modules = imported_after(
        "from tokenserve.executor.backends import import_executor_class\n"
        "import tokenserve.core.engine_core_proc\n"
        "import_executor_class('uni')\n"
        "from tokenserve.engine.core_process import _configuration\n"
        "from tokenserve.engine.engine_args import EngineArgs\n"
        "config, load_tokenizer = _configuration(EngineArgs())\n"
        "assert config.model_config.files.format == 'gguf'\n"
    )
    assert "tokenserve.model.gguf_loader" in modules
    assert found(modules, ["transformers", "tokenserve.model.hf_loader", "gguf"]) == []


def api_process_modules(serve_args: list[str]) -> set[str]:
    """What the API process of a real `tokenserve serve SERVE_ARGS` (fresh interpreter) has
    imported once /health answers 200; it then stops itself (SIGTERM, as a supervisor would)."""
    code = f"""
        import json, os, signal, socket, sys, threading, time
        import httpx
        from tokenserve.entrypoints import cli

        sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]
        sock.close()

        def watch():
            deadline = time.monotonic() + 500
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"http://127.0.0.1:{{port}}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            print("MODULES " + json.dumps(sorted(sys.modules)), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, daemon=True).start()
        sys.exit(cli.main(["serve", *{serve_args!r}, "--port", str(port), "--disable-log-stats"]))
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True,
        text=True, timeout=600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("MODULES ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    return set(json.loads(lines[0][len("MODULES "):]))


def test_api_process_of_a_running_server(tiny_model_dirs: dict[str, str]):
    modules = api_process_modules([
        tiny_model_dirs["llama"], "--max-model-len", "256", "--num-kv-blocks", "16",
        "--block-size", "16",
    ])
    assert "fastapi" in modules  # it did serve
    assert found(modules, FEATURES + MODEL_SIDE + OTHER_COMMANDS + MODEL_CODE) == []


def test_the_api_process_of_a_default_model_serve_imports_no_torch():
    # The configuration holds dtypes by name (config.py), the model code and weight loaders
    # come with the engine's load: the API process's start (flags, configuration, HTTP stack,
    # the cached GGUF tokenizer, the engine's ready handshake) never waits for torch's import.
    load_tokenizer(resolve_model(None))  # warm caches, as `tokenserve bench startup` measures
    modules = api_process_modules(["--max-model-len", "512", "--num-kv-blocks", "8"])
    assert "fastapi" in modules and "tokenserve.model.gguf_loader" in modules  # it did serve
    unwanted = ["torch", "tokenserve.model.layers", "tokenserve.multimodal.processing"]
    assert found(modules, unwanted) == []
