#!/bin/sh
# Placeholder for Bazel's coverage tools (see ../README.md).
echo "remote_coverage_tools: coverage is not available in this offline Bazel setup" >&2
exit 1
