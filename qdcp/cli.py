"""The ``qdcp`` command line (``qdcp VERB --help``: inspect, verify, convert, export, list, prune).

Every verb works without the libraries of the quantized types a checkpoint stores where their
adapter can compute values in plain torch (TransformerEngine's: TE need not be importable). Long
work shows a progress bar (entries and bytes) on a terminal; ``--quiet`` turns it off.

Exit status: 0 success, 1 a check failed (``verify``), 2 a refusal: bad usage, a missing or
unreadable checkpoint, an output or a value qdcp cannot use (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings
from typing import Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DTYPES = ("bf16", "fp16", "fp32")  # --dtype (qdcp.commands maps them to torch's, in this order)

_DESCRIPTION = "Inspect, verify, convert, export, list and prune qdcp/DCP checkpoints."
_CHECKPOINT = "the qdcp/DCP checkpoint (a directory)"
_RUN = "the directory holding a run's checkpoints (step_100, ...)"


def _verb(sub, name: str, help: str, path: str, *flags: str) -> argparse.ArgumentParser:
    """The parser of ``qdcp NAME PATH`` (``flags``: ``--quiet`` / ``--json``, which every verb means alike)."""
    p = sub.add_parser(name, help=help)
    p.add_argument("path", help=path, metavar="DIR" if path == _RUN else None)
    p.set_defaults(func="cmd_" + name)
    for flag in flags:
        p.add_argument(flag, action="store_true", help={"--quiet": "no progress bar",
                                                        "--json": "machine-readable output"}[flag])
    return p


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every refusal (argparse's own prints its usage first)
        self.exit(EXIT_USAGE, f"{self.prog}: {message} ({self.prog} --help for more)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``qdcp`` argument parser (every argument has help text)."""
    parser = _Parser(prog="qdcp", description=_DESCRIPTION)
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE first, to register adapters of your own (repeatable); "
                             "nothing is ever imported because a checkpoint names it")
    sub = parser.add_subparsers(dest="command", required=True, help="what to do (qdcp VERB --help for more)")
    _verb(sub, "inspect", "table of entries: storage, type, shape, bytes", _CHECKPOINT, "--json")
    _verb(sub, "verify", "read every entry (checksums checked) and compute its values; check chunks",
          _CHECKPOINT, "--quiet")
    p = _verb(sub, "convert", "export to safetensors or a dequantized DCP checkpoint", _CHECKPOINT,
              "--quiet")
    p.add_argument("out", help="the file (--to safetensors, --to torch) or directory (--to dcp) to write; "
                               "never inside or around PATH")
    p.add_argument("--to", choices=["safetensors", "dcp", "torch"], required=True,
                   help="safetensors: one file (raw components, or values with --dequantize); "
                        "dcp: a plain DCP checkpoint (needs --dequantize); torch: one torch.save file "
                        "of whole entries, as DCP's dcp_to_torch_save (quantized entries as their "
                        "type, or values with --dequantize)")
    p.add_argument("--dequantize", action="store_true", help="write plain high-precision tensors")
    p.add_argument("--dtype", choices=DTYPES,
                   help="dtype of floating outputs (dequantized values are computed in it)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if qdcp wrote it (a qdcp safetensors file, a DCP checkpoint)")
    _add_export(_verb(sub, "export", "write a Hugging Face safetensors directory an inference engine "
                      "loads (torchao or compressed-tensors layout), raw bits carried over", _CHECKPOINT, "--quiet"))
    _verb(sub, "list", "a run's checkpoints (the directories in DIR): step, state, size, age", _RUN,
          "--json")
    p = _verb(sub, "prune", "remove a run's complete checkpoints but the last K, and what failed saves "
              "left (prints what it would remove unless --yes)", _RUN)
    p.add_argument("--keep", type=int, required=True, metavar="K",
                   help="complete checkpoints to keep (at least 1: the latest is never removed)")
    p.add_argument("--yes", action="store_true", help="remove them (default: only print what would be removed)")
    return parser


def _add_export(p: argparse.ArgumentParser) -> None:
    """The arguments of ``qdcp export`` after PATH."""
    p.add_argument("out", help="the directory to write; never inside or around PATH")
    p.add_argument("--format", choices=["torchao", "compressed-tensors"], required=True,
                   help="the layout: torchao's (transformers + torchao load it) or compressed-tensors' "
                        "(vLLM, transformers)")
    p.add_argument("--config", help="config.json of the model; the format's quantization_config is added to it")
    p.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB); above it, sharded "
                                                           "files and model.safetensors.index.json")
    p.add_argument("--dequantize-unsupported", action="store_true",
                   help="write entries the format cannot represent as their dequantized values "
                        "(default: refuse, naming them, before writing anything)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it holds only what an export writes (model*.safetensors, the index, "
                        "config.json)")
    p.add_argument("--prefix", help="export the subtree under PREFIX only, its keys written without it "
                                    "(--prefix model for a checkpoint of {'model': ..., 'optim': ...})")
    p.add_argument("--include-optimizer", action="store_true",
                   help="also export optimizer states (default: left out, and listed)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qdcp`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    for module in args.imports:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # `--import mymodule` from the directory holding it
        try:
            importlib.import_module(module)
        except ImportError as e:
            print(f"qdcp: --import {module}: {e}", file=sys.stderr)
            return EXIT_USAGE
    from qdcp import outputs
    from qdcp.errors import QdcpError

    try:
        return getattr(importlib.import_module("qdcp.commands"), args.func)(args)
    except (QdcpError, OSError, ValueError) as e:  # ValueError: an argument's value (a size...) qdcp cannot use
        # a checkpoint's problem says which one; a path that cannot be used as given names itself
        ours = isinstance(e, QdcpError) and not isinstance(e, (outputs.OutputError, OSError))
        where = f"{args.path}: " if ours else ""
        print(f"qdcp: {where}{one_line(e)}", file=sys.stderr)
        return EXIT_USAGE


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


if __name__ == "__main__":
    sys.exit(main())
