#!/usr/bin/env python3
"""Which C++ sources clang-tidy must check since the last tree found clean (scripts/check_tidy.sh).

    scripts/tidy_changed.py BUILD_DIR BASELINE_COMMIT

Prints the sources (paths from the repository root), one per line, whose result may differ from
BASELINE_COMMIT's, where every source was checked and clean: each source changed since then
(committed or not, or new and not ignored), and each source that includes a changed file, read
from the build's dependency records (`ninja -t deps`, so BUILD_DIR must have been built). A
changed Cap'n Proto schema counts as a change of the headers generated from it.

Prints ALL on the first line, then the reason, when the set cannot be narrowed: the baseline is
not an ancestor of HEAD (or absent, e.g. a shallow clone), the build has no dependency records,
or the checks themselves changed (.clang-tidy, the scripts).
"""
import os
import subprocess
import sys

# A change to any of these can change every source's result.
CHANGES_EVERYTHING = {".clang-tidy", "scripts/check_tidy.sh", "scripts/tidy_changed.py"}


def git(*args):
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def everything(reason):
    print("ALL")
    print(reason)
    sys.exit(0)


def changed_paths(baseline):
    if subprocess.run(["git", "cat-file", "-e", baseline + "^{commit}"],
                      capture_output=True).returncode != 0:
        everything(f"the baseline {baseline} is not in this clone")
    if subprocess.run(["git", "merge-base", "--is-ancestor", baseline, "HEAD"]).returncode != 0:
        everything(f"the baseline {baseline} is not an ancestor of HEAD")
    # The working tree against the baseline: commits since, staged and unstaged changes; then new
    # files git does not ignore.
    paths = set(git("diff", "--name-only", baseline).split())
    paths |= set(git("ls-files", "--others", "--exclude-standard").split())
    return paths


def dependencies(build_dir):
    """{source path from the repository root: [dependency paths from the repository root]}."""
    deps_text = subprocess.run(["ninja", "-C", build_dir, "-t", "deps"], check=True,
                               capture_output=True, text=True).stdout
    root = os.getcwd()
    build_abs = os.path.abspath(build_dir)
    sources = {}
    current = None
    for line in deps_text.splitlines():
        if not line.strip():
            current = None
            continue
        if not line.startswith(" "):
            # "<object>: #deps N, deps mtime T (VALID|STALE)": the source is the first dependency.
            current = [] if line.split(":")[0].endswith(".o") else None
            continue
        if current is None:
            continue
        path = os.path.normpath(os.path.join(build_abs, line.strip()))
        rel = os.path.relpath(path, root)
        if rel.startswith(".."):
            continue  # a system header
        if not current:
            sources[rel] = current
        current.append(rel)
    return sources


def main():
    build_dir, baseline = sys.argv[1], sys.argv[2]
    changed = changed_paths(baseline)
    touched = sorted(changed & CHANGES_EVERYTHING)
    if touched:
        everything(f"{', '.join(touched)} changed since {baseline[:12]}")
    sources = dependencies(build_dir) if os.path.exists(os.path.join(build_dir, ".ninja_deps")) else {}
    if not sources:
        everything(f"{build_dir} has no dependency records (build it first)")
    generated = os.path.relpath(os.path.join(os.path.abspath(build_dir), "generated"))
    schema_changed = any(path.endswith(".capnp") for path in changed)
    selected = {path for path in changed if path.endswith(".cc") and os.path.exists(path)}
    for source, deps in sources.items():
        if any(dep in changed for dep in deps) or (
                schema_changed and any(dep.startswith(generated + "/") for dep in deps)):
            if source.endswith(".cc"):
                selected.add(source)
            elif "/Unity/unity_" in source:
                # A unity build's combined source (TESSERA_UNITY): which of its members saw the
                # change is not recorded, so all of them are checked.
                selected |= {dep for dep in deps if dep.endswith(".cc") and
                             not dep.startswith(generated + "/") and os.path.exists(dep)}
    for path in sorted(selected):
        print(path)


if __name__ == "__main__":
    main()
