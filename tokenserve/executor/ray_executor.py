"""The Ray executor ("ray"): one worker per rank as a Ray actor, in a placement group of one
CPU bundle per rank, on whichever machines of the Ray cluster hold the bundles.

Ray is imported only when this executor starts (`pip install tokenserve[ray]`); a cluster
already running (`ray start`, or `ray.init` in this process) is joined, else Ray starts a
local one. Rank 0's machine hosts torch.distributed's rendezvous. A call is put in Ray's
object store once and every actor reads it; the step's answer is the output rank's, as in
the multiprocess executor; steps under way at once (pipeline stages) are Ray object
references, each read when its step is collected. An actor that dies is a RuntimeError in the engine core.
"""

from __future__ import annotations

from typing import Any

from tokenserve.config import EngineConfig
from tokenserve.distributed.cpu_binding import bind_to_cpus, cpus_for_ranks
from tokenserve.executor.abstract import PendingOutput
from tokenserve.executor.multiproc import BroadcastExecutor, answer_call, free_port, output_rank
from tokenserve.messages.model_runner_output import ModelRunnerOutput

# Seconds to wait for the cluster to grant the placement group.
_PLACEMENT_TIMEOUT_S = 300


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install tokenserve[ray]"
        ) from None
    return ray


class RayWorkerWrapper:
    """What runs in each actor: its place on its machine, then the worker and its calls."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config, self.rank = config, rank
        self.worker = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def rendezvous(self) -> str:
        """The init method the ranks meet at, on this (rank 0's) machine."""
        return f"tcp://{self.node_ip()}:{free_port()}"

    def init_worker(self, init_method: str, local_rank: int, local_world_size: int) -> None:
        """Bind to this rank's share of its machine's cores, join the ranks, build the runner."""
        bind_to_cpus(cpus_for_ranks(local_world_size)[local_rank])
        from tokenserve.worker.worker import Worker

        self.worker = Worker(self.config, self.rank, distributed_init_method=init_method)

    def execute(self, payload: bytes) -> tuple[str, Any]:
        return answer_call(self.worker, payload, self.rank == output_rank(self.config))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(BroadcastExecutor):
    def _init_executor(self) -> None:
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self._remove_placement_group = ray, remove_placement_group
        self.actors: list[Any] = []
        self.placement_group = None
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        world_size = self.config.parallel_config.world_size
        self.output_rank = output_rank(self.config)
        self.placement_group = placement_group([{"CPU": 1}] * world_size, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            self.shutdown()
            raise ValueError(
                f"The Ray cluster did not grant {world_size} CPU bundles (one per rank) within "
                f"{_PLACEMENT_TIMEOUT_S} s; it has {ray.cluster_resources().get('CPU', 0)} CPUs."
            )
        actor_class = ray.remote(num_cpus=1)(RayWorkerWrapper)
        for rank in range(world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank
            )
            self.actors.append(
                actor_class.options(scheduling_strategy=strategy).remote(self.config, rank)
            )
        try:
            ips = self._get([actor.node_ip.remote() for actor in self.actors])
            init_method = self._get([self.actors[0].rendezvous.remote()])[0]
            # Each rank's place among the ranks on its own machine, for its cores.
            local_ranks = [ips[:rank].count(ip) for rank, ip in enumerate(ips)]
            self._get([
                actor.init_worker.remote(init_method, local_rank, ips.count(ip))
                for actor, ip, local_rank in zip(self.actors, ips, local_ranks)
            ])
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs: list[Any]) -> list[Any]:
        """Ray's results; a dead actor or a raising call as a RuntimeError."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayError as error:
            raise RuntimeError(f"A Ray worker failed: {error}") from error

    def _call(self, payload: bytes) -> list[Any]:
        return self._answers(self._send(payload))

    def _submit(self, payload: bytes) -> PendingOutput:
        return _RayAnswer(self, self._send(payload))

    def _send(self, payload: bytes) -> list[Any]:
        """Every actor's call of `payload` (an actor runs its calls in the order sent)."""
        if not self.actors:
            raise RuntimeError("The executor is shut down.")
        shared = self._ray.put(payload)  # once, read by every actor
        return [actor.execute.remote(shared) for actor in self.actors]

    def _answers(self, refs: list[Any]) -> list[Any]:
        answers = self._get(refs)
        errors = [f"worker rank {rank} failed:\n{value}"
                  for rank, (status, value) in enumerate(answers) if status != "ok"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [value for _, value in answers]

    def shutdown(self) -> None:
        actors, self.actors = getattr(self, "actors", []), []
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for actor in actors:
            ray.kill(actor)
        if self.placement_group is not None:
            self._remove_placement_group(self.placement_group)
            self.placement_group = None


class _RayAnswer(PendingOutput):
    """A step sent to the actors: its output rank's result once every actor answered."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self.executor = executor
        self.refs = refs

    def result(self) -> ModelRunnerOutput:
        return self.executor._answers(self.refs)[self.executor.output_rank]
