"""The binaries (``train``, ``place``, ``worker``, ``communication_benchmark``, ``sweep``).

Importing this package sets TensorFlow's C++ log level to 2 (errors only) unless the user set
``TF_CPP_MIN_LOG_LEVEL``: a binary's output is read by a person, and TF's informational lines
otherwise outnumber its own (``cli.quiet_tensorflow`` handles the lines TF prints before it
reads the variable). It runs before any binary imports TensorFlow, and processes the binaries
start (gRPC workers) inherit it.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
