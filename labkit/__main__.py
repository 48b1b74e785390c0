"""``python -m labkit demo [flags]``: the headless demo (``--help`` for the flags)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m labkit demo [flags]\n\n  demo   train the toy task through injected faults "
              "(python -m labkit demo --help)")
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"labkit: unknown command {argv[0]!r}; the only command is 'demo'", file=sys.stderr)
        return 2
    from .lab.demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
