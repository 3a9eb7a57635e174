"""Live recovery for your own training loop: a node lost or joining costs seconds, not a restart.

    import megashard
    from megashard.live import LiveLoop

    def build(state):                              # every world: your model on this world's layout
        model = MyModel()
        fully_shard(model, mesh=state.fully_shard_mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(model, optimizer, state, step): # one step; the batch a function of (step, dp rank, dp size)
        x, y = batch(step, state.rank_in("dp"), state.size("dp"))
        loss = model(x, y); loss.backward(); optimizer.step(); optimizer.zero_grad()
        return loss

    LiveLoop(megashard.ParallelConfig(tp=2, dp_shard="auto"), build, train_step).run(steps=1000)

Start it with megashard's agent (torchrun's arguments) and ``MEGASHARD_RECOVERY=live``::

    MEGASHARD_RECOVERY=live python -m megashard.launch.agent --nnodes 1:4 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 --rdzv-id run42 train.py

What :class:`LiveLoop` does, in the shape of torchft's Manager and nvidia-resiliency-ext's in-process wrapper: per
world it initialises megashard for the world's size (the free data-parallel axis absorbs it), calls ``build(state)``
and fills the model and optimizer from the live copies the ranks hold (:mod:`megashard.train.memory_copies`: after
every step each rank copies its shards to host memory and, with ``memory_copies=1``, to a rank of the next node) —
or, in the first world and when no live copy covers a lost node, from ``load(model, optimizer, state) -> step`` (your
checkpoint; None: from step 0). Then it calls ``train_step`` for each step. A collective that fails because a peer
went away ends the step: the survivors abort the broken groups, agree on the new world among themselves and go on
from the newest step every shard survived (at most the step in flight is redone); a node joining is taken in at a
step boundary. Under plain torchrun (no ``MEGASHARD_RECOVERY=live``) the loop runs once, without recovery.

Limits: the state protected is the model's parameters and the optimizer's tensors (learning-rate schedules and data
position must follow from the step number); ``train_step`` must not keep process groups or tensors of an earlier
world; the rendezvous host (``--rdzv-endpoint``) must survive; randomness must be drawn from the step (dropout masks
differ from an uninterrupted run otherwise).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

__all__ = ["LiveLoop"]


class LiveLoop:
    """Run ``train_step`` for steps ``[start, steps)`` across world changes (see the module docstring).

    Args:
        parallel: the layout (a ``megashard.ParallelConfig`` with a free data-parallel axis: ``dp_shard="auto"``).
        build: ``build(state) -> (model, optimizer)`` for the current world.
        train_step: ``train_step(model, optimizer, state, step)``: one step (0-based); its return value is kept as
            :attr:`last`.
        load: ``load(model, optimizer, state) -> step`` where no live copy serves (the first world, a lost node
            without a copy): your newest checkpoint's step, 0 without one. None: step 0.
        memory_copies: 0 or 1, as ``checkpoint.memory_copies`` (0: only HSDP replicas cover a lost node).
    """

    def __init__(self, parallel: Any, build: Callable, train_step: Callable, *, load: Optional[Callable] = None,
                 memory_copies: int = 1) -> None:
        if memory_copies not in (0, 1):
            from megashard.errors import ConfigError

            raise ConfigError(f"LiveLoop(memory_copies={memory_copies!r}): must be 0 or 1 (copies of each rank's shards "
                              "kept in the memory of a rank on another node)")
        self.parallel, self.build, self.train_step, self.load = parallel, build, train_step, load
        self.memory_copies = memory_copies
        self.last: Any = None
        self.worlds: list[dict] = []  # per world: its size, the step it started at and where its state came from
        self.model: Any = None
        self.optimizer: Any = None

    def run(self, steps: int) -> int:
        """Train until step ``steps``; returns it. Every rank calls it."""
        from megashard import state as megashard
        from megashard.train.live_world import LIVE_STORE_ENV, JobEnded, LeftOut, LiveWorld

        if not os.environ.get(LIVE_STORE_ENV) or os.environ.get("MEGASHARD_RECOVERY") != "live":
            state = megashard.initialize(self.parallel)
            self.model, self.optimizer = self.build(state)
            start = int(self.load(self.model, self.optimizer, state)) if self.load else 0
            self.worlds.append({"world_size": state.world_size, "start": start, "state_from": "load"})
            for step in range(start, steps):
                self.last = self.train_step(self.model, self.optimizer, state, step)
            return steps
        from megashard.errors import PeerLostError
        from megashard.launch.lifeline import die_with_parent, env_pid
        from megashard.train.live import _boundary, _broken, _forget_world

        die_with_parent(env_pid("MEGASHARD_AGENT_PID"))  # a node that dies takes its workers (torchrun's own do not)
        from megashard.train.memory_copies import MemoryCopies, module_entries, module_targets, restore

        pause = os.environ.get("MEGASHARD_PAUSE_FILE") or None  # tests: hold the world between steps
        world = LiveWorld.from_env(self.parallel)
        try:
            world.join()
        except JobEnded:
            return steps
        held: list[MemoryCopies] = []
        while True:
            try:
                state = megashard.initialize(self.parallel)
                model, optimizer = self.model, self.optimizer = self.build(state)
                start = restore(held, lambda keys: module_targets(model, optimizer, keys), None, state.device_type)
                origin = "memory"
                if start is None:
                    start, origin = (int(self.load(model, optimizer, state)) if self.load else 0), "load"
                self.worlds.append({"world_size": state.world_size, "start": start, "state_from": origin})
                if world.changes:
                    world.tell_agent()
                for step in range(start, steps):
                    info = _boundary(world, pause)
                    if info is not None:
                        _forget_world(held)
                        world.adopt(info)
                        break
                    self.last = self.train_step(model, optimizer, state, step)
                    if not held or held[-1].world_id != world.prefix:
                        held.append(MemoryCopies(lambda m=model, o=optimizer: module_entries(m, o),
                                                 self.memory_copies, world.prefix, world.local_world_size))
                    held[-1].capture(step + 1)
                    if len(held[-1].gens) >= 2:
                        del held[:-1]
                else:
                    world.close(ended=True)
                    return steps
            except Exception as e:  # noqa: BLE001 - a broken world is handled here, anything else is re-raised
                if not _broken(world, e):
                    raise
                try:
                    _forget_world(held)
                    world.signal_abort()
                    world.after_loss()
                except LeftOut as left:
                    raise PeerLostError(str(left)) from None
                except Exception as lost:  # noqa: BLE001 - the store itself is gone, or no new world in time
                    if world.store_alive():
                        from megashard.train.live import _fail_over

                        _fail_over(world, lost)
                    from megashard.errors import MegashardError

                    raise MegashardError(f"the rendezvous host ({os.environ.get(LIVE_STORE_ENV)}) is gone: the world "
                                         "cannot re-form without its store") from None
