"""`vllm-sekv sessions list|delete|cleanup --nvme-dir DIR ...`.

Calls into `nvme_sessions` (imported on use: it needs torch) for each model
folder of DIR, holding that folder's lock. Exit status 1 when `delete` finds
nothing to delete; 2, with the reason on stderr, when DIR cannot be used
(a server holds it, it is not a folder, a value is bad).
"""
from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Inspect and clean an NVMe folder (a server's nvme_dir) while no server uses it.

Each command takes the folder's lock, so it refuses to run while a server uses
the folder (and a server refuses to start while a command runs). A tenant is
named by its cache_salt (default: none), turned into its tenant key with the
folder's secret (--hash-secret, or SEKV_HASH_SECRET, if the server was given
one)."""

ACTIONS = {
    "list": "list the sessions of each model folder",
    "delete": "delete a session (and the histories it forked away from), or every session and block of a tenant",
    "cleanup": "delete idle sessions and old block files, then the oldest until the folder fits a size",
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("sessions", help="inspect and clean an NVMe folder no server uses",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in ACTIONS.items():
        p = actions.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        p.add_argument("--nvme-dir", required=True, metavar="DIR", help="the server's nvme_dir")
        p.set_defaults(run=run)
    delete, cleanup = actions.choices["delete"], actions.choices["cleanup"]
    delete.add_argument("session_id", nargs="?", metavar="SESSION_ID", help="the session to delete")
    delete.add_argument("--all-of-tenant", action="store_true",
                        help="delete every session and block of the tenant instead")
    delete.add_argument("--cache-salt", default="", metavar="SALT", help="the tenant's cache_salt, if any")
    delete.add_argument("--hash-secret", default=None, metavar="SECRET",
                        help="the server's hash_secret, if it was given one (default: $SEKV_HASH_SECRET, "
                             "else the folder's secret file)")
    cleanup.add_argument("--older-than", default=None, metavar="AGE",
                         help="delete sessions idle, and unlisted block files older, than this: 30m, 12h, 7d")
    cleanup.add_argument("--max-bytes", default=None, metavar="SIZE",
                         help="then delete the oldest block files until the folder holds at most this: 100G")


def run(args: argparse.Namespace) -> int:
    from vllm_sekv.cli import nvme_sessions as ns
    from vllm_sekv.config_values import parse_size_bytes

    try:
        if args.action == "delete" and (args.session_id is None) == (not args.all_of_tenant):
            raise ValueError("delete: give a SESSION_ID or --all-of-tenant (not both)")
        layouts = ns.model_folders(args.nvme_dir)
        if args.action == "list":
            for layout in layouts:
                with ns.locked(layout):
                    ns.cmd_list(layout)
        elif args.action == "delete":
            tenant = ns.tenant_keys(args.nvme_dir, args.hash_secret).of(args.cache_salt)
            found = 0
            for layout in layouts:
                with ns.locked(layout):
                    found += ns.cmd_delete(layout, tenant, args.session_id)
            if not found:
                what = f"session {args.session_id!r}" if args.session_id is not None else "that tenant"
                print(f"nothing of {what} in {args.nvme_dir}")
                return 1
        else:
            older = ns.parse_age_s(args.older_than) if args.older_than else None
            max_bytes = parse_size_bytes("--max-bytes", args.max_bytes) if args.max_bytes else None
            for layout in layouts:
                with ns.locked(layout):
                    ns.cmd_cleanup(layout, older, max_bytes)
    except ns.ERRORS as e:
        print(f"vllm-sekv sessions: {e}", file=sys.stderr)
        return 2
    return 0
