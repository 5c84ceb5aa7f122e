"""A private network namespace with loopback only, for local gRPC workers and their client.

TF 2.21's gRPC server listens on every interface without authentication (``baechi.cluster``).
On one machine that exposure can be removed: a process that re-executes itself inside new user
and network namespaces (``unshare --user --map-root-user --net``, no privileges needed where
the kernel allows unprivileged user namespaces) sees a single interface, ``lo``, so the workers
it starts there, and it alone, can reach their ports. Children inherit the namespace, which
disappears with its last process.

Checked here (Linux, util-linux ``unshare``): works as root and as an unprivileged user (uid
65534); the new namespace's ``lo`` starts down and is brought up by ``bring_up_loopback``.
Containers whose seccomp profile forbids ``unshare`` and kernels with
``kernel.unprivileged_userns_clone=0`` refuse it: ``unavailable_reason`` says why.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
from typing import NoReturn

from graphfit.errors import GraphfitError

__all__ = ["NamespaceError", "bring_up_loopback", "enter_isolated_network",
           "network_interfaces", "unavailable_reason"]

_UNSHARE = ["--user", "--map-root-user", "--net"]
# Set on the re-executed process, so a namespace that still shows other interfaces is an error
# instead of a loop of re-executions.
_MARK = "GRAPHFIT_ISOLATED_NETWORK"
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


class NamespaceError(GraphfitError, RuntimeError):
    """A private network namespace cannot be had here (the reason is in the message)."""


def network_interfaces() -> list[str]:
    """The interfaces of this process's network namespace (``/proc/net/dev``, which, unlike
    ``/sys/class/net``, follows the namespace)."""
    with open("/proc/net/dev") as f:
        return sorted(line.split(":")[0].strip() for line in f.readlines()[2:])


def unavailable_reason() -> str | None:
    """``None`` when ``unshare`` can make user + network namespaces here; else why not."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "the unshare program (util-linux) is not installed"
    try:
        result = subprocess.run([unshare, *_UNSHARE, "true"], capture_output=True, text=True,
                                timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unshare failed: {error}"
    if result.returncode != 0:
        return (f"`unshare {' '.join(_UNSHARE)}` is refused here ({result.stderr.strip()}): "
                "the kernel or the container forbids unprivileged user namespaces "
                "(kernel.unprivileged_userns_clone, user.max_user_namespaces or a seccomp "
                "profile)")
    return None


def bring_up_loopback() -> None:
    """Set ``lo`` up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def enter_isolated_network(command: list[str]) -> None:
    """Make sure this process runs in a network namespace with only loopback.

    Inside one already (only ``lo``): bring ``lo`` up and return. Otherwise re-execute
    ``command`` (this program again, e.g. ``[sys.executable, "-m", module, *args]``) under
    ``unshare``; this call then does not return.

    Raises:
        NamespaceError: namespaces are not available here, or the re-executed process still
            sees other interfaces.
    """
    interfaces = network_interfaces()
    if interfaces == ["lo"]:
        bring_up_loopback()
        return
    if os.environ.get(_MARK):
        raise NamespaceError(f"inside the new namespace the interfaces are {interfaces}, not "
                             "only lo")
    reason = unavailable_reason()
    if reason:
        raise NamespaceError(f"cannot isolate the gRPC workers' network: {reason}. Run without "
                             "the isolation on a trusted network, or behind a firewall")
    _reexec([shutil.which("unshare"), *_UNSHARE, "--", *command])


def _reexec(command: list[str]) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, {**os.environ, _MARK: "1"})
