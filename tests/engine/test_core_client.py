"""The engine-core process started before its configuration (`EngineCoreProcess`)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tokenserve.engine.core_process import EngineCoreProcess
from tokenserve.engine.engine_args import EngineArgs


def test_an_engine_process_never_configured_exits_on_its_own():
    # The API process gave up before configuring it (bad flags, --help, Ctrl-C): once the
    # configuration pipe closes, the child leaves by itself (exit code 0, no signal needed).
    engine_process = EngineCoreProcess()
    socket_dir = engine_process.input_address.removeprefix("ipc://").rsplit("/", 1)[0]
    assert os.path.isdir(socket_dir)
    engine_process._start_writer.close()
    engine_process.process.join(timeout=600)
    assert engine_process.process.exitcode == 0
    engine_process.shutdown()
    assert not os.path.exists(socket_dir)


def _start_from_args(engine_args: EngineArgs) -> EngineCoreProcess:
    engine_process = EngineCoreProcess()
    engine_process.configure_from_args(engine_args)
    return engine_process


def test_the_engine_process_builds_the_configuration_the_api_process_builds(
    tiny_model_dirs: dict[str, str],
):
    # `tokenserve serve`'s start: the engine process gets the engine arguments and builds its
    # configuration itself while the API process builds its own; ready means they agree.
    # (dtype explicit: these tests patch "auto" to float32, which the child does not see.)
    engine_args = EngineArgs(model=tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="4MiB")
    engine_process = _start_from_args(engine_args)
    try:
        engine_process.configure(engine_args.create_engine_config())
        engine_process.wait_until_ready()
        assert engine_process.process.is_alive()
    finally:
        engine_process.shutdown()


def test_a_configuration_that_differs_from_the_engine_process_fails_the_start(
    tiny_model_dirs: dict[str, str],
):
    engine_args = EngineArgs(model=tiny_model_dirs["llama"], dtype="float32", kv_cache_memory="4MiB")
    engine_process = _start_from_args(engine_args)
    try:
        other = dataclasses.replace(engine_args, max_num_seqs=3).create_engine_config()
        engine_process.configure(other)
        with pytest.raises(RuntimeError, match="another configuration"):
            engine_process.wait_until_ready()
    finally:
        engine_process.shutdown()


def test_bad_engine_arguments_fail_the_engine_process_with_their_error():
    engine_process = _start_from_args(EngineArgs(max_num_seqs=0))
    try:
        with pytest.raises(RuntimeError, match="max_num_seqs must be at least 1"):
            engine_process.wait_until_ready()
        engine_process.process.join(timeout=600)
        assert engine_process.process.exitcode == 1
    finally:
        engine_process.shutdown()
