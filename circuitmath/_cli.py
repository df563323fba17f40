"""``python -m circuitmath prove [NAME ...] [--json]``."""

from __future__ import annotations

import argparse
import json
import sys

from ._registry import get_identity, identities

COLUMNS = ("identity", "symbolic dims", "steps", "seconds", "twins rejected", "status")


def _table(rows: list[dict]) -> str:
    cells = [COLUMNS] + [
        (
            r["name"],
            "yes" if r["symbolic_dims"] else "no",
            str(r["steps"]),
            f"{r['seconds']:.3f}",
            f"{r['twins_rejected']}/{r['twins_total']}",
            r["status"],
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _prove(args) -> int:
    try:
        chosen = [get_identity(n) for n in args.names] if args.names else list(identities())
    except KeyError as error:
        print(f"error: {error.args[0]}", file=sys.stderr)
        return 2
    rows = []
    for identity in chosen:
        report = identity.prove()
        rows.append(report.as_dict())
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(_table(rows))
        failed = [r for r in rows if r["status"] != "proved"]
        for r in failed:
            print(f"\n{r['name']}: failed steps {r['failed_steps']}, accepted twins {r['accepted_twins']}")
        total = sum(r["seconds"] for r in rows)
        print(f"\n{len(rows) - len(failed)}/{len(rows)} proved in {total:.2f} s")
    return 0 if all(r["status"] == "proved" for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m circuitmath", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    prove = commands.add_parser("prove", help="check every proof and reject every negative twin")
    prove.add_argument("names", nargs="*", help="identities to prove (default: all)")
    prove.add_argument("--json", action="store_true", help="print a JSON list, one object per identity")
    prove.set_defaults(run=_prove)
    args = parser.parse_args(argv)
    return args.run(args)
