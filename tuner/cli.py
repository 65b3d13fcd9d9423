"""``dsa-tune``: the tuner's command line."""
from __future__ import annotations

import argparse
import sys


def cmd_env(args: argparse.Namespace) -> int:
    import dsa_triton
    from dsa_triton.runtime import environment

    for key, value in environment().items():
        print(f"{key}: {value}")
    print(f"kernels: {', '.join(s.name for s in dsa_triton.registry.kernels()) or '(none registered)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsa-tune", description="Tune dsa-triton kernels per device, phase and shape.")
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the device, torch/triton versions, interpreter state and kernels")
    env.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
