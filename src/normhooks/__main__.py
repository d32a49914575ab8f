"""The ``normhooks`` command (also ``python -m normhooks``): ``normhooks demo [options]`` and
``normhooks check [--json PATH]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from normhooks import __version__, _selfcheck
from normhooks.demo import cli

__all__ = ["main"]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="normhooks",
        description="GradientLARS, weight standardization and weight normalization for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"normhooks {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        prog=cli.PROG,
        help="train small CNNs over several seeds to test each paper's claims",
        description="Tests the claims of the LARS, weight standardization and weight "
        "normalization papers on bundled data (scikit-learn's digits) in a few "
        "minutes on a CPU: every configuration over several seeds, a table of means with 95 % "
        "intervals, one verdict per claim (reproduced, contradicted or inconclusive, from the "
        "interval of the paired difference), and results.json plus one PNG of curves per "
        "experiment in --out.",
    )
    cli.add_arguments(demo)
    check = commands.add_parser(
        "check",
        prog="normhooks check",
        help="check this machine's kernels against the plain formula, and time them",
        description="Prints normhooks', torch's and Triton's versions, the device and the path "
        "each technique takes. On CUDA, compares every kernel path (per layer and fused; "
        "float32, bfloat16, float16; forward and backward) with the plain torch formula on the "
        "device and times it against its peer: one verdict per line, exit status 1 on any "
        "mismatch or failure. Without CUDA there is nothing to check (exit status 0).",
    )
    check.add_argument(
        "--json", metavar="PATH", help="also write the report as JSON to PATH (to send back)"
    )
    return parser, {"demo": demo, "check": check}


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default: the process's arguments) and runs the command.

    Returns:
        The exit status: 0 on success, 2 for a reported error (``check``: 1 when a kernel
        disagrees with the formula or fails). Argument errors exit with status 2 through
        :mod:`argparse`.
    """
    parser, commands = _parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # Reported by the command's own parser, so the usage shown is the command's.
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "check":
        if args.json is not None and not Path(args.json).absolute().parent.is_dir():
            # Said before the check runs, not after it: a GPU run takes up to a minute.
            commands["check"].error(f"--json {args.json}: its directory does not exist")
        return _selfcheck.run(args.json)
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
