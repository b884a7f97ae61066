"""``backend = "process"``: each worker a Python process of its own."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping

import trio

from .._util import final
from ._launcher import LaunchedWorker, exit_reason
from .worker import _main

__all__ = ["WORKER_MAIN", "ProcessLauncher", "worker_command"]


@final
class _ProcessHandle:
    place = None

    def __init__(self, process: trio.Process) -> None:
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def wait(self) -> str:
        return exit_reason(await self.process.wait())


#: A worker process's program, after its name (see :func:`worker_command`): ``python
#: -m omni_trio.process.worker``, but ignoring SIGINT and SIGTERM from its first line
#: on: a Ctrl-C at the terminal reaches every process of the group, and one that lands
#: while a worker still imports must not print a ``KeyboardInterrupt`` (the worker's
#: orchestrator decides when it stops; see ``worker.main``). Its command line says it
#: (tests find the workers of a process by it).
WORKER_MAIN = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    f"from {_main.__name__} import main; main()"
)


def worker_command(name: str, control_fd: int) -> list[str]:
    """The command line of the worker ``name`` (its stage and replica, ``thinker[0]``):
    ``python -c CODE --control-fd N``, whose code says the name first, as a string
    that does nothing, then runs :data:`WORKER_MAIN`. ``ps`` shows it up front::

        python3 -c 'omni-trio worker thinker[0]'; import signal; ...
    """
    return [
        sys.executable,
        "-c",
        f"{f'omni-trio worker {name}'!r}; {WORKER_MAIN}",
        "--control-fd",
        str(control_fd),
    ]


@final
class ProcessLauncher:
    """Each worker is :func:`omni_trio.process.worker.main` in a new Python process (with
    the import path of this process, so it imports what we can, ``environment`` added
    to this process's environment, and SIGINT and SIGTERM ignored from its first
    line), its control connection an inherited socket pair. Its command line names it
    by its stage and replica (:func:`worker_command`)."""

    backend = "process"

    def __init__(self, environment: Mapping[str, str] | None = None) -> None:
        #: Set in each worker's environment (a replica's ``CUDA_VISIBLE_DEVICES``).
        self.environment = dict(environment or {})

    async def launch(self, nursery: trio.Nursery, *, name: str) -> LaunchedWorker:
        ours, child = socket.socketpair()
        command = worker_command(name, child.fileno())
        env = dict(os.environ)  # the worker imports what this process can
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env.update(self.environment)
        try:
            process = await trio.lowlevel.open_process(command, pass_fds=[child.fileno()], env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            child.close()
        control = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        return LaunchedWorker(_ProcessHandle(process), control)
