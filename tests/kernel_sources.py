"""Another tree's C kernels for tests: a copy of this tree's kernels/csrc with a line added
to one file, so that it gets its own build (kernels/build.py keys builds by the sources)."""

from __future__ import annotations

from pathlib import Path

from tokenserve.kernels import build


def other_kernel_sources(directory: Path, file_name: str, appended: str) -> Path:
    """This tree's csrc/ copied into `directory`/csrc, `appended` added to `file_name`;
    returns the copy's path."""
    other = directory / "csrc"
    other.mkdir()
    for source in Path(build.SOURCE_DIR).iterdir():
        if source.suffix in (".c", ".h"):
            (other / source.name).write_bytes(source.read_bytes())
    with open(other / file_name, "a") as file:
        file.write(appended)
    return other
