import argparse
import importlib
import sys

from . import DEFAULT_SUITE, SUITES


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m torch_lowbit.bench", add_help=False)
    p.add_argument("--suite", choices=sorted(SUITES), default=DEFAULT_SUITE)
    args, rest = p.parse_known_args(argv)
    if ("-h" in rest or "--help" in rest) and "--suite" not in argv:
        print(f"usage: python -m torch_lowbit.bench [--suite {{{','.join(sorted(SUITES))}}}] [suite options]\n"
              f"default suite: {DEFAULT_SUITE}; `--suite NAME --help` lists a suite's options")
        return 0
    return importlib.import_module(SUITES[args.suite]).run(rest)


if __name__ == "__main__":
    sys.exit(main())
