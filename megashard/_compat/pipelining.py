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


def pipelines_infer_shapes_on_fake() -> None:
    """In a rehearsal process (the ``fake`` backend, megashard.rehearse): let a pipeline schedule infer its stages'
    shapes as it does on a real backend.

    torch 2.15's schedules refuse a ``fake`` process group unless every stage was given static shape metadata
    ("requires dynamic shape inference, which is not supported with a fake process group"); megashard's stages infer
    their shapes, and a rehearsal carries the inference's point-to-point messages itself (its broker), as it does on
    torch 2.11 and 2.13, whose schedules do not look at the backend. Here the schedules module sees ``gloo`` where the
    group is ``fake`` — it then votes and pre-connects as on gloo (calls a real run makes too) — and nothing else
    changes. A no-op where the schedules module does not ask for the backend."""
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules

    if getattr(schedules, "dist", None) is not dist or not hasattr(dist, "get_backend"):
        return  # already done in this process, or a release whose schedules reach torch.distributed otherwise

    class _SeesGloo:
        def __getattr__(self, name: str):
            return getattr(dist, name)

        @staticmethod
        def get_backend(group=None):
            backend = dist.get_backend(group)
            return "gloo" if str(backend) == "fake" else backend

    schedules.dist = _SeesGloo()
