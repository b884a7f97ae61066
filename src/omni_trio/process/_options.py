"""How a stage's worker process is run: one options object for every way in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .._checks import seconds
from .._util import final

__all__ = [
    "BACKENDS",
    "BALANCES",
    "INLINE_CHUNK_BYTES",
    "MAX_WINDOW",
    "MIN_RING_BYTES",
    "RAY_PLACEMENT",
    "RING_BYTES",
    "WINDOW",
    "WINDOW_BYTES",
    "WorkerOptions",
]

#: The fields that say where a Ray actor is placed: only for ``backend = "ray"``.
RAY_PLACEMENT = ("num_cpus", "num_gpus", "resources", "spread")
#: Where a stage's worker can run (``WorkerOptions.backend``).
BACKENDS = ("process", "inprocess", "ray")
#: How a stage's replicas share its requests (``WorkerOptions.balance``).
BALANCES = ("least_loaded", "round_robin")
#: Chunks of at most this many bytes travel inside their frame by default (64 KiB):
#: the connector's and the config's default.
INLINE_CHUNK_BYTES = 64 * 1024
#: Each sending worker's shared-memory ring per worker it sends to, for chunks bigger
#: than that (4 MiB by default, as vLLM-Omni's): the connector's and the config's default.
RING_BYTES = 4 * 1024 * 1024
#: The smallest ring that may be configured.
MIN_RING_BYTES = 64 * 1024
#: Chunks a request may have sent and not yet read, per downstream stage (a link's
#: window): the connector's and the config's default.
WINDOW = 64
#: The largest window that may be configured.
MAX_WINDOW = 65536
#: Bytes of inline chunks a request may have sent and not yet read, per downstream
#: stage (chunks in a ring are bounded by the ring's share instead).
WINDOW_BYTES = 1 << 20


def _amount(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _resources(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"resources: a resource name must be a non-empty string, got {name!r}")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"resources.{name} must be a number > 0, got {amount!r}")


def _as_resources(value: Mapping[str, float]) -> dict[str, float]:
    return dict(value)


def _max_restarts(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"max_restarts must be an integer >= 0, got {value!r}")


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
        if value not in choices:
            said = " or ".join(repr(choice) for choice in choices)
            raise ValueError(f"{attribute.name} must be {said}, got {value!r}")

    return check


def _replicas(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {value!r}")


def _devices(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    for device in value:
        if not isinstance(device, str) or not device:
            raise ValueError(f"devices: each must be a non-empty string, got {device!r}")


def _as_devices(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):  # a string is not a list of devices, though it iterates
        raise ValueError(f"devices must be a list of strings, got {value!r}")  # noqa: TRY004 - as every field's bad value
    return tuple(value)


@final
@attrs.frozen(kw_only=True)
class WorkerOptions:
    """How a stage's worker is run and supervised.

    The same object is a pipeline config's ``[stages.runtime]`` table and the
    ``options=`` of :func:`open_process_stage` and :func:`open_inprocess_stage`. Every
    field has a default; a value out of range raises ``ValueError`` naming the field.

    Attributes:
      backend: Where the worker runs: ``"process"``, a worker process of its own;
          ``"inprocess"``, a task of the orchestrator's own Trio run (see
          :func:`open_inprocess_stage`); or ``"ray"``, a Ray actor placed by
          ``num_cpus``, ``num_gpus`` and ``resources`` on a node of the pipeline's
          cluster (see :func:`open_ray_stage`). Read by
          :func:`open_process_pipeline`; the ``open_*_stage`` functions set it to
          their own. An in-process worker is pinged for its statistics, never
          killed for its silence.
      restart: Restart a dead worker: its in-flight requests fail, and later ones (and
          those submitted while it restarts) run on the new worker. Without it, the
          stage's ``outputs`` end, and the orchestrator marks the stage dead.
      max_restarts: Restart a dead worker at most this many times over the stage's
          life, whatever ``restart`` says (as Ray's actor option of that name);
          ``None``: ``restart`` decides, with no bound.
      num_cpus, num_gpus: A Ray stage's actor asks its node for this many CPUs and
          GPUs (``None``: Ray's defaults: 1 CPU to be placed, none held while it
          runs; no GPU).
      resources: A Ray stage's custom resources, e.g. ``{"node_tts": 1}``: its
          actor goes to a node that has them.
      spread: Place a Ray stage's actors by Ray's ``SPREAD`` scheduling strategy,
          which spreads them among the nodes that can take them: a pool's replicas
          on different nodes. Best effort: to make it certain, give each node room
          for one replica only (one of a custom resource the stage asks for, see
          ``resources``). Without it, Ray's default strategy may put several on
          one node.
      heartbeat_interval: Seconds between pings to the worker.
      heartbeat_timeout: A worker silent this long is dead (it is killed).
      startup_timeout: Seconds a worker may take to load its engine; also how long a
          submit waits for a restarting worker, and how long the workers sending
          chunks to the stage wait for its next one (then the request sending fails,
          with :class:`~omni_trio.process.ReaderUnavailableError`).
      shutdown_grace: Seconds a worker may take to exit when its stage closes, before
          it is killed.
      completion_delay: Delay every completion report by this many seconds (a slow
          control path, for tests and demonstrations).
      replicas: How many workers run the stage, each a replica of its engine (a
          process, a task or a Ray actor, as ``backend`` says). To the orchestrator
          they are one stage: each request runs on one replica per stage, chosen
          when it is admitted (in forward mode, when it reaches the stage), for its
          whole life. Each replica is supervised on its
          own (``restart`` and ``max_restarts`` count per replica, and its death
          fails only its requests); the stage dies when no replica is alive and
          none will restart.
      balance: How a request's replica is chosen: ``"least_loaded"`` (the live
          replica with the fewest requests, the first of them on a tie) or
          ``"round_robin"`` (the live replicas in turn). A replica without a worker
          (restarting) is chosen only when no replica has one.
      devices: One device per replica, for ``backend = "process"``: replica ``i``
          runs with ``CUDA_VISIBLE_DEVICES`` set to ``devices[i]``. Empty (the
          default): the environment is the orchestrator's. Its length must be
          ``replicas``.
    """

    # A str, not a Literal: msgspec resolves these annotations in the public
    # namespace (omni_trio.process), where no typing names are.
    backend: str = attrs.field(default="process", validator=_one_of(BACKENDS))
    restart: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    heartbeat_interval: float = attrs.field(default=1.0, validator=seconds(positive=True))
    heartbeat_timeout: float = attrs.field(default=10.0, validator=seconds(positive=True))
    startup_timeout: float = attrs.field(default=30.0, validator=seconds(positive=True))
    shutdown_grace: float = attrs.field(default=5.0, validator=seconds(positive=False))
    completion_delay: float = attrs.field(default=0.0, validator=seconds(positive=False))
    max_restarts: int | None = attrs.field(default=None, validator=_max_restarts)
    num_cpus: float | None = attrs.field(default=None, validator=_amount)
    num_gpus: float | None = attrs.field(default=None, validator=_amount)
    resources: dict[str, float] = attrs.field(
        factory=dict, converter=_as_resources, validator=_resources
    )
    replicas: int = attrs.field(default=1, validator=_replicas)
    balance: str = attrs.field(default="least_loaded", validator=_one_of(BALANCES))
    devices: tuple[str, ...] = attrs.field(default=(), converter=_as_devices, validator=_devices)
    spread: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.devices:
            if self.backend != "process":
                raise ValueError(
                    "devices sets each worker process's CUDA_VISIBLE_DEVICES: it needs "
                    f"backend = 'process', not {self.backend!r}"
                    + (" (a Ray actor's GPUs come from num_gpus)" if self.backend == "ray" else "")
                )
            if len(self.devices) != self.replicas:
                raise ValueError(
                    f"devices names {len(self.devices)} device(s) for {self.replicas} "
                    "replica(s): it needs one per replica"
                )
        if self.backend != "ray":
            for name in RAY_PLACEMENT:
                if getattr(self, name):
                    what = "places Ray actors" if name == "spread" else "places a Ray actor"
                    raise ValueError(
                        f"{name} {what}: it needs backend = 'ray', not {self.backend!r}"
                    )

    def may_restart(self, restarts: int) -> bool:
        """Whether a stage that restarted its worker ``restarts`` times restarts it again."""
        if self.max_restarts is not None:
            return restarts < self.max_restarts
        return self.restart
