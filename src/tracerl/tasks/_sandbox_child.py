"""The program the sandbox runs in its child process (started as `python -I -S -c <this file>`).

It reads one marshal-encoded request on stdin (trusted: the parent wrote it), hardens itself (network namespace, Landlock, resource limits, a
fresh unprivileged uid when started as root), runs the user's code, calls the entry function on each
input and streams one JSON line per call to a dedicated result pipe. It never sees expected outputs:
the parent compares. Stdlib only, and no tracerl import. It imports only C-level modules besides
ctypes (`_signal`, not `signal`; a small JSON writer, not `json`): each pure-Python import costs
milliseconds per program, and starting the child is most of the sandbox's cost.
"""

import _signal
import ctypes
import marshal
import os
import resource
import sys
from _json import encode_basestring_ascii

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_REC, MS_PRIVATE, MS_NOSUID, MS_NODEV = 0x4000, 0x40000, 0x2, 0x4
PR_SET_NO_NEW_PRIVS, PR_SET_DUMPABLE = 38, 4
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
# Landlock filesystem rights we restrict (read and execute stay allowed everywhere).
FS_WRITE_FILE, FS_REMOVE_DIR, FS_REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
FS_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
EXIT_HARDENING_FAILED = 70


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _Timeout(BaseException):
    """Raised by the per-call CPU timer; a BaseException so a bare `except Exception` in user code cannot eat it."""


def _json(v, out, depth=0):
    """Append the JSON text of v to out (what `json.dumps` gives for JSON-like values; NaN/Infinity too)."""
    if depth > 100:
        raise ValueError("output nested too deeply")
    if v is None or v is True or v is False:
        out.append("null" if v is None else "true" if v else "false")
    elif isinstance(v, int):
        out.append(int.__repr__(v))
    elif isinstance(v, float):
        out.append("NaN" if v != v else "Infinity" if v == _INF else "-Infinity" if v == -_INF else float.__repr__(v))
    elif isinstance(v, str):
        out.append(encode_basestring_ascii(v))
    elif isinstance(v, list | tuple):
        out.append("[")
        for k, x in enumerate(v):
            if k:
                out.append(",")
            _json(x, out, depth + 1)
        out.append("]")
    elif isinstance(v, dict):
        out.append("{")
        for k, (key, x) in enumerate(v.items()):
            if not isinstance(key, str):
                if not (key is None or isinstance(key, int | float)):
                    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")
                key = _dumps(key)  # as json.dumps: non-string keys become their JSON text
            out.append("," if k else "")
            out.append(encode_basestring_ascii(key))
            out.append(":")
            _json(x, out, depth + 1)
        out.append("}")
    else:
        raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")


_INF = float("inf")


def _dumps(v):
    out = []
    _json(v, out)
    return "".join(out)


def _send(fd, msg, cap):
    try:
        data = (_dumps(msg) + "\n").encode()
    except Exception as e:  # noqa: BLE001 - sets, objects, huge ints, cycles: the call's output is unusable
        data = (_dumps({"t": msg.get("t"), "i": msg.get("i"), "ok": False,
                        "error": f"UnserializableOutput: {_describe(e)}"}) + "\n").encode()
    if len(data) > cap:
        data = (_dumps({"t": msg.get("t"), "i": msg.get("i"), "ok": False,
                        "error": f"OutputTooLarge: {len(data)} bytes"}) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _isolate_network(libc):
    """Move into an empty network namespace (only a down loopback); return how, or '' if not permitted."""
    if libc.unshare(CLONE_NEWNET) == 0:
        return "netns"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        # Map our own ids, else files we create would belong to the overflow uid and creation fails.
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        return "userns+netns"
    return ""


def _block_sockets():
    """Fallback when no namespace is permitted: make socket creation fail (ctypes can still bypass it)."""
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError(1, "network access is disabled in the sandbox")

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            refuse()

    socket.socket = NoSocket
    for mod in (socket, _socket):
        for name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo", "gethostbyname"):
            if hasattr(mod, name):
                setattr(mod, name, refuse)
    _socket.socket = NoSocket
    return "socket-patch"


def _private_tmp(libc, size_bytes):
    """Root without Landlock: give world-writable dirs private, size-capped tmpfs mounts (discarded at exit)."""
    if libc.unshare(CLONE_NEWNS) != 0:
        return ""
    libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None)
    done = []
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        opts = f"size={max(size_bytes, 65536)},mode=1777".encode()
        if os.path.isdir(d) and libc.mount(b"tmpfs", d.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts) == 0:
            done.append(d)
    return "private-tmp:" + ",".join(done)


def _landlock(libc, workdir_fd):
    """Forbid writing anywhere but the workdir (and /dev/null), TCP, and signals out of the sandbox; return ABI."""
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        return 0
    fs = FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE
    fs |= FS_REFER if abi >= 2 else 0
    fs |= FS_TRUNCATE if abi >= 3 else 0
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    rfd = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if rfd < 0:
        return 0
    try:
        rules = [(workdir_fd, fs)]
        devnull = os.open("/dev/null", os.O_PATH)
        rules.append((devnull, FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)))
        for fd, allowed in rules:
            rule = _PathBeneathAttr(allowed, fd)
            if libc.syscall(SYS_LANDLOCK_ADD_RULE, rfd, LANDLOCK_RULE_PATH_BENEATH, ctypes.byref(rule), 0) != 0:
                return 0
        os.close(devnull)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return 0
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, rfd, ctypes.c_uint32(0)) != 0:
            return 0
        return abi
    finally:
        os.close(rfd)


def _count_my_processes(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status", "rb") as f:
                    for line in f:
                        if line.startswith(b"Uid:"):
                            n += int(line.split()[1]) == uid
                            break
            except OSError:
                pass
    return n


def _open_path_dirs():
    """Open sys.path's directories while still root: the fresh uid may be unable to traverse to them."""
    fds = []
    for i, entry in enumerate(sys.path):
        try:
            fds.append((i, entry, os.open(entry, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            pass
    return fds


def _reach_path_dirs(fds):
    """Point unreadable sys.path entries at /proc/self/fd/N: the magic link skips the parents' permissions
    (e.g. a Python under /root, mode 0700) while files inside are still checked, so imports keep working."""
    moved = {}
    for i, entry, fd in fds:
        if os.access(entry, os.R_OK | os.X_OK):
            os.close(fd)
        else:
            sys.path[i] = moved[entry] = f"/proc/self/fd/{fd}"
    # Packages imported at startup (encodings, ...) find their submodules through __path__: move those too.
    for mod in list(sys.modules.values()):
        paths = getattr(mod, "__path__", None)
        if isinstance(paths, list):
            for k, p in enumerate(paths):
                for old, new in moved.items():
                    if p.startswith(old + os.sep):
                        paths[k] = new + p[len(old):]


def _harden(req):
    """Apply every protection before user code exists; return what was applied (reported to the parent)."""
    lim = req["limits"]
    libc = ctypes.CDLL(None, use_errno=True)
    applied = {}
    for name in req.get("preload", ()):
        # Optional warm-up imports, done before the memory limit and the uid drop.
        try:
            __import__(name)
        except ImportError:
            pass
    target_uid = req.get("uid")
    # Counted before any user namespace exists: inside one, /proc shows every unmapped process as nobody.
    mine = _count_my_processes(os.getuid()) if target_uid is None else 0
    if lim["allow_network"]:
        net = "allowed"
    else:
        net = _isolate_network(libc) if lim["namespaces"] else ""
    applied["network"] = net or _block_sockets()  # the fallback: a Python-level block only
    workdir_fd = os.open(".", os.O_PATH | os.O_DIRECTORY)
    if not lim["landlock"]:
        abi = 0
    else:
        abi = _landlock(libc, workdir_fd)
    applied["landlock_abi"] = abi
    if abi == 0 and os.geteuid() == 0 and lim["namespaces"]:
        applied["filesystem"] = _private_tmp(libc, int(lim["file_size_mb"] * 2**20))
    os.close(workdir_fd)

    mb = 2**20
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu = max(1, int(-(-lim["cpu_s"] // 1)))  # RLIMIT_CPU counts whole seconds: round up
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    fsize = int(lim["file_size_mb"] * mb)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["max_open_files"], lim["max_open_files"]))
    path_fds = [] if target_uid is None else _open_path_dirs()
    if target_uid is not None:
        # A fresh uid: RLIMIT_NPROC is then per-sandbox and exact (root ignores it, so dropping is required),
        # and the child can neither read /proc/<parent>/ nor signal other processes.
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["max_processes"], lim["max_processes"]))
        os.setgroups([])
        os.setgid(target_uid)
        os.setuid(target_uid)
        if os.getuid() != target_uid or os.geteuid() != target_uid:
            raise RuntimeError("uid drop failed")
        applied["uid"] = target_uid
        _reach_path_dirs(path_fds)
    else:
        if net == "userns+netns":
            # NPROC is counted per user namespace, and ours holds only this process: the limit is exact.
            nproc = lim["max_processes"]
        else:
            # Same uid as the parent: NPROC counts all of this user's processes, so allow only that many more.
            nproc = mine + lim["max_processes"] - 1
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        applied["uid"] = os.getuid()
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no core dumps, no ptrace-read of this process by peers
    mem = int(lim["memory_mb"] * mb)
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))  # last: the steps above need memory to import
    return applied


def _describe(exc):
    text = f"{type(exc).__name__}: {exc}"
    return text[:300]


def _run(req, fd):
    cap = int(req["limits"]["result_bytes"])
    call_cpu = req["limits"].get("call_cpu_s")

    def on_timer(signum, frame):
        raise _Timeout()

    _signal.signal(_signal.SIGPROF, on_timer)

    def arm():
        if call_cpu:
            _signal.setitimer(_signal.ITIMER_PROF, call_cpu)

    def disarm():
        if call_cpu:
            _signal.setitimer(_signal.ITIMER_PROF, 0)

    env = {"__name__": "__sandbox__", "__builtins__": __builtins__}
    try:
        arm()
        exec(compile(req["code"], "<program>", "exec"), env)
        disarm()
    except _Timeout:
        _send(fd, {"t": "load_error", "error": "TimeoutError: CPU time limit while loading the program"}, cap)
        return
    except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the program failed to load
        disarm()
        _send(fd, {"t": "load_error", "error": _describe(e)}, cap)
        return
    fn = env.get(req["entry"])
    if not callable(fn):
        _send(fd, {"t": "load_error", "error": f"NameError: entry function {req['entry']!r} is not defined"}, cap)
        return
    for i, args in enumerate(req["inputs"]):
        try:
            arm()
            value = fn(*args)
            disarm()
            msg = {"t": "out", "i": i, "ok": True, "v": value}
        except _Timeout:
            msg = {"t": "out", "i": i, "ok": False, "error": "TimeoutError: CPU time limit for this call"}
        except BaseException as e:  # noqa: BLE001 - report any failure of one call and go on to the next
            disarm()
            msg = {"t": "out", "i": i, "ok": False, "error": _describe(e)}
        _send(fd, msg, cap)
    _send(fd, {"t": "done"}, cap)


def main():
    req = marshal.loads(sys.stdin.buffer.read())
    fd = req["result_fd"]
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        applied = _harden(req)
    except BaseException as e:  # noqa: BLE001 - never run user code half-hardened
        sys.stderr.write(f"sandbox hardening failed: {_describe(e)}\n")
        sys.stderr.flush()
        os._exit(EXIT_HARDENING_FAILED)
    _send(fd, {"t": "ready", "applied": applied}, 1 << 16)
    _run(req, fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or broken stream must not turn success into a crash
            pass
    os._exit(0)  # skip atexit handlers and finalizers the program may have registered


main()
