"""`python -m hvdx.data`: the node stores DataCache left in node memory, and where its local
disk copies go.

    python -m hvdx.data list  [--store-dir DIR]          # every store: size, in use or stale, data set
    python -m hvdx.data clear [--store-dir DIR] [NAME ...]  # remove stale stores (all, or those named)

A store is in use while a process has it open (`hvdx.data.store.list_stores`); `clear`
never removes one in use. Exit status: 0, or 1 when a named store was not found or is in use.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from hvdx.data.pages import huge_pages
from hvdx.data.store import DEFAULT_STORE_DIR, list_stores, remove_store


def _describe(meta: Optional[dict]) -> str:
    if not meta:
        return "written by an older hvdx"
    return (f"node {meta.get('node')} of {meta.get('num_nodes')}, split {meta.get('split_seed')}, "
            f"hvdx {meta.get('hvdx')}, data set {str(meta.get('fingerprint', '?'))[:12]}")


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m hvdx.data", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("list", "list the node stores"), ("clear", "remove node stores no process uses")):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--store-dir", default=DEFAULT_STORE_DIR, help=f"default {DEFAULT_STORE_DIR}")
        if name == "clear":
            sub.add_argument("names", nargs="*", help="stores to remove (default: every stale one)")
    args = parser.parse_args(argv)
    stores = list_stores(args.store_dir)

    if args.command == "list":
        import os

        from hvdx.data.disk import default_cache_dir

        print(f"node stores in {args.store_dir}: {len(stores)}, "
              f"{sum(s.bytes for s in stores) / 2**20:.1f} MiB")
        for s in stores:
            print(f"  {s.name}  {s.bytes / 2**20:9.1f} MiB  {'in use' if s.in_use else 'stale '}  {_describe(s.meta)}")
        if huge_pages(args.store_dir):
            print("pages: huge (a tmpfs mounted with huge pages: a process maps a slab with one entry per 2 MiB)")
        else:
            print("pages: 4 KiB (a process maps a slab with one page-table entry per 4 KiB; a tmpfs mounted with "
                  "huge=within_size needs 512 times fewer: docs/datacache.md, \"Huge pages\")")
        print(f"level-1 (local disk) copies: {os.path.abspath(default_cache_dir())} "
              "(HVDX_DATACACHE_DIR, else $TMPDIR or /tmp)")
        return 0

    status = 0
    by_name = {s.name: s for s in stores}
    chosen = [s for s in stores if not s.in_use] if not args.names else []
    for name in args.names:
        if name not in by_name:
            print(f"no store {name!r} in {args.store_dir} (see `python -m hvdx.data list`)", file=sys.stderr)
            status = 1
        else:
            chosen.append(by_name[name])
    for s in chosen:
        if remove_store(s.path):
            print(f"removed {s.path} ({s.bytes / 2**20:.1f} MiB)")
        else:
            print(f"kept {s.path}: a process has it open (stop that job first)", file=sys.stderr)
            status = 1
    if not chosen and not args.names:
        print(f"no stale stores in {args.store_dir}")
    return status


if __name__ == "__main__":
    sys.exit(main())
