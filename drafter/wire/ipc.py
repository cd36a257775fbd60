"""ZMQ ipc:// endpoints (a target and its drafter on one host): the path rules both sides apply.

An ipc socket is a file: who may connect is decided by its permissions, and who may pose as the
drafter by the permissions of its directory.  So, on both sides:
  * the path is absolute and fits a Unix socket address (107 bytes); Linux abstract sockets
    (ipc://@name) are refused: no file permissions protect them, any local process may connect;
  * the directory exists and nobody but its owner and group may replace entries in it: not
    writable by others, unless the sticky bit is set (as on /tmp, where only an entry's owner
    may remove or rename it);
  * what is already at the path must be a Unix socket.
The server also creates the socket with permissions `mode` (default 0600: this user only; 0660
adds the group, e.g. a pod's fsGroup); bits for others are refused.  It replaces a stale socket
of its own user (a previous run that died) and never any other file.  CURVE, when configured,
applies on ipc:// exactly as on tcp://.
"""

from __future__ import annotations

import os
import stat

SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
DEFAULT_MODE = 0o600


class IpcPathError(ValueError):
    pass


def ipc_path(endpoint: str) -> str:
    """The filesystem path of an ipc:// endpoint (or of a bare path)."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else endpoint


def _check_syntax(path: str) -> None:
    if not path:
        raise IpcPathError("ipc: empty path")
    if path.startswith("@") or "\0" in path:
        raise IpcPathError(f"ipc://{path}: abstract sockets have no file permissions; use a path in a private "
                           f"directory")
    if not os.path.isabs(path):
        raise IpcPathError(f"ipc://{path}: the path must be absolute")
    if len(os.fsencode(path)) > SUN_PATH_MAX:
        raise IpcPathError(f"ipc://{path}: {len(os.fsencode(path))} bytes; a Unix socket path holds at most "
                           f"{SUN_PATH_MAX}")


def _check_directory(path: str) -> None:
    parent = os.path.dirname(path) or "/"
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise IpcPathError(f"ipc://{path}: directory {parent} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise IpcPathError(f"ipc://{path}: {parent} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise IpcPathError(f"ipc://{path}: directory {parent} is writable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}) without the sticky bit: anyone could replace the socket")


def check_client_path(endpoint: str) -> str:
    """Checks before connecting; the socket itself may not exist yet (the drafter may start later)."""
    path = ipc_path(endpoint)
    _check_syntax(path)
    if os.path.isdir(os.path.dirname(path) or "/"):
        _check_directory(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(st.st_mode):
        raise IpcPathError(f"ipc://{path}: exists and is not a socket")
    return path


def check_server_path(endpoint: str, mode: int = DEFAULT_MODE) -> str:
    """Checks before binding; removes a stale socket of this user.  Returns the path."""
    path = ipc_path(endpoint)
    _check_syntax(path)
    if mode & 0o007 or mode & ~0o770:
        raise IpcPathError(f"ipc://{path}: socket mode {mode:04o} must grant nothing to others (e.g. 0600 or 0660)")
    _check_directory(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISSOCK(st.st_mode):
        raise IpcPathError(f"ipc://{path}: exists and is not a socket; not replacing it")
    if st.st_uid != os.geteuid():
        raise IpcPathError(f"ipc://{path}: a socket of another user (uid {st.st_uid}) is there; not replacing it")
    os.unlink(path)  # stale: left by a run of ours that did not close cleanly (libzmq would replace it too)
    return path


def bind_ipc(sock, endpoint: str, mode: int = DEFAULT_MODE) -> str:
    """Bind a ZMQ socket to ipc://path with the rules above; the socket file gets `mode`.
    Returns the endpoint as bound (ipc://path)."""
    path = check_server_path(endpoint, mode)
    old = os.umask(0o177)  # created 0600 at once: no moment in which others could connect
    try:
        sock.bind(f"ipc://{path}")
    finally:
        os.umask(old)
    os.chmod(path, mode)
    return f"ipc://{path}"


def unlink_ipc(endpoint: str) -> None:
    """Remove the socket file after closing (only a socket of this user)."""
    path = ipc_path(endpoint)
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
            os.unlink(path)
    except OSError:
        pass
