"""A config file is read through ``kvtier.safe_files``: a FIFO, a device or a huge file given as
the config is one ``ConfigError`` line, never a hang or a ``MemoryError``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvtier.cli import main


def check_config_in_time(path: Path | str, seconds: float = 10.0) -> int:
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(main(["check-config", str(path)])), daemon=True
    )
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "kvtier check-config hung"
    assert codes, "kvtier check-config raised"
    return codes[0]


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_config_that_is_not_a_small_regular_file_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = tmp_path / "kvtier.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        with path.open("wb") as f:
            f.truncate(1 << 40)  # sparse
    assert check_config_in_time(path) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: invalid config config file=") and err.count("\n") == 1
    assert ("not a regular file" if kind != "huge" else "larger than") in err
