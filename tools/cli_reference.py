"""Write the README's CLI reference (one row per command: arguments, what it does, its options) from the Typer app.

python tools/cli_reference.py           # rewrite the table between the README's cli-reference markers
python tools/cli_reference.py --check   # exit 1 when the README's table differs from the app
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

README = ROOT / "README.md"
START, END = "<!-- cli-reference:start -->", "<!-- cli-reference:end -->"


def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every leaf command of the app as ("search dcs", command), in the app's order."""
    for name, sub in group.commands.items():
        if hasattr(sub, "commands"):
            yield from commands(sub, (*path, name))
        else:
            yield " ".join((*path, name)), sub


def row(name: str, cmd: Any) -> str:
    args = " ".join(p.name.upper() for p in cmd.params if p.param_type_name == "argument")
    opts = []
    for p in cmd.params:
        if p.param_type_name != "option" or p.hidden or "--help" in p.opts:
            continue
        opts.append(f"`{max(p.opts, key=len)}`")
    what = " ".join((cmd.help or "").split("\n\n")[0].split()).replace("|", "\\|")
    return f"| `{name}{' ' + args if args else ''}` | {what} | {' '.join(opts)} |"


def reference() -> str:
    import typer

    from nascompress.cli.main import app

    rows = [row(name, cmd) for name, cmd in commands(typer.main.get_command(app))]
    return "\n".join(["| command | what it does | options |", "|---|---|---|", *rows])


def with_reference(readme: str, table: str) -> str:
    start, end = readme.find(START), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{README.name} has no {START} ... {END} markers")
    return readme[: start + len(START)] + "\n" + table + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when the README is out of date")
    args = ap.parse_args(argv)
    readme = README.read_text()
    new = with_reference(readme, reference())
    if args.check:
        if new != readme:
            print("the README's CLI reference is out of date: run python tools/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    print(f"wrote the CLI reference into {README.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
