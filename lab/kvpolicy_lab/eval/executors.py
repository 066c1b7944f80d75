"""Where the cells of an ablation run: here (the default), or on a Ray cluster (``--executor ray``).

:class:`RayExecutor` starts one :class:`~kvpolicy_lab.eval.workers.Worker` actor per slot of the cluster:
each asks for ``gpus_per_cell`` GPUs (default 1) when the grid's device is ``cuda``, and for
``cpus_per_cell`` CPUs (default 1). Each pending cell is a Ray task (a call of its worker), and a
worker runs one cell at a time. A worker loads a model the first time one of its cells needs it and keeps
it for the next (cells of the model and group it ran last are handed to it first), so the cells of a
model do not each load it. Results come back to the driver as they finish (``ray.wait``), and the
driver alone writes the run directory, exactly as the in-process runner does: the same
``results.jsonl``, resumable the same way.

Workers are actors, not plain tasks, because a task's worker process may serve a later task on
another GPU: Ray would change ``CUDA_VISIBLE_DEVICES`` under a model already loaded on the first one
(so Ray runs each GPU task in a new process unless told otherwise, which would reload the model for
every cell). An actor keeps its GPU for life.

Ray is an optional dependency (``pip install "kvpolicy-lab[ray]"``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpolicy.errors import ConfigError, MissingDependencyError
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.cells import error_result
from kvpolicy_lab.eval.grid import Grid
from kvpolicy_lab.eval.plan import Group
from kvpolicy_lab.eval.runner import write_whole
from kvpolicy_lab.eval.workers import Fatal, Worker

if TYPE_CHECKING:
    from kvpolicy_lab.eval.runner import Runner

#: ``--executor`` values
EXECUTORS = ("local", "ray")

#: seconds a cluster address gets to accept a TCP connection before the run is refused
CONNECT_TIMEOUT_S = 5.0


def import_ray() -> Any:
    """The ``ray`` module.

    Raises
    ------
    MissingDependencyError
        (a :class:`~kvpolicy.errors.ConfigError`) naming ``pip install "kvpolicy-lab[ray]"`` when it is not installed.
    """
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError(
            f"--executor ray needs the package 'ray', which is not installed ({exc}); install it with: "
            'pip install "kvpolicy-lab[ray]"'
        ) from exc
    return ray


@dataclass
class _Job:
    """One call of a worker: ``kind`` (a :class:`Worker` method) with ``args``."""

    kind: str
    model: str
    args: tuple[Any, ...]
    cell: tuple[Group, str, CacheSpec, bool] | None = None
    key: tuple[Any, ...] = field(default=())

    def __post_init__(self) -> None:
        group = self.cell[0] if self.cell else None
        self.key = (self.model, group.context, group.task_name) if group else (self.model,)


class _Pool:
    """Worker actors, one job at a time each; an idle worker takes the next job of the group (else the
    model) it ran last, else the oldest job."""

    def __init__(self, ray: Any, worker: Any, slots: int) -> None:
        self.ray = ray
        self.worker = worker
        self.slots = slots
        self.actors: list[Any] = []
        self.last: dict[int, tuple[Any, ...]] = {}

    def run(self, jobs: list[_Job], done: Callable[[_Job, Any], None],
            failed: Callable[[_Job, Exception], None]) -> list[_Job]:  # fmt: skip
        """Run ``jobs``, calling ``done(job, result)`` or ``failed(job, error)`` as each finishes.

        Returns
        -------
        list of _Job
            The jobs left unrun because every worker died (empty normally).
        """
        ray = self.ray
        while len(self.actors) < min(self.slots, len(jobs)):
            self.actors.append(self.worker.remote())
        idle, queue = list(self.actors), list(jobs)
        running: dict[Any, tuple[Any, _Job]] = {}
        try:
            while queue or running:
                while idle and queue:
                    actor = idle.pop()
                    job = queue.pop(self._next(actor, queue))
                    self.last[id(actor)] = job.key
                    running[getattr(actor, job.kind).remote(*job.args)] = (actor, job)
                if not running:  # every worker died
                    break
                [ref], _ = ray.wait(list(running), num_returns=1)
                actor, job = running.pop(ref)
                try:
                    got = ray.get(ref)
                except ray.exceptions.RayActorError as exc:  # the worker died (killed, out of memory, ...)
                    self.actors.remove(actor)
                    failed(job, exc)
                    continue
                except ray.exceptions.RayError as exc:
                    idle.append(actor)
                    failed(job, exc)
                    continue
                idle.append(actor)
                done(job, got)
        finally:
            for ref in running:  # an error or an interruption: do not leave calls running
                ray.cancel(ref)
        return queue

    def _next(self, actor: Any, queue: list[_Job]) -> int:
        last = self.last.get(id(actor))
        if last is not None:
            for match in (lambda j: j.key == last, lambda j: j.model == last[0]):
                for i, job in enumerate(queue):
                    if match(job):
                        return i
        return 0

    def close(self) -> None:
        """Stop the workers (their models go with them)."""
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors.clear()


@dataclass
class RayExecutor:
    """Run the cells on Ray workers; the driver writes the results (see the module docstring).

    Parameters
    ----------
    address : str, optional
        The Ray cluster to connect to (``ray.init(address=...)``): ``"auto"`` (the one this node belongs
        to), ``"HEAD:6379"``, or ``"ray://HEAD:10001"`` (Ray Client, which needs ``ray[client]``). Default:
        ``RAY_ADDRESS`` if set, else a Ray instance started here for the run. Ignored when Ray is already
        initialised in this process.
    cpus_per_cell : int
        CPUs each worker asks for; also its torch threads unless ``threads`` is given.
    gpus_per_cell : float, optional
        GPUs each worker asks for when the grid's device is ``cuda`` (default 1; a fraction shares a GPU
        between workers). Refused for other devices.
    threads : int, optional
        torch threads in each worker (default: ``cpus_per_cell``).
    """

    address: str | None = None
    cpus_per_cell: int = 1
    gpus_per_cell: float | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cpus_per_cell, int) or self.cpus_per_cell < 1:
            raise ConfigError(f"--cpus-per-cell must be an integer >= 1; got {self.cpus_per_cell!r}")
        if self.gpus_per_cell is not None and not self.gpus_per_cell > 0:
            raise ConfigError(f"--gpus-per-cell must be a number > 0; got {self.gpus_per_cell!r}")

    # ------------------------------------------------------------------ Executor
    def check(self, grid: Grid) -> None:
        """Refuse, before any work, a device Ray cannot assign or a missing ``ray``.

        The models and the device's presence are checked on the workers, where they are used.
        """
        import torch

        device = torch.device(grid.device)
        if device.type == "cuda" and device.index is not None:
            raise ConfigError(f"device {grid.device!r}: with --executor ray use 'cuda' (Ray gives each worker its "
                              "own GPU, which it sees as cuda:0)")  # fmt: skip
        if self.gpus_per_cell is not None and device.type != "cuda":
            raise ConfigError(f"--gpus-per-cell {self.gpus_per_cell:g} applies to grids on cuda; device "
                              f"{grid.device!r} has its cells ask for --cpus-per-cell CPUs only")  # fmt: skip
        self.check_address()

    def check_address(self) -> None:
        """Refuse, within seconds, a cluster address where nothing accepts connections.

        ``ray.init`` would retry such an address for many minutes before giving up. The address of
        ``--address`` (or of ``RAY_ADDRESS`` when ``--address`` is absent or ``auto``), when it is
        ``HOST:PORT`` or ``ray://HOST:PORT``, gets one TCP connection attempt of at most
        :data:`CONNECT_TIMEOUT_S` seconds. Nothing is probed when Ray is already initialised in this
        process, or when Ray finds the cluster itself (``auto``, ``local``, no address).

        Raises
        ------
        ConfigError
            ``ray`` is not installed, or nothing answers at the address (the message names the flag or
            variable, the address and the system's reason).
        """
        ray = import_ray()
        if ray.is_initialized():
            return
        source, address = "--address", self.address
        if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):
            source, address = "RAY_ADDRESS", os.environ["RAY_ADDRESS"]
        endpoint = _endpoint(address) if address else None
        if endpoint is None:
            return
        problem = _unreachable(*endpoint)
        if problem:
            raise ConfigError(
                f"--executor ray: {source} {address!r}: no Ray cluster reachable at {endpoint[0]}:{endpoint[1]} "
                f"({problem}); start one there (`ray start --head` prints its address) or give another {source}"
            )

    def run(self, runner: Runner, tasks: dict[str, Any], done: set[str], bar: Any) -> None:
        """Run ``runner``'s pending cells on Ray workers, recording each result as it arrives.

        Ray is started (or joined) only when there is work: a resumed run whose cells are all finished
        returns at once (unless ``--equal-bytes`` needs workers to size the caches).
        """
        ray = import_ray()
        started = False
        pool: _Pool | None = None
        try:
            if runner.grid.equal_bytes:
                started, pool = self._connect(ray, runner)
                plans = self._remote_plans(pool, runner)
            else:
                plans = {m: list(runner.plan(m, tasks, None)) for m in runner.grid.models}
            jobs = self._jobs(runner, plans, done, bar)
            if jobs:
                if pool is None:
                    started, pool = self._connect(ray, runner)
                self._run(pool, runner, jobs, bar)
        finally:
            if pool is not None:
                pool.close()
            if started:
                ray.shutdown()

    # ------------------------------------------------------------------ internals
    def _resources(self, grid: Grid) -> dict[str, float]:
        gpus = (self.gpus_per_cell or 1) if grid.device.startswith("cuda") else 0
        return {"num_cpus": self.cpus_per_cell, "num_gpus": gpus}

    def _connect(self, ray: Any, runner: Runner) -> tuple[bool, _Pool]:
        """Start or join Ray unless this process already has, check the cluster's resources, and make
        the (empty) pool of workers; whether Ray was started or joined here, and the pool."""
        started = not ray.is_initialized()
        if started:
            joins = bool(self.address or os.environ.get("RAY_ADDRESS"))
            # a local instance inherits this process's environment; a cluster's workers get HF_HUB_OFFLINE here
            offline = joins and not runner.grid.online
            env = {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}} if offline else None
            try:
                ray.init(address=self.address, runtime_env=env)
            except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError, ... by case
                where = f"the Ray cluster at --address {self.address!r}" if self.address else "a Ray instance"
                raise ConfigError(
                    f"--executor ray: cannot start or reach {where}: {type(exc).__name__}: {exc}"
                ) from None
        try:
            slots = self._slots(ray, runner)
        except ConfigError:
            if started:
                ray.shutdown()
            raise
        worker = ray.remote(Worker).options(**self._resources(runner.grid), max_restarts=0)
        grid_ref = ray.put(runner.grid)
        threads = self.threads or self.cpus_per_cell
        return started, _Pool(ray, _Bound(worker, grid_ref, threads), slots)

    def _slots(self, ray: Any, runner: Runner) -> int:
        """How many workers the cluster holds at once; refuses a request larger than the whole cluster,
        which would wait forever."""
        have = ray.cluster_resources()
        where = f"--address {self.address}" if self.address else "RAY_ADDRESS or a local instance"
        runner.log(f"ray: {have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs ({where})")
        res = self._resources(runner.grid)
        slots = []
        for key, name, flag in (("num_cpus", "CPU", "--cpus-per-cell"), ("num_gpus", "GPU", "--gpus-per-cell")):
            if not res[key]:
                continue
            if have.get(name, 0) < res[key]:
                raise ConfigError(f"each cell asks for {res[key]:g} {name}(s) ({flag}), but the Ray cluster has "
                                  f"{have.get(name, 0):g}; lower {flag} or add nodes")  # fmt: skip
            slots.append(int(have.get(name, 0) / res[key] + 1e-9))
        return min(slots)

    def _remote_plans(self, pool: _Pool, runner: Runner) -> dict[str, list[Group]]:
        """Every model's groups, with the ``--equal-bytes`` sizings (which need the model) done by workers."""
        runner.log("--equal-bytes: sizing every method on Ray workers ...")
        memo = runner.read_sizing_memo()
        plans: dict[str, list[Group]] = {}
        sizings: dict[str, list[dict[str, Any]]] = {}

        def done(job: _Job, got: Any) -> None:
            if isinstance(got, Fatal):
                raise ConfigError(got.message)
            plans[job.model], sizings[job.model], memo[job.model] = got

        def failed(job: _Job, exc: Exception) -> None:
            raise ConfigError(f"--equal-bytes: sizing the caches of {job.model} failed on a Ray worker: "
                              f"{type(exc).__name__}: {exc}")  # fmt: skip

        models = runner.grid.models
        pool.run([_Job("plan", m, (m, memo.get(m, {}))) for m in models], done, failed)
        write_whole(runner.out / "sizing.json", json.dumps(memo, indent=1))
        for m in models:  # in grid order, as the in-process runner lists them
            runner.sizings.extend(sizings[m])
        return {m: plans[m] for m in models}

    def _jobs(self, runner: Runner, plans: dict[str, list[Group]], done: set[str], bar: Any) -> list[_Job]:
        """The pending cells (in grid order) and attention analyses; ``config.json`` lists this run's cells."""
        jobs = []
        for model_name in runner.grid.models:
            for group in plans[model_name]:
                light = Group(group.model, group.context, group.task_name, group.task, [])
                for cid, spec, eq in runner.take_pending(group, done, bar):
                    jobs.append(_Job("cell", model_name, (light, cid, spec, eq), cell=(light, cid, spec, eq)))
            runner.write_cells()
            if runner.runs_attention() and not (runner.attention_dir(model_name) / "attention_spikes.json").is_file():
                jobs.append(_Job("attention", model_name, (model_name, runner.attention_params())))
        return jobs

    def _run(self, pool: _Pool, runner: Runner, jobs: list[_Job], bar: Any) -> None:
        """Run the jobs and write what they return as it arrives."""
        cells = sum(job.kind == "cell" for job in jobs)
        runner.log(f"ray: {cells} cell(s) on {min(pool.slots, len(jobs))} worker(s)")

        def done(job: _Job, got: Any) -> None:
            if isinstance(got, Fatal):
                raise ConfigError(got.message)
            if job.kind == "attention":
                out = runner.attention_dir(job.model)
                for name, data in got.items():
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    (out / name).write_bytes(data)
                runner.log(f"attention analysis of {job.model} -> {out}")
                return
            runner.ran += 1
            bar.set_postfix_str(f"{got.cache} | {got.task} | ctx {got.context}")
            runner.record(got, bar)

        def failed(job: _Job, exc: Exception) -> None:
            text = str(exc).strip()
            message = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"  # Ray's messages run long
            if job.cell is None:
                runner.log(f"attention analysis of {job.model} FAILED: {message}")
                return
            group, cid, spec, eq = job.cell
            runner.ran += 1
            runner.record(error_result(cid, group.model, spec, eq, group.context, group.task_name, message, text), bar)

        left = pool.run(jobs, done, failed)
        if left:
            missed = sum(job.kind == "cell" for job in left)
            runner.errors += missed
            runner.log(f"warning: every Ray worker died; {missed} cell(s) not run, counted as failed (they run "
                       "next time)")  # fmt: skip


def _endpoint(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``HOST:PORT`` or ``ray://HOST:PORT`` address (IPv6 hosts in brackets), else
    ``None`` (``auto``, ``local``, another scheme, no port: left to Ray)."""
    inner = address[len("ray://") :] if address.startswith("ray://") else address
    if "://" in inner:
        return None
    host, sep, port = inner.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _unreachable(host: str, port: int) -> str | None:
    """Why a TCP connection to ``host:port`` fails within :data:`CONNECT_TIMEOUT_S` seconds, or ``None``."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except socket.gaierror as exc:
        return f"host {host!r} not found: {exc.strerror}"
    except TimeoutError:
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


@dataclass(frozen=True)
class _Bound:
    """The worker actor class with its constructor's arguments: ``remote()`` starts one."""

    actor: Any
    grid: Any
    threads: int

    def remote(self) -> Any:
        return self.actor.remote(self.grid, self.threads)


def make_executor(name: str, address: str | None = None, cpus_per_cell: int | None = None,
                  gpus_per_cell: float | None = None, threads: int | None = None) -> RayExecutor | None:  # fmt: skip
    """The executor named by ``--executor`` (``None``: the runner's own, in this process).

    Raises
    ------
    ConfigError
        ``name`` is not in :data:`EXECUTORS`, or a Ray setting is given with ``local``.
    """
    if name not in EXECUTORS:
        raise ConfigError(f"--executor must be one of {list(EXECUTORS)}; got {name!r}")
    if name == "local":
        given = [flag for flag, value in (("--address", address), ("--cpus-per-cell", cpus_per_cell),
                                          ("--gpus-per-cell", gpus_per_cell)) if value is not None]  # fmt: skip
        if given:
            raise ConfigError(f"{', '.join(given)} applies only to --executor ray; got --executor local")
        return None
    return RayExecutor(address, cpus_per_cell or 1, gpus_per_cell, threads)
