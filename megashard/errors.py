"""Exceptions raised by megashard for user-facing problems, and how their one line is worded (the command's
prefix, "did you mean" hints)."""
from __future__ import annotations

from typing import Any, Iterable


def error_line(prefix: str, error: BaseException) -> str:
    """``"<prefix>: error: <message>"`` on one line whatever the message holds (a file name with a newline, a
    nested error's text): how ``megashard <cmd>`` and the job's workers report a :class:`MegashardError`."""
    text = " ".join(str(error).split("\n"))
    return f"{prefix}: error: {text}"


def did_you_mean(word: object, choices: Iterable[str], *, prefix: str = "", cutoff: float = 0.6) -> str:
    """``" (did you mean '<prefix><choice>'?)"`` for the choice closest to ``word`` (difflib ratio >= ``cutoff``),
    or ``""`` when none is close: the hint of every "unknown name" error."""
    import difflib

    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=cutoff)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


#: Characters that print as nothing or as a plain space: shown escaped in a quoted name.
_INVISIBLE = frozenset("\u00a0\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u2028\u2029\u202f\u2060\u205f\u3000\ufeff")


def quoted(word: object) -> str:
    """``word`` in single quotes for an error line, with invisible characters escaped (``'t\\u200bp'``,
    ``'tp\\xa0'``): a name holding a no-break or zero-width space must not read like the name it resembles."""
    text = str(word)
    return "'" + "".join(ch if ch.isprintable() and ch not in _INVISIBLE and not (ch.isspace() and ch != " ")
                         else ch.encode("unicode_escape").decode("ascii") for ch in text) + "'"


def unknown_names(words: Iterable[object], choices: Iterable[str], *, prefix: str = "", cutoff: float = 0.6) -> str:
    """``'a' (did you mean 'b'?), 'c'``: each unknown word quoted (with ``prefix``; invisible characters escaped, and
    said when they are all that tells it from a valid name) and hinted, for one error line."""
    choices = list(choices)
    out = []
    for w in words:
        text = str(w)
        visible = "".join(ch for ch in text if ch not in _INVISIBLE and (ch.isprintable() or ch == " ")).strip()
        if visible != text and visible in choices:
            out.append(f"{quoted(prefix + text)} (an invisible character in '{prefix}{visible}': retype the key)")
        else:
            out.append(quoted(prefix + text) + did_you_mean(w, choices, prefix=prefix, cutoff=cutoff))
    return ", ".join(out)


class MegashardError(Exception):
    """Base class of every error megashard raises on purpose."""


class ConfigError(MegashardError, ValueError):
    """A parallel config is invalid: the message names the fields, their values, the rule and legal values."""


class RankMismatchError(ConfigError):
    """Ranks of one job disagree on their config, megashard version or torch version (names ranks and fields)."""


class PeerLostError(MegashardError, RuntimeError):
    """A peer process closed its connection during a collective megashard runs (another rank exited or crashed):
    the message says where, and that the other rank's own error tells why."""


class StateError(MegashardError, RuntimeError):
    """Parallel state used before initialisation, twice, or after teardown."""


class CheckpointLockedError(MegashardError, RuntimeError):
    """Another live job holds the checkpoint directory (the message names its host and pid and what to do)."""


class TransformerEngineMissingError(MegashardError, ImportError):
    """A TransformerEngine code path was requested but transformer-engine is not installed."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} needs NVIDIA TransformerEngine, which is not installed. "
            "Install it with `pip install 'megashard[te]'` (or `pip install transformer-engine[pytorch]`); "
            "it requires a CUDA machine."
        )


class ShardingError(ConfigError, RuntimeError):
    """A sharding layout is invalid: placements vs mesh, shard dims, split factors, flat-shard offsets."""


class RNGTrackerError(MegashardError, ValueError):
    """RNG tracker misuse: a duplicate stream name or seed, or a fork of a stream that was never added."""


class CheckpointError(MegashardError, ValueError):
    """A checkpoint request cannot be served: inconsistent shard metadata (shapes, holders, shard ids),
    an exchange that does not match its distribution, or (subclasses) a missing or corrupted checkpoint."""


class UnevenDTensorError(ShardingError):
    """An uneven DTensor's local shards do not tile its global shape, or an operation cannot handle its layout."""


class NotADTensorError(UnevenDTensorError, TypeError):
    """A DTensor helper was given something else (a plain tensor has no device mesh or placements): catchable as
    TypeError too, as Megatron-FSDP raises for its own such helpers."""


class StateDictMismatchError(MegashardError, RuntimeError):
    """Ranks that share a device mesh passed state dicts with different DTensor keys, shapes or placements."""


class StateDictKeyError(MegashardError, KeyError):
    """A key chain does not lead to a value in a (nested) state dict."""


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint file is missing, truncated, altered or unsafe to unpickle; the message names the file."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint at the given path (the message lists what was found there instead)."""


class DataError(MegashardError, ValueError):
    """A dataset cannot be used: a missing, corrupt or truncated ``.bin``/``.idx`` or token file, a tokenizer file
    that does not exist, tokens outside the vocabulary; the message names the file and the problem."""


class MissingExtraError(MegashardError, ImportError):
    """An optional feature needs a package that is not installed; the message says what to ``pip install``."""


def require_extra(module: str, what: str, extra: str, label: str | None = None) -> Any:
    """Import ``module`` (e.g. ``"safetensors.torch"``) for feature ``what``, or raise :class:`MissingExtraError`:
    "<what> needs the <label> package, which is not installed: pip install 'megashard[<extra>]' (or pip install
    <package>)", where the package is the module's top-level name and ``label`` defaults to it, quoted."""
    import importlib

    package = module.split(".")[0]
    try:
        importlib.import_module(package)  # first: a cached submodule must not hide a missing package
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{what} needs the {label or repr(package)} package, which is not installed: "
                                f"pip install 'megashard[{extra}]' (or pip install {package})") from None


class PipelineError(MegashardError, RuntimeError):
    """A pipeline stage failed or timed out; the message names the stage, its pp rank and global rank, the schedule
    and the step."""


class RankGridError(ConfigError, RuntimeError):
    """A rank-grid request that Megatron-LM refuses with RuntimeError (an axis of size > 1 missing from ``order``,
    a ``HyperCommGrid`` larger than the world): catchable as either."""


class RankGridAssertionError(ConfigError, AssertionError):
    """A ``RankGenerator`` with both ep and cp > 1, which Megatron-LM refuses with an assert: catchable as either."""


class RankGridKeyError(MegashardError, KeyError):
    """A lookup Megatron-LM answers with KeyError (a process group created twice or not yet, an unknown view or
    order token); the message is shown as written (KeyError would quote it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
