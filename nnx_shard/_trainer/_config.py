"""The Trainer's settings: defaults a subclass extends, a merge that refuses unknown keys, the mesh."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
from jax.sharding import Mesh

from nnx_shard._base import mesh_from_string
from nnx_shard._checkpoint import Checkpointer
from nnx_shard._sharding import parse_tactic
from nnx_shard.errors import ConfigError, MeshError, TacticError, UnknownConfigKeyError

DEFAULTS: dict[str, Any] = {
    # where the state lives
    "mesh": "fsdp:-1",  # a mesh string ("dp:2,fsdp:-1") or a jax.sharding.Mesh
    "sharding_strategy": [(".*", "fsdp(axis='fsdp')")],
    "barrier_timeout": 200.0,
    # hangs become failures (seconds, 0 = off): the process ends, naming the section, so the job can restart
    "step_timeout": 0.0,
    "startup_timeout": 0.0,  # init, restore and the first step (its compile)
    "save_timeout": 0.0,
    "heartbeat_timeout": 10,  # under nnx-shard launch: seconds before jax.distributed declares a peer dead
    "shutdown_timeout": 30,
    # the run
    "seed": 0,
    "total_steps": 100,
    "ema_decay": 0.999,  # None: no EMA is created, saved or restored
    "eval_every": 0,
    "eval_weights": "ema",  # which weights train() evaluates: "ema" (the EMA's, when there is one) or "model"
    "on_nonfinite": "stop",  # a NaN/Inf loss or gradient norm: "stop" (not applied, run ends) or "skip" (not applied)
    "max_consecutive_nonfinite": 10,  # with "skip": stop after this many non-finite steps in a row
    # checkpoints
    "workdir": "",
    "save_every": 0,
    "save_at_end": True,  # save when train() returns (finished, data exhausted, stopped); preemption always saves
    "keep": 3,
    "best_metric": "",  # keep the best `keep` steps by this eval metric (and the latest)
    "best_mode": "min",
    "async_checkpoint": True,
    "verify_checkpoints": True,
    "save_frozen": True,  # False: checkpoints leave out the parameters Trainer.wrt does not train
    "resume": "off",  # "auto": restore the newest checkpoint that verifies before training
    "overwrite": False,  # a run that does not resume may start in a workdir holding checkpoints (they are set aside)
    "lock_stale_after": 300.0,  # seconds without a heartbeat after which another host's workdir lock is taken over
    "max_host_bytes": 0,  # > 0: bound the host memory a restore reads with at once
    "free_live_on_restore": False,
    # in-memory snapshots: own shards and a peer's copy in host memory every N steps (0 = off)
    "snapshot_every": 0,
    "snapshot_dir": "",  # default: a per-job folder under /dev/shm (else the temp dir)
    # what the user sees
    "log_every": 10,
    "progress": "auto",  # "auto" (a bar on a terminal, lines otherwise), "bar", "lines", "off"
    "tensorboard": True,
}

PROGRESS = ("auto", "bar", "on", "lines", "off")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _rules() -> dict[str, tuple[Callable[[Any], bool], str]]:
    """Each built-in key's check and what it expects (the mesh and the strategy are checked on their own)."""
    rules: dict[str, tuple[Callable[[Any], bool], str]] = {}
    for key, choices in (
        ("progress", PROGRESS),
        ("best_mode", ("min", "max")),
        ("resume", ("off", "auto")),
        ("on_nonfinite", ("stop", "skip")),
        ("eval_weights", ("ema", "model")),
    ):
        rules[key] = (lambda v, c=choices: v in c, f"one of {choices}")
    for key in (
        "seed",
        "total_steps",
        "eval_every",
        "save_every",
        "max_host_bytes",
        "log_every",
        "snapshot_every",
    ):
        rules[key] = (lambda v: _int(v) and v >= 0, "a whole number >= 0")
    for key in (
        "save_at_end",
        "async_checkpoint",
        "verify_checkpoints",
        "save_frozen",
        "free_live_on_restore",
        "tensorboard",
        "overwrite",
    ):
        rules[key] = (lambda v: isinstance(v, bool), "True or False")
    for key in ("barrier_timeout", "lock_stale_after"):
        rules[key] = (lambda v: _number(v) and v > 0, "a number of seconds > 0")
    for key in ("step_timeout", "startup_timeout", "save_timeout"):
        rules[key] = (lambda v: _number(v) and v >= 0, "a number of seconds >= 0 (0: no limit)")
    for key in ("heartbeat_timeout", "shutdown_timeout"):
        rules[key] = (lambda v: _int(v) and v > 0, "a whole number of seconds > 0")
    for key in ("workdir", "best_metric", "snapshot_dir"):
        rules[key] = (lambda v: isinstance(v, str), "a string ('' for none)")
    rules["keep"] = (
        lambda v: v is None or (_int(v) and v >= 1),
        "a whole number >= 1, or None to keep every step",
    )
    rules["max_consecutive_nonfinite"] = (lambda v: _int(v) and v >= 1, "a whole number >= 1")
    rules["ema_decay"] = (
        lambda v: v is None or (_number(v) and 0 <= v <= 1),
        "a number in [0, 1], or None for no EMA",
    )
    return rules


RULES = _rules()


def base_config() -> ml_collections.ConfigDict:
    """The Trainer's defaults as a ConfigDict (the classmethod ``Trainer.default_config`` returns it)."""
    return ml_collections.ConfigDict(DEFAULTS)


def default_config() -> ml_collections.ConfigDict:
    """The base Trainer's settings (``Trainer.default_config()``).

    >>> default_config().mesh
    'fsdp:-1'
    """
    return base_config()


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


def _plain(x: Any) -> Any:
    return x.to_dict() if isinstance(x, ml_collections.ConfigDict) else x


def merge_config(defaults: ml_collections.ConfigDict, given: Any) -> ml_collections.ConfigDict:
    """``defaults`` overridden by ``given`` (a dict or ConfigDict); unknown keys raise.

    >>> merge_config(base_config(), {"log_every": 1}).log_every
    1
    >>> merge_config(base_config(), {"save_evry": 10})
    Traceback (most recent call last):
    ...
    nnx_shard.errors.UnknownConfigKeyError: unknown config key 'save_evry'; did you mean 'save_every' ...? ...
    """
    values = _plain(given) if given is not None else {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"a Trainer config is a dict or ConfigDict; got {type(given).__name__}.")
    base = defaults.to_dict()
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
        rule = None if where else RULES.get(key)
        if rule is not None:
            if not rule[0](value):
                raise _expected(name, value, rule[1])
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
    """``config.mesh`` as a Mesh: a Mesh is taken as it is (any devices, order, axis types); a string is parsed."""
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
        max_to_keep=cfg.keep,
        best_metric=cfg.best_metric or None,
        best_mode=cfg.best_mode,
        async_save=cfg.async_checkpoint,
        verify=cfg.verify_checkpoints,
    )
