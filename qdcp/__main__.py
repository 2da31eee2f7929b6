"""``python -m qdcp``: the qdcp command line."""

import sys

from qdcp.cli import main

sys.exit(main())
