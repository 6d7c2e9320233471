#!/usr/bin/env python3
"""Prints the test executables (tests/CMakeLists.txt's tessera_add_test) that hold a test
matching a ctest -R pattern, so a run of a few tests builds only those executables.

  scripts/test_targets.py PATTERN [LABEL]    (LABEL: only executables with that label)

A test's name is Suite.Name, read from the TEST/TEST_F/TEST_P(Suite, Name) of the executable's
sources, as gtest_discover_tests names it (a parameterised instance adds a prefix and a suffix,
which a pattern that matches Suite.Name still matches). Prints unit_tests when nothing matches,
so a caller builds every unit test rather than none.
"""
import os
import re
import sys

pattern = re.compile(sys.argv[1])
label = sys.argv[2] if len(sys.argv) > 2 else None
tests_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
with open(os.path.join(tests_dir, "CMakeLists.txt")) as f:
    cmake = f.read()
found = []
for m in re.finditer(r"tessera_add_test\(\s*(\w+)\s+SOURCES\s+(.*?)\s+LABELS\s+(.*?)\)", cmake, re.S):
    labels = m.group(3).split("LIBS")[0].split()
    if label and label not in labels:
        continue
    names = []
    for source in m.group(2).split():
        with open(os.path.join(tests_dir, source)) as f:
            names += [suite + "." + name for suite, name in re.findall(
                r"\b(?:TEST|TEST_F|TEST_P|TYPED_TEST|TYPED_TEST_P)\(\s*(\w+)\s*,\s*(\w+)\s*\)",
                f.read())]
    if any(pattern.search(name) for name in names):
        found.append(m.group(1))
print(" ".join(found) or "unit_tests")
