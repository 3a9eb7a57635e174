"""The layout advisor of ``megashard plan --suggest`` (docs/advisor.md): plain arithmetic, no torch import.

Modules: ``shape`` (:class:`JobShape`: the job's numbers and the example model's parameter shapes), ``memory``
(peak bytes per rank and what they are made of), ``cost`` (a roofline step time and the bytes each axis moves),
``search`` (the candidate layouts, validated by the job's own rules, ranked), ``report`` (table and JSON).
"""
