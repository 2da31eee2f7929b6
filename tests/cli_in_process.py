"""The ``qdcp`` command line run inside the test process: ``qdcp.cli.main(argv)`` with its stdout and
stderr captured, answered as a :class:`subprocess.CompletedProcess`.

A ``python -m qdcp`` subprocess costs an interpreter and torch/torchao's imports (seconds on the CI's
2 cores) and proves only that the entry point runs ``main`` and exits with its status; the tests
that must prove that (the installed entry point, a terminal, a kill) still start real processes.
Everything else a verb does (its output, exit status, the files it writes or refuses to touch) is
``main``'s, and is checked here without the spawn. ``main`` silences warnings and logging for the
process it runs in; both are put back after each call, and so is the working directory.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import warnings

from qdcp.cli import main


def qdcp_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """``qdcp ARGS`` (run from ``cwd`` if given): exit status, stdout and stderr. An exception that
    escapes ``main`` is raised here (a subprocess would exit 1 with a traceback: a failure either way)."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    disabled, here = logging.root.manager.disable, os.getcwd()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if cwd is not None:
                os.chdir(cwd)
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
        logging.disable(disabled)
    return subprocess.CompletedProcess(["qdcp", *argv], rc, out.getvalue(), err.getvalue())
