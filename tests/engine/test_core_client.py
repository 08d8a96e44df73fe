"""The engine-core process started before its configuration (`EngineCoreProcess`)."""

from __future__ import annotations

import os

from tokenserve.engine.core_client import EngineCoreProcess


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
