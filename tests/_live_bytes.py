"""The tests' measure of memory: :class:`megashard.advisor.live_bytes.LiveBytes` (the library's, which the advisor's
traces use too — one definition of the measured peak; its docstring has it)."""
from megashard.advisor.live_bytes import LiveBytes, _plain  # noqa: F401
