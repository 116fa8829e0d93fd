"""The Trainer's settings: defaults a subclass extends, a merge that refuses unknown keys, the mesh."""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
from jax.sharding import Mesh

from nnx_shard._base import mesh_from_string
from nnx_shard._checkpoint import Checkpointer
from nnx_shard._sharding import parse_tactic
from nnx_shard.errors import ConfigError, MeshError, TacticError, UnknownConfigKeyError


@dataclasses.dataclass(frozen=True)
class Key:
    """One Trainer setting: its default, what it accepts (a check and its words) and what it means."""

    default: Any
    check: Callable[[Any], bool] | None  # None: checked elsewhere (the mesh when it is built, the strategy)
    expects: str
    meaning: str


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(meaning: str, default: int) -> Key:
    return Key(default, lambda v: _int(v) and v >= 0, "a whole number >= 0", meaning)


def _flag(meaning: str, default: bool) -> Key:
    return Key(default, lambda v: isinstance(v, bool), "True or False", meaning)


def _one_of(meaning: str, choices: tuple[str, ...]) -> Key:
    return Key(choices[0], lambda v: v in choices, f"one of {choices}", meaning)


def _seconds(meaning: str, default: float, *, zero_is_off: bool = False) -> Key:
    if zero_is_off:
        return Key(
            default, lambda v: _number(v) and v >= 0, "a number of seconds >= 0 (0: no limit)", meaning
        )
    return Key(default, lambda v: _number(v) and v > 0, "a number of seconds > 0", meaning)


def _text(meaning: str) -> Key:
    return Key("", lambda v: isinstance(v, str), "a string ('' for none)", meaning)


PROGRESS = ("auto", "bar", "lines", "off", "on")  # "on": the same as "bar" (kept from 2026-11-23)

# Every built-in key, in the order the generated table shows them: the one place a key is declared.
SCHEMA: dict[str, Key] = {
    # where the state lives
    "mesh": Key(
        "fsdp:-1",
        None,
        "a mesh string or a Mesh",
        'the mesh: a string ("dp:2,fsdp:-1") or a jax.sharding.Mesh',
    ),
    "sharding_strategy": Key(
        [(".*", "fsdp(axis='fsdp')")],
        None,
        "(regex, tactic) pairs",
        "the ordered rules that place every leaf",
    ),
    "barrier_timeout": _seconds(
        "how long a barrier between processes waits before naming who is missing", 200.0
    ),
    # hangs become failures: the process ends, naming the section, so the job can restart
    "step_timeout": _seconds(
        "a training step after the first (the startup's) that takes longer ends the process (a hang made "
        "a failure)",
        0.0,
        zero_is_off=True,
    ),
    "startup_timeout": _seconds(
        "the same for init, restore and the first step (its compile)", 0.0, zero_is_off=True
    ),
    "save_timeout": _seconds("the same for a checkpoint save", 0.0, zero_is_off=True),
    "heartbeat_timeout": Key(
        10,
        lambda v: _int(v) and v > 0,
        "a whole number of seconds > 0",
        "under nnx-shard launch: seconds before jax.distributed declares a silent peer dead",
    ),
    "shutdown_timeout": Key(
        30,
        lambda v: _int(v) and v > 0,
        "a whole number of seconds > 0",
        "under nnx-shard launch: how long jax.distributed's shutdown waits for the other processes",
    ),
    # the run
    "seed": _count("the seed of the model's, the optimizer's and the data's random numbers", 0),
    "total_steps": _count("the step train() stops at", 100),
    "ema_decay": Key(
        0.999,
        lambda v: v is None or (_number(v) and 0 <= v <= 1),
        "a number in [0, 1], or None for no EMA",
        "the EMA's decay; None: no EMA is created, saved or restored",
    ),
    "eval_every": _count("evaluate every this many steps (0: never during train())", 0),
    "eval_weights": _one_of(
        'which weights train() evaluates: "ema" (the EMA\'s, when there is one) or "model"', ("ema", "model")
    ),
    "on_nonfinite": _one_of(
        'a NaN/Inf loss or gradient norm: "stop" (not applied, run ends) or "skip" (not applied)',
        ("stop", "skip"),
    ),
    "max_consecutive_nonfinite": Key(
        10,
        lambda v: _int(v) and v >= 1,
        "a whole number >= 1",
        'with "skip": stop after this many non-finite steps in a row',
    ),
    # checkpoints
    "workdir": _text("where checkpoints, the lock and TensorBoard's logs go ('' : nothing is saved)"),
    "save_every": _count("save a checkpoint every this many steps (0: only at the end)", 0),
    "save_at_end": _flag(
        "save when train() returns (finished, data exhausted, stopped); preemption always saves", True
    ),
    "max_to_keep": Key(
        3,
        lambda v: v is None or (_int(v) and v >= 1),
        "a whole number >= 1, or None to keep every step",
        "how many steps to keep (the Checkpointer's max_to_keep)",
    ),
    "best_metric": _text("keep the best max_to_keep steps by this eval metric (and the latest)"),
    "best_mode": _one_of('"min" or "max": which way best_metric is better', ("min", "max")),
    "async_save": _flag(
        "save in the background while training goes on (the Checkpointer's async_save)", True
    ),
    "verify": _flag(
        "record each step's fingerprints and check them on restore (the Checkpointer's verify)", True
    ),
    "save_frozen": _flag("False: checkpoints leave out the parameters Trainer.wrt does not train", True),
    "resume": _one_of('"auto": restore the newest checkpoint that verifies before training', ("off", "auto")),
    "overwrite": _flag(
        "a run that does not resume may start in a workdir holding checkpoints (set aside)", False
    ),
    "lock_stale_after": _seconds(
        "seconds without a heartbeat after which another host's workdir lock is taken over", 300.0
    ),
    "max_host_bytes": _count(
        "> 0: bound the host memory a restore reads with at once (the restore's max_host_bytes)", 0
    ),
    "free_live": _flag(
        "free the live arrays before a restore reads, to keep the peak low (the restore's free_live)", False
    ),
    # in-memory snapshots: own shards and a peer's copy in host memory
    "snapshot_every": _count("take an in-memory snapshot every this many steps (0: off)", 0),
    "snapshot_dir": _text(
        "where snapshots live (default: a per-job folder under /dev/shm, else the temp dir)"
    ),
    # what the user sees
    "log_every": _count("log the loss every this many steps (0: never)", 10),
    "progress": Key(
        "auto",
        lambda v: v in PROGRESS,
        f"one of {PROGRESS}",
        '"auto" (a bar on a terminal, lines otherwise), "bar", "lines", "off"; "on" is "bar"',
    ),
    "tensorboard": _flag("write the logged metrics for TensorBoard under workdir", True),
}

# Keys renamed to the Checkpointer's and the restore's names; the old ones are read with a DeprecationWarning.
RENAMED = {
    "keep": "max_to_keep",
    "async_checkpoint": "async_save",
    "verify_checkpoints": "verify",
    "free_live_on_restore": "free_live",
}

DEFAULTS: dict[str, Any] = {key: k.default for key, k in SCHEMA.items()}


def default_config() -> ml_collections.ConfigDict:
    """The base Trainer's settings as a ConfigDict (the classmethod ``Trainer.default_config`` returns it).

    >>> default_config().mesh
    'fsdp:-1'
    """
    return ml_collections.ConfigDict(DEFAULTS)


def _check_keys(defaults: Mapping[str, Any], given: Mapping[str, Any], where: str) -> None:
    for key, value in given.items():
        if key not in defaults:
            close = difflib.get_close_matches(str(key), [str(k) for k in defaults], n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
            raise UnknownConfigKeyError(
                f"unknown config key {where}{key!r}{hint} The known keys are {sorted(defaults)}. A Trainer "
                f"subclass declares its own keys in default_config(): "
                f"`c = super().default_config(); c.{key} = ...; return c`."
            )
        if isinstance(defaults[key], Mapping) and isinstance(value, Mapping):
            _check_keys(defaults[key], value, f"{where}{key}.")


def _renamed(values: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the keys renamed on 2026-11-27 under their new names, each with a
    DeprecationWarning."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out and old not in base:
            if new in out:
                raise ConfigError(
                    f"config keys {old!r} and {new!r} both given; {old!r} is the old name of {new!r}: "
                    f"give {new!r} only."
                )
            warnings.warn(
                f"config key {old!r} is now {new!r} (the Checkpointer's and the restore's name); {old!r} is "
                "read "
                f"as {new!r} and will be refused in a later release.",
                DeprecationWarning,
                stacklevel=4,
            )
            out[new] = out.pop(old)
    return out


def _plain(x: Any) -> Any:
    return x.to_dict() if isinstance(x, ml_collections.ConfigDict) else x


def merge_config(defaults: ml_collections.ConfigDict, given: Any) -> ml_collections.ConfigDict:
    """``defaults`` overridden by ``given`` (a dict or ConfigDict); unknown keys raise.

    >>> merge_config(default_config(), {"log_every": 1}).log_every
    1
    >>> merge_config(default_config(), {"save_evry": 10})
    Traceback (most recent call last):
    ...
    nnx_shard.errors.UnknownConfigKeyError: unknown config key 'save_evry'; did you mean 'save_every' ...? ...
    """
    values = _plain(given) if given is not None else {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"a Trainer config is a dict or ConfigDict; got {type(given).__name__}.")
    base = defaults.to_dict()
    values = _renamed(values, base)
    _check_keys(base, values, "")

    def merge(a: dict[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = (
                merge(out[k], _plain(v))
                if isinstance(out.get(k), dict) and isinstance(_plain(v), Mapping)
                else v
            )
        return out

    merged = ml_collections.ConfigDict(merge(base, values))
    check_values(merged.to_dict(), defaults.to_dict())
    return merged


def _expected(key: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"config.{key} must be {what}; got {value!r} ({type(value).__name__}).")


def check_values(config: Mapping[str, Any], defaults: Mapping[str, Any], where: str = "") -> None:
    """Checks each key's type and range: the built-in keys by their rules, a subclass's by its default's type.

    An int default takes an int, a float default an int or a float, a string
    default a string, a bool default a bool; a None default takes anything.

    >>> check_values({**DEFAULTS, "total_steps": "20"}, DEFAULTS)
    Traceback (most recent call last):
    ...
    nnx_shard.errors.ConfigError: config.total_steps must be a whole number >= 0; got '20' (str).
    """
    for key, value in config.items():
        name, default = f"{where}{key}", defaults.get(key)
        spec = None if where else SCHEMA.get(key)
        if spec is not None and spec.check is not None:
            if not spec.check(value):
                raise _expected(name, value, spec.expects)
        elif not where and key == "sharding_strategy":
            check_strategy(value)
        elif not where and key == "mesh":
            continue  # checked when the mesh is built (it must fit the devices)
        elif isinstance(default, Mapping) and isinstance(value, Mapping):
            check_values(value, default, f"{name}.")
        elif default is not None and not _same_kind(default, value):
            raise _expected(name, value, f"a {type(default).__name__}, like its default {default!r}")


def _same_kind(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, list | tuple):
        return isinstance(value, list | tuple)
    return True


def check_strategy(strategy: Any) -> None:
    """Every rule a ``(regex, tactic)`` pair whose regex compiles and whose tactic parses."""
    if isinstance(strategy, str | bytes | Mapping) or not isinstance(strategy, list | tuple):
        raise _expected("sharding_strategy", strategy, "a list of (regex, tactic) pairs")
    for i, rule in enumerate(strategy):
        if not isinstance(rule, list | tuple) or len(rule) != 2 or not isinstance(rule[0], str):
            raise ConfigError(f"config.sharding_strategy[{i}] must be a (regex, tactic) pair; got {rule!r}.")
        try:
            re.compile(rule[0])
        except re.error as e:
            raise ConfigError(
                f"config.sharding_strategy[{i}] regex {rule[0]!r} does not compile: {e}."
            ) from e
        if isinstance(rule[1], str):
            try:
                parse_tactic(rule[1])
            except TacticError as e:
                raise ConfigError(f"config.sharding_strategy[{i}] ({rule[0]!r}, {rule[1]!r}): {e}") from e


def config_mesh(value: Any) -> Mesh:
    """``config.mesh`` as a Mesh: a Mesh is taken as it is (any devices, order, axis types); a string is
    parsed."""
    if isinstance(value, Mesh):
        return value
    if isinstance(value, str):
        try:
            return mesh_from_string(value)
        except MeshError as e:
            raise ConfigError(f"config.mesh {value!r} does not fit this job's devices: {e}") from e
    raise ConfigError(
        f"config.mesh is a mesh string such as 'fsdp:-1' or a jax.sharding.Mesh; got {value!r}."
    )


def config_checkpointer(cfg: ml_collections.ConfigDict) -> Checkpointer | None:
    """The Checkpointer of ``workdir/checkpoints`` with the config's settings (None without a workdir)."""
    if not cfg.workdir:
        return None
    return Checkpointer(
        str(cfg.workdir).rstrip("/") + "/checkpoints",
        max_to_keep=cfg.max_to_keep,
        best_metric=cfg.best_metric or None,
        best_mode=cfg.best_mode,
        async_save=cfg.async_save,
        verify=cfg.verify,
    )
