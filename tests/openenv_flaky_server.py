"""An OpenEnv server command that comes up once and never again.

``python tests/openenv_flaky_server.py MARKER HOST PORT``: the first start
(no ``MARKER`` file yet) creates the marker and becomes a uvicorn server of
``openenv_guess_env:app``; every later start prints one line and exits with
code 1 at once, like a server whose restart keeps failing (a lost GPU, a
broken dependency). The adapter's restart bound is tested with it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    marker, host, port = sys.argv[1:4]
    if os.path.exists(marker):
        print(f"flaky server: started before ({marker} exists), refusing to start again", flush=True)
        sys.exit(1)
    Path(marker).touch()
    here = str(Path(__file__).resolve().parent)
    os.execv(
        sys.executable,
        [sys.executable, "-m", "uvicorn", "openenv_guess_env:app", "--app-dir", here, "--host", host, "--port", port],
    )
