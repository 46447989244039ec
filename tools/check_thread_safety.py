#!/usr/bin/python3
"""Checks every source file of a build's compile_commands.json with clang's syntax pass only.

The build must be configured with clang and PATHWAYS_THREAD_SAFETY=ON (so each command carries
-Wthread-safety -Werror=thread-safety) and have its generated headers made; `make thread-safety`
does both. Each command is run with -fsyntax-only instead of compiling: the lock annotations are
checked as a full build would check them, in a fraction of its time (no code is generated).
Generated sources in the build tree are left out. Exit status 1 if any file fails.

Usage: check_thread_safety.py BUILD_DIR/compile_commands.json [--jobs N]
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys


def syntax_only(command: str) -> list:
    """The compile command with its output dropped and -fsyntax-only in place of -c."""
    args = shlex.split(command)
    out = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a == "-c":
            continue
        out.append(a)
    out.insert(1, "-fsyntax-only")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compile_commands")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    build_dir = os.path.dirname(os.path.abspath(args.compile_commands))
    with open(args.compile_commands) as f:
        entries = json.load(f)
    entries = [e for e in entries if not os.path.abspath(e["file"]).startswith(build_dir + os.sep)]
    if not entries:
        print(f"no sources in {args.compile_commands}", file=sys.stderr)
        return 1
    if not any("-Werror=thread-safety" in e["command"] for e in entries):
        print("the build was not configured with PATHWAYS_THREAD_SAFETY=ON", file=sys.stderr)
        return 1

    def check(entry):
        r = subprocess.run(syntax_only(entry["command"]), cwd=entry["directory"], capture_output=True, text=True)
        return entry["file"], r.returncode, r.stderr

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for i, (source, code, errors) in enumerate(pool.map(check, entries), 1):
            if code != 0:
                failed += 1
                print(f"FAILED {os.path.relpath(source)}\n{errors}", flush=True)
            elif sys.stdout.isatty():
                print(f"\r{i}/{len(entries)}", end="", flush=True)
    print(f"\n{len(entries) - failed} of {len(entries)} files pass clang's -Wthread-safety")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
