"""The Trainer's settings: defaults a subclass extends, a merge that refuses unknown keys, the mesh."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from nnx_shard._errors import ConfigError, UnknownConfigKeyError
from nnx_shard._mesh import mesh_from_string

DEFAULTS: dict[str, Any] = {
    # where the state lives
    "mesh": "fsdp:-1",  # a mesh string ("dp:2,fsdp:-1") or a jax.sharding.Mesh
    "sharding_strategy": [(".*", "fsdp(axis='fsdp')")],
    "barrier_timeout": 200.0,
    # the run
    "seed": 0,
    "total_steps": 100,
    "ema_decay": 0.999,  # None: no EMA is created, saved or restored
    "eval_every": 0,
    # checkpoints
    "workdir": "",
    "save_every": 0,
    "save_at_end": True,  # save when train() returns (finished, data exhausted, stopped); preemption always saves
    "keep": 3,
    "best_metric": "",  # keep the best `keep` steps by this eval metric (and the latest)
    "best_mode": "min",
    "async_checkpoint": True,
    "verify_checkpoints": True,
    "resume": "off",  # "auto": restore the workdir's latest checkpoint before training
    "max_host_bytes": 0,  # > 0: bound the host memory a restore reads with at once
    "free_live_on_restore": False,
    # what the user sees
    "log_every": 10,
    "progress": "auto",  # "auto" (a bar on a terminal, lines otherwise), "bar", "lines", "off"
    "tensorboard": True,
}

PROGRESS = ("auto", "bar", "on", "lines", "off")


def base_config() -> ml_collections.ConfigDict:
    """The Trainer's defaults as a ConfigDict (the classmethod ``Trainer.default_config`` returns it)."""
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


def _plain(x: Any) -> Any:
    return x.to_dict() if isinstance(x, ml_collections.ConfigDict) else x


def merge_config(defaults: ml_collections.ConfigDict, given: Any) -> ml_collections.ConfigDict:
    """``defaults`` overridden by ``given`` (a dict or ConfigDict); unknown keys raise.

    >>> merge_config(base_config(), {"log_every": 1}).log_every
    1
    >>> merge_config(base_config(), {"save_evry": 10})
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UnknownConfigKeyError: unknown config key 'save_evry'; did you mean 'save_every' ...? ...
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
    if merged.progress not in PROGRESS:
        raise ConfigError(f"config.progress must be one of {PROGRESS}; got {merged.progress!r}.")
    if merged.best_mode not in ("min", "max"):
        raise ConfigError(f"config.best_mode must be 'min' or 'max'; got {merged.best_mode!r}.")
    if merged.resume not in ("off", "auto"):
        raise ConfigError(f"config.resume must be 'off' or 'auto'; got {merged.resume!r}.")
    return merged


def config_mesh(value: Any) -> Mesh:
    """``config.mesh`` as a Mesh: a Mesh is taken as it is (any devices, order, axis types); a string is parsed."""
    if isinstance(value, Mesh):
        return value
    if isinstance(value, str):
        return mesh_from_string(value)
    raise ConfigError(
        f"config.mesh is a mesh string such as 'fsdp:-1' or a jax.sharding.Mesh; got {value!r}."
    )


def compute_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axes with Auto axis types, for tracing steps of models written for them.

    Explicit axes make every traced op carry its sharding, which a model not
    written for it (a matmul over a sharded contracting dimension) cannot do.
    """
    explicit = jax.sharding.AxisType.Explicit
    if explicit not in tuple(mesh.axis_types):
        return mesh
    return Mesh(
        mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    )
