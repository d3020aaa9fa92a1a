"""A rank's process lifetime: die with torchrun, exit when the launcher is gone, refuse a Neuron rank
whose environment was not applied, stop on SIGTERM; and the ranks' log line. On the launching side:
a process's identity (pid and start time) and torchrun's PR_SET_PDEATHSIG guard. Standard library
only at import: `rank_group` (which runs in the Triton stub) uses it."""

from __future__ import annotations

import os
import signal
import sys
import threading


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks after boot), or None when the process
    is gone or a zombie (exited, not yet reaped: as good as gone for a watcher)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) onwards
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[22 - 3])


def launcher_identity(pid: int | None = None) -> str:
    """"PID:START" of this process (or ``pid``): what the ranks of a launched group watch."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{process_start_time(pid)}"


# Run before torchrun, in the child: ask the kernel for SIGTERM when the parent dies, check the parent
# is still the launcher (it may have died between fork and prctl), then become torchrun (execv keeps
# the pid and the death signal). Not a Popen preexec_fn: that is unsafe in a process with threads
# (the Triton stub has several).
_GUARD = ("import ctypes, os, signal, sys\n"
          "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
          "if os.getppid() != int(sys.argv[1]):\n"
          "    sys.exit('launcher already gone')\n"
          "os.execv(sys.argv[2], sys.argv[2:])\n")


def _guarded(cmd: list[str], python: str, parent_pid: int | None = None) -> list[str]:
    """``cmd`` run so that it receives SIGTERM when the thread that starts it ends (PR_SET_PDEATHSIG
    fires on the death of the forking *thread*, not just of its process: start it from a thread that
    lives as long as the child, e.g. the main thread)."""
    return [python, "-c", _GUARD, str(os.getpid() if parent_pid is None else parent_pid), *cmd]


def _die_with_parent() -> None:
    """torchrun starts each worker in its own session; if torchrun itself is killed (SIGKILL by a
    supervisor), the kernel sends us SIGTERM instead of leaving an orphan holding the device."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        sys.exit("parent process already gone")


LAUNCHER_GONE_EXIT = 3  # a rank's exit code when the process that launched the group died


def _watch_launcher(spec: str | None) -> None:
    """Exit (code LAUNCHER_GONE_EXIT, torchrun then ends the other ranks) as soon as one of the
    processes "PID:START[,PID:START...]" (`rank_group.launcher_identity`; `RankGroup.launch` passes
    its own process, and the Triton model adds the server) is gone: the Triton stub may die without
    stopping us (SIGSEGV, SIGKILL), or hang when the server under it died, and PR_SET_PDEATHSIG only
    watches torchrun. A pidfd each (Linux >= 5.3) wakes a daemon thread the moment one exits;
    elsewhere the thread polls /proc every second. The start time tells a reused pid from the
    process it named. No watch without a spec: a group started by hand (rank_group_address)
    outlives its clients."""
    if not spec:
        return
    import select

    rank = int(os.environ.get("RANK", "0"))

    def gone(pid: int, why: str) -> None:
        _log(rank, f"launcher pid {pid} is gone ({why}): stopping the rank group")
        os._exit(LAUNCHER_GONE_EXIT)

    watched = {}  # pid -> (start time, pidfd or None)
    for item in spec.split(","):
        pid_s, _, start_s = item.partition(":")
        pid, start = int(pid_s), int(start_s) if start_s.isdigit() else None
        fd = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            gone(pid, "no such process")
        except (OSError, AttributeError):
            pass
        if start is None or process_start_time(pid) != start:  # after pidfd_open: it pins the process it names
            gone(pid, "exited, or its pid now names another process")
        watched[pid] = (start, fd)

    def watch() -> None:
        fds = {fd: pid for pid, (_, fd) in watched.items() if fd is not None}
        p = select.poll()
        for fd in fds:
            p.register(fd, select.POLLIN)
        while True:
            for fd, _ in p.poll(None if len(fds) == len(watched) else 1000):
                gone(fds[fd], "exited")
            for pid, (start, fd) in watched.items():
                if fd is None and process_start_time(pid) != start:
                    gone(pid, "exited")

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def _log(rank: int, msg: str) -> None:
    print(f"[v4flash rank {rank}] {msg}", file=sys.stderr, flush=True)


def _check_rank_env(settings) -> None:
    """A Neuron rank whose environment lacks what `rank_entry` sets (started as `-m ...group.worker`)
    would compile without the flags or share a NeuronCore: refuse it instead."""
    from v4flash_backend.trn2.launch import env_mismatch

    wrong = env_mismatch(settings, os.environ, int(os.environ.get("LOCAL_RANK", "0")))
    if wrong:
        raise SystemExit(f"rank environment of a Neuron launch not applied ({', '.join(sorted(wrong))}): start the "
                         "ranks with `torchrun ... -m v4flash_backend.group.rank_entry` (rank_group.node_command)")


def stop_on_sigterm(info: dict, stop: threading.Event) -> None:
    """Rank 0: SIGTERM (torchrun stopping the group, e.g. after another rank died) ends the serve loop
    with an error in health's info."""

    def on_sigterm(*_):
        info.setdefault("error", "rank group terminated (SIGTERM)")
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
