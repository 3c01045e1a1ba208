"""`megatron-ext`: per-step FlexSP and elastic-pipeline plans from a batch's lengths; train on them, profile, report.

Every command prints a readable table, or JSON with --json. Bad input is one line on stderr and
exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys

from megatron_ext.commands.args import NOTED, ArgumentParser
from megatron_ext.commands.bench import add_bench_command
from megatron_ext.commands.plan import add_plan_command
from megatron_ext.commands.report import add_report_command
from megatron_ext.commands.simulate import add_simulate_command
from megatron_ext.errors import ConfigError, MegatronExtError

# Commands whose options the ranks parse (``commands/launch.py``): the module of each, imported when
# run (it imports torch), with its --help; the rest of the command line is passed on.
LAUNCHED = {"train": "megatron_ext.commands.train", "profile": "megatron_ext.commands.profile"}


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="megatron-ext", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_plan_command(sub)
    add_simulate_command(sub)
    add_bench_command(sub)
    sub.add_parser("train", add_help=False,
                   help="train a small GPT with per-step plans (CPU ranks, or a GPU a rank with CUDA; "
                        "torchrun); --help for options")
    add_report_command(sub)
    sub.add_parser("profile", add_help=False,
                   help="measure the cost model's coefficients here and write a cost-model YAML; --help")
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    NOTED.clear()  # (one command's notes; tests run many in one process)
    try:
        if args.command in LAUNCHED:
            command = importlib.import_module(LAUNCHED[args.command])
            if "-h" in rest or "--help" in rest:
                command.print_help()
                return 0
            return command.run(rest)
        if rest:
            raise ConfigError(f"unrecognized arguments: {' '.join(rest)} (see megatron-ext {args.command} --help)")
        return args.func(args)
    except MegatronExtError as e:
        print(f"megatron-ext: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into head
        return 0
    except KeyboardInterrupt:  # Ctrl-C before a command sets its own handlers (while it imports torch)
        print("megatron-ext: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
