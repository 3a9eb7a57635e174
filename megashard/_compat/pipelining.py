"""torch.distributed.pipelining internals (:mod:`megashard.train.pipeline`): a ``PipelineStage`` that never sends to
its own rank.
"""
from __future__ import annotations


def pipeline_stage_class() -> type:
    """``torch.distributed.pipelining.PipelineStage``, or a subclass that never sends to its own rank.

    Schedules that place two adjacent stages on one rank (``zbv``'s V: stages 1 and 2 on pp rank 1) pass
    activations between them in memory, but where the schedule warms its communicators up with the stages'
    ``_get_init_p2p_neighbors_ops`` (torch 2.11; 2.13 votes instead; 2.15 has no such method), those ops include
    an isend/irecv to the stage's own rank, which gloo has no connection for ("Pair is not connected"). Where that
    method exists the subclass drops the ops whose peer is this rank; everything else is PyTorch's own stage.
    """
    from torch.distributed.pipelining import PipelineStage

    if not callable(getattr(PipelineStage, "_get_init_p2p_neighbors_ops", None)):
        return PipelineStage
    if not _STAGE_CLASS:
        class NoSelfP2PStage(PipelineStage):
            def _get_init_p2p_neighbors_ops(self):
                ops = super()._get_init_p2p_neighbors_ops()
                return [op for op in ops if getattr(op, "group_peer", None) != self.group_rank]

        _STAGE_CLASS.append(NoSelfP2PStage)
    return _STAGE_CLASS[0]


_STAGE_CLASS: list = []  # built on first use: importing pipelining loads DTensor
