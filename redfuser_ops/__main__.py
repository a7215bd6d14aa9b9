"""``python -m redfuser_ops [--json] [--variants]``: what this installation contains."""

from __future__ import annotations

import argparse
import json
import sys

import redfuser_ops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redfuser_ops", description=__doc__)
    p.add_argument("--json", action="store_true", help="print info() as JSON")
    p.add_argument("--variants", action="store_true", help="also list every kernel variant")
    args = p.parse_args(argv)
    data = redfuser_ops.info()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(redfuser_ops.format_info(data))
    if args.variants:
        for name, op in data["ops"].items():
            for v in op["variants"]:
                where = v["device"] + (f"/{v['family']}" if v["family"] else "")
                print(f"  {name}  {v['name']}  [{where}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
