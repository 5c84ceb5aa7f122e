"""Offline stand-in for @rules_cc//cc:defs.bzl: forwards the C++ rules to Bazel's native ones.

Bazel 4.2.3's own @bazel_tools loads these symbols from @rules_cc and would otherwise download
rules_cc from GitHub. This project builds no C++; the forwarders only have to exist.
"""

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)
