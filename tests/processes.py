"""Looking at the processes a test started: which children a process has now (Linux /proc)."""

import os


def child_pids(pid: int, command_has: str = "") -> list[int]:
    """The PIDs of ``pid``'s live child processes (those whose command line contains ``command_has``)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) != pid:
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if command_has.encode() in f.read().replace(b"\0", b" "):
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def is_running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def forked_pids(pid: int) -> list[int]:
    """The processes ``pid``'s forkserver forked (``engine.processes.process_start``: the children of its child that
    runs ``multiprocessing.forkserver``), oldest first; not the forkserver itself."""
    return sorted(p for server in child_pids(pid, "multiprocessing.forkserver") for p in child_pids(server))


def engine_pids(pid: int) -> list[int]:
    """The engine processes ``pid`` (a gateway, an engine server) started, oldest first: forked by its forkserver,
    or spawned (``MOEGATE_PROCESS_START=spawn``: its children that run ``spawn_main``). Not multiprocessing's
    resource tracker, nor the forkserver itself."""
    return sorted(child_pids(pid, "spawn_main") + forked_pids(pid))


def rank_pids(pid: int) -> list[int]:
    """The follower ranks an engine process (or a process running ``engine.LLM``) ``pid`` started on this node:
    the processes its forkserver forked (``engine.ranks.engine_ranks.EngineRanks``)."""
    return forked_pids(pid)
