"""Runs a documentation page's Python blocks at N ranks under torchrun, inside a training loop's
collectives: ``torchrun ... docs_loop_worker.py PAGE ROOT`` (run by tests/test_docs_async_loop.py).

A page whose blocks are marked ``<!-- docs-test: torchrun N -->`` is a whole program of its own
(it initializes its process group and trains with FSDP2's collectives); it runs as written. The
blocks of another page run in order in one namespace, as a reader would run them, after
``dist.init_process_group("gloo")``, with every module's forward doing all-reduces on the default
group (a data-parallel step's collectives), seeded alike on every rank. Each rank writes
``ROOT/done-<rank>.json`` once the page's last line has run.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import textwrap
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from test_docs import blocks  # noqa: E402

ALL_REDUCES_PER_FORWARD = 8


def _training_collectives(module, args, output) -> None:
    for _ in range(ALL_REDUCES_PER_FORWARD):
        dist.all_reduce(torch.ones(256))


def main(page: str, root: str) -> None:
    # a rank that hangs prints where and exits (torchrun runs each rank in a session of its own)
    faulthandler.dump_traceback_later(int(os.environ.get("QDCP_WORKER_TIMEOUT", "240")), exit=True)
    os.chdir(root)
    found = [(mark, text) for lang, mark, text in blocks(REPO / page) if lang == "python"]
    program = [textwrap.dedent(text) for mark, text in found if mark]
    if not program:
        program = [text for _, text in found]
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        torch.nn.modules.module.register_module_forward_hook(_training_collectives)
    rank = int(os.environ["RANK"])
    namespace = {"__name__": "__main__"}
    for i, text in enumerate(program):
        exec(compile(text, f"{page} python block {i + 1}", "exec"), namespace)
    Path(root, f"done-{rank}.json").write_text(json.dumps({"blocks": len(program)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
