"""``python -m labkit demo|show|grading|export|sweep ...``: demo, a log shown, grader, trackers, LR sweep."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {  # name: (module whose main(argv) runs it, what it does); imported only when run
    "demo": ("labkit.lab.demo", "train the toy task through injected faults"),
    "show": ("labkit.lab.show", "a log.jsonl from any loop: its event lines, summary and figure (PNG)"),
    "grading": ("labkit.grading.__main__", "release and grade the exercises"),
    "export": ("labkit.export.replay", "replay a log.jsonl into TensorBoard, trackio, MLflow or W&B"),
    "sweep": ("labkit.lab.sweep.cli", "final loss against learning rate on the GPT task, per mitigation"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m labkit {{{','.join(COMMANDS)}}} ...\n")
        for name, (_, what) in COMMANDS.items():
            print(f"  {name:<8} {what} (python -m labkit {name} --help)")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"labkit: unknown command {argv[0]!r}; the commands are {', '.join(map(repr, COMMANDS))}",
              file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
