#!/usr/bin/env python3
"""Lists the hosted API's operations that Rialto's OpenAPI document lacks.

    python3 scripts/operations_diff.py [--all] [HOSTED] [RIALTO]

HOSTED defaults to ../shared/reference/hosted-api.openapi.yaml, RIALTO to
the document the gateway serves (crates/rialto-gateway/src/openapi.yaml).
Both documents are compared as `METHOD /path` after the servers' prefixes
(`/api/v1`) are removed and path parameters are renamed to `{}`, so
`/characters/{slug}` and `/characters/{id}` are one operation. It prints
each hosted operation Rialto lacks, and with `--all` also the operations
Rialto has that the hosted API does not. Exit status 1 when something is
missing: a script in `make test` keeps the list empty.
"""

import re
import sys
from pathlib import Path

import yaml

METHODS = {"get", "post", "put", "patch", "delete"}
ROOT = Path(__file__).resolve().parent.parent


def operations(path: Path) -> dict[str, str]:
    document = yaml.safe_load(path.read_text())
    found = {}
    for route, item in (document.get("paths") or {}).items():
        shape = re.sub(r"\{[^}]*\}", "{}", route.removeprefix("/api/v1"))
        for method, operation in item.items():
            if method in METHODS:
                summary = (operation or {}).get("summary") or ""
                found[f"{method.upper()} {shape}"] = summary
    return found


def main(argv: list[str]) -> int:
    show_all = "--all" in argv
    paths = [a for a in argv if not a.startswith("--")]
    hosted = Path(paths[0]) if paths else ROOT.parent / "shared/reference/hosted-api.openapi.yaml"
    rialto = Path(paths[1]) if len(paths) > 1 else ROOT / "crates/rialto-gateway/src/openapi.yaml"
    theirs, ours = operations(hosted), operations(rialto)
    missing = sorted(set(theirs) - set(ours))
    for operation in missing:
        print(f"missing  {operation}  ({theirs[operation]})")
    if show_all:
        for operation in sorted(set(ours) - set(theirs)):
            print(f"extra    {operation}  ({ours[operation]})")
    print(f"{len(theirs)} hosted operations, {len(theirs) - len(missing)} served by Rialto, "
          f"{len(missing)} missing", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
