"""`python -m docs.gen OUT`: write every generated page under OUT (to read or diff them)."""

from __future__ import annotations

import sys
from pathlib import Path

from docs.gen.pages import pages


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "build/reference")
    for path, content in pages().items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        print(target)


if __name__ == "__main__":
    main()
