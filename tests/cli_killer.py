"""Runs the ``qdcp`` command line and SIGKILLs itself at its N-th ``os.rename`` (a kill at a chosen
point of a real run; tests/test_output_debris.py).

    python tests/cli_killer.py N VERB ARGS...     # as `qdcp VERB ARGS...`, killed at rename N
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    at, calls, real = int(sys.argv[1]), [0], os.rename

    def rename(src, dst):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)

    os.rename = rename
    from qdcp.cli import main as qdcp_main

    sys.exit(qdcp_main(sys.argv[2:]))


if __name__ == "__main__":
    main()
