"""``python -m labkit demo|export [flags]``: the headless demo, and replaying a log into trackers."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m labkit demo|export [flags]\n\n  demo   train the toy task through injected faults "
              "(python -m labkit demo --help)\n  export replay a log.jsonl into TensorBoard, trackio, MLflow or W&B "
              "(python -m labkit export --help)")
        return 0 if argv else 2
    if argv[0] == "export":
        from .export.replay import main as export_main

        return export_main(argv[1:])
    if argv[0] != "demo":
        print(f"labkit: unknown command {argv[0]!r}; the commands are 'demo' and 'export'", file=sys.stderr)
        return 2
    from .lab.demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
