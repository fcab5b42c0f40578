"""Run untrusted Python in a contained child process and get back its function's outputs, never its verdict.

Each run: a fresh empty working directory (removed afterwards), a scrubbed environment, a new session
(so the whole process group can be killed), CPU/wall/memory/file-size/process/open-file limits, no
network (empty network namespace where permitted, else Landlock TCP rules or a patched `socket`),
Landlock write confinement to the working directory where the kernel has it, and, when we run as root,
a fresh unprivileged uid per run. The child receives only code and inputs and streams one JSON line per
call on a dedicated pipe; the caller compares with expected outputs it never sends. What this does NOT
guarantee is listed in docs/tasks.md.
"""

from __future__ import annotations

import atexit
import itertools
import json
import marshal
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

EXIT_HARDENING_FAILED = 70  # keep in sync with _sandbox_child.py
DEFAULT_PRELOAD: tuple[str, ...] = ()  # modules the child imports before hardening (imports work later too)
_UID_BASE, _UID_SPAN = 1_000_000, 1_000_000


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run. cpu_s is enforced in whole seconds (rounded up) by RLIMIT_CPU."""

    cpu_s: float = 2.0
    wall_s: float = 10.0
    call_cpu_s: float | None = None  # soft CPU limit per call, so one looping input does not sink the rest
    memory_mb: int = 256
    file_size_mb: float = 1.0
    max_processes: int = 1  # including the child itself: 1 = no fork, no threads
    max_open_files: int = 64
    output_bytes: int = 64 * 1024  # stdout and stderr each; beyond this the run is killed
    result_bytes: int = 4 * 1024 * 1024  # the results pipe

    def __post_init__(self) -> None:
        if self.cpu_s <= 0 or self.wall_s <= 0 or self.memory_mb < 32 or self.max_processes < 1:
            raise ValueError(f"invalid sandbox limits: {self}")


@dataclass(frozen=True)
class CallResult:
    """One call of the entry function: its JSON-decoded return value, or the error it raised."""

    ok: bool
    value: Any = None
    error: str | None = None


@dataclass
class SandboxResult:
    """What happened in one run; `outputs[i]` is None when input i was never reached."""

    status: str  # ok | load_error | cpu_limit | timeout | output_limit | file_size_limit | crashed | exited | sandbox_error
    detail: str
    outputs: list[CallResult | None]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    applied: dict[str, Any] = field(default_factory=dict)  # the protections the child confirmed
    pid: int = 0
    uid: int | None = None

    @property
    def ok(self) -> bool:
        """True when the program loaded and every input was called (each call may still have raised)."""
        return self.status == "ok"


@dataclass(frozen=True)
class Job:
    """One program and the inputs (each a list of positional arguments) to call its entry function on."""

    code: str
    inputs: Sequence[Sequence[Any]]
    entry: str = "f"


# The child program travels precompiled on stdin ahead of the request: compiling it in every child
# cost ~5 ms, a quarter of a run. This bootstrap reads "<12-digit length><marshalled code>" and runs it.
_BOOT = "import marshal,sys;b=sys.stdin.buffer;exec(marshal.loads(b.read(int(b.read(12)))))"


@lru_cache(maxsize=1)
def _child_source() -> str:
    return (Path(__file__).with_name("_sandbox_child.py")).read_text()


@lru_cache(maxsize=1)
def _child_code() -> bytes:
    code = marshal.dumps(compile(_child_source(), "_sandbox_child.py", "exec"))
    return b"%012d" % len(code) + code


class _Registry:
    """Live children of this process, killed at interpreter exit if a run was interrupted."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, int | None] = {}
        self._uids = itertools.count(random.randrange(_UID_SPAN))
        atexit.register(self.kill_all)

    def next_uid(self) -> int:
        with self.lock:
            return _UID_BASE + next(self._uids) % _UID_SPAN

    def add(self, pid: int, uid: int | None) -> None:
        with self.lock:
            self.live[pid] = uid

    def remove(self, pid: int) -> None:
        with self.lock:
            self.live.pop(pid, None)

    def kill_all(self) -> None:
        with self.lock:
            items = list(self.live.items())
        for pid, uid in items:
            _kill_group(pid)
            if uid is not None:
                kill_uid(uid)


_REGISTRY = _Registry()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes(pgid: int | None = None, uid: int | None = None) -> list[int]:
    """Pids (zombies included) in process group `pgid` or with real uid `uid`, found by scanning /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if uid is not None and _real_uid(int(name)) == uid:
                found.append(int(name))
                continue
            if pgid is not None:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                # Fields after the parenthesised command name: state ppid pgrp ...
                if int(stat.rsplit(b")", 1)[1].split()[2]) == pgid:
                    found.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _real_uid(pid: int) -> int:
    # Not os.stat(/proc/pid): a non-dumpable process (every sandbox child) shows as owned by root there.
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Uid:"):
                return int(line.split()[1])
    return -1


def kill_uid(uid: int, attempts: int = 50) -> None:
    """SIGKILL every process owned by uid (a sandbox's private uid) until none is left."""
    for _ in range(attempts):
        pids = processes(uid=uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def _rmtree(path: str) -> None:
    def fix(func: Any, p: str, exc: Any) -> None:
        # The program may have removed permissions from what it created; restore and retry once.
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)  # Python 3.11 (pinned); 3.12 renames this to onexc


class Sandbox:
    """Runs programs in contained child processes; see the module docstring for the protections.

    The switches turn protections off (for tests of the fallbacks, or trusted code): `network=True`
    allows it; `namespaces=False` skips unshare (sockets are then blocked by patching `socket`);
    `landlock=False` skips Landlock; `drop_privileges=False` keeps root's uid.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, preload: Sequence[str] = DEFAULT_PRELOAD,
                 network: bool = False, namespaces: bool = True, landlock: bool = True, drop_privileges: bool = True,
                 workdir_root: str | None = None, python: str = sys.executable) -> None:
        self.limits = limits or SandboxLimits()
        self.preload = tuple(preload)
        self.network = network
        self.namespaces = namespaces
        self.landlock = landlock
        self.drop_privileges = drop_privileges
        self.workdir_root = workdir_root
        self.python = python

    def run(self, code: str, inputs: Sequence[Sequence[Any]], limits: SandboxLimits | None = None,
            entry: str = "f") -> SandboxResult:
        """Load `code` in a fresh child, call `entry(*args)` for each input, and return what happened."""
        lim = limits or self.limits
        t0 = time.monotonic()
        uid = _REGISTRY.next_uid() if (self.drop_privileges and os.geteuid() == 0) else None
        workdir = tempfile.mkdtemp(prefix="tracerl-sbx-", dir=self.workdir_root)
        result_r, result_w = os.pipe()
        proc: subprocess.Popen[bytes] | None = None
        try:
            os.chmod(workdir, 0o700)
            if uid is not None:
                os.chown(workdir, uid, uid)
            request = {
                "code": code, "entry": entry, "inputs": [list(a) for a in inputs], "result_fd": result_w, "uid": uid,
                "preload": self.preload,
                "limits": {**asdict(lim), "allow_network": self.network, "namespaces": self.namespaces,
                           "landlock": self.landlock},
            }
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
                   "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}
            # -P: no cwd on sys.path; -s -S: no site-packages; -B: no .pyc writes. Not -I: it would ignore
            # PYTHONHASHSEED, and set iteration order (hence some outputs) must not vary between runs.
            # marshal's format belongs to one interpreter version: another interpreter gets the source.
            same = os.path.realpath(self.python) == os.path.realpath(sys.executable)
            proc = subprocess.Popen(
                [self.python, "-P", "-s", "-S", "-B", "-c", _BOOT if same else _child_source()],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
                pass_fds=(result_w,), start_new_session=True,
            )
            _REGISTRY.add(proc.pid, uid)
            os.close(result_w)
            result_w = -1
            payload = (_child_code() if same else b"") + marshal.dumps(request)
            return self._supervise(proc, result_r, payload, len(inputs), lim, t0, uid)
        finally:
            if proc is not None:
                self._reap(proc, uid)
            for fd in (result_r, result_w):
                if fd >= 0:
                    os.close(fd)
            _rmtree(workdir)

    def run_many(self, jobs: Sequence[Job | tuple[str, Sequence[Sequence[Any]]]], limits: SandboxLimits | None = None,
                 workers: int | None = None) -> list[SandboxResult]:
        """Run many programs concurrently (results in input order); every child is reaped before returning."""
        norm = [j if isinstance(j, Job) else Job(*j) for j in jobs]
        if not norm:
            return []
        # Threads only babysit pipes; the work happens in the children, so 2x the cores keeps them busy.
        workers = workers or min(len(norm), 2 * (os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox") as pool:
            futures = [pool.submit(self.run, j.code, j.inputs, limits, j.entry) for j in norm]
            return [f.result() for f in futures]

    def _supervise(self, proc: subprocess.Popen[bytes], result_r: int, payload: bytes, n_inputs: int,
                   lim: SandboxLimits, t0: float, uid: int | None) -> SandboxResult:
        """Feed stdin, drain stdout/stderr/results under their caps, enforce the wall limit, then classify."""
        assert proc.stdin and proc.stdout and proc.stderr
        out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray(), result_r: bytearray()}
        caps = {out_fd: lim.output_bytes, err_fd: lim.output_bytes, result_r: lim.result_bytes}
        pending = memoryview(payload)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        stdin_fd = proc.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        sel.register(stdin_fd, selectors.EVENT_WRITE)
        deadline = t0 + lim.wall_s
        killed = ""
        try:
            while sel.get_map() and not killed:
                left = deadline - time.monotonic()
                if left <= 0:
                    killed = "timeout"
                    break
                for key, _ in sel.select(left):
                    fd = key.fd
                    if fd == stdin_fd:
                        try:
                            pending = pending[os.write(fd, pending[: 1 << 16]):]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(fd)
                            proc.stdin.close()
                        continue
                    chunk = _read(fd)
                    if chunk is None:
                        continue
                    if not chunk:
                        sel.unregister(fd)
                        continue
                    bufs[fd] += chunk
                    if len(bufs[fd]) > caps[fd]:
                        killed = "output_limit"
                        break
            if not killed and not _wait_exit(proc.pid, deadline):
                killed = "timeout"
        finally:
            sel.close()
        if killed:
            _kill_group(proc.pid)
        rc, cpu = self._reap(proc, uid, lim.max_processes > 1)
        # Results written before a kill are still in the pipe: a looping input does not erase earlier ones.
        while (chunk := _read(result_r)) and len(bufs[result_r]) <= lim.result_bytes:
            bufs[result_r] += chunk
        res = _parse_results(bytes(bufs[result_r]), n_inputs)
        status, detail = _classify(killed, rc, cpu, lim, res)
        if res["ready"] and uid is None and not res["applied"].get("landlock_abi"):
            _warn_weak_once()
        return SandboxResult(
            status=status, detail=detail, outputs=res["outputs"], returncode=rc,
            stdout=bytes(bufs[out_fd][: lim.output_bytes]).decode("utf-8", "replace"),
            stderr=bytes(bufs[err_fd][: lim.output_bytes]).decode("utf-8", "replace"),
            wall_s=time.monotonic() - t0, cpu_s=cpu, applied=res["applied"], pid=proc.pid, uid=uid,
        )

    def _reap(self, proc: subprocess.Popen[bytes], uid: int | None, may_fork: bool = True) -> tuple[int | None, float]:
        """Kill what is left of the run (group, private uid), reap the child; return (exit code, CPU seconds)."""
        if proc.returncode is not None and proc.pid not in _REGISTRY.live:
            return proc.returncode, 0.0
        # The child is still unreaped here (at worst a zombie), so its pid cannot have been reused as a pgid.
        _kill_group(proc.pid)
        cpu = 0.0
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
        except ChildProcessError:
            pass
        if uid is not None and may_fork:
            # With max_processes == 1 the fresh uid cannot fork or clone at all, so there is nothing to sweep.
            kill_uid(uid)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        _REGISTRY.remove(proc.pid)
        return proc.returncode, cpu


_WARNED = threading.Event()


def _warn_weak_once() -> None:
    if not _WARNED.is_set():
        _WARNED.set()
        warnings.warn(
            "sandbox: no Landlock and not root, so programs run as your user: they cannot fork, use the network "
            "or see os.environ, but can read your files and /proc/<pid> of your other processes (expected "
            "outputs in this process's memory included). Use a kernel with Landlock (5.13+) or run as root.",
            RuntimeWarning, stacklevel=3)


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _wait_exit(pid: int, deadline: float) -> bool:
    """Wait, without reaping, until pid exits or the deadline passes; True if it exited."""
    delay = 0.0005
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        if info is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _parse_results(data: bytes, n: int) -> dict[str, Any]:
    res: dict[str, Any] = {"outputs": [None] * n, "applied": {}, "ready": False, "done": False, "load_error": None}
    for line in data.split(b"\n"):
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # an empty or truncated last line after a kill
        if not isinstance(msg, dict):
            continue
        t = msg.get("t")
        if t == "ready" and not res["ready"]:
            res["ready"], res["applied"] = True, msg.get("applied", {})
        elif t == "out" and isinstance(msg.get("i"), int) and 0 <= msg["i"] < n and res["outputs"][msg["i"]] is None:
            i = msg["i"]
            res["outputs"][i] = CallResult(True, msg.get("v")) if msg.get("ok") else CallResult(False, None, str(msg.get("error")))
        elif t == "load_error" and res["load_error"] is None:
            res["load_error"] = str(msg.get("error"))
        elif t == "done":
            res["done"] = True
    return res


def _classify(killed: str, rc: int | None, cpu: float, lim: SandboxLimits, res: dict[str, Any]) -> tuple[str, str]:
    if killed == "output_limit":
        return "output_limit", f"output exceeded {lim.output_bytes} bytes (or results {lim.result_bytes})"
    if killed == "timeout":
        return "timeout", f"wall time limit of {lim.wall_s:g} s exceeded"
    if not res["ready"] and rc == EXIT_HARDENING_FAILED:
        return "sandbox_error", "the sandbox could not apply its protections"
    if rc is not None and rc < 0:
        sig = -rc
        cpu_limit = max(1, -(-lim.cpu_s // 1))
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cpu_limit - 0.05):
            return "cpu_limit", f"CPU time limit of {cpu_limit:g} s exceeded"
        if sig == signal.SIGXFSZ:
            return "file_size_limit", f"file size limit of {lim.file_size_mb:g} MB exceeded"
        return "crashed", f"killed by {signal.Signals(sig).name}"
    if res["load_error"] is not None:
        return "load_error", res["load_error"]
    if rc:
        return "exited", f"exited with code {rc}"
    if not res["done"]:
        return "exited", "exited before calling every input"
    return "ok", ""
