"""google-tunix's Llama 3 and Qwen 3 with the RoPE their checkpoints state: any theta, linear and llama3
scaling.

tunix's ``Llama3`` and ``Qwen3`` call their module's ``apply_rope`` without the
config's theta, so every checkpoint runs at 1e6 (Llama 3's is 5e5), and they have
no frequency scaling (Llama 3.1 and 3.2 use ``llama3``). The classes here are
tunix's own, with one change: each attention's ``block`` runs tunix's code with
``apply_rope`` bound to the frequencies of the config's ``rope_theta``,
``rope_kind`` and ``rope_parameters`` (two fields added to tunix's
``ModelConfig``). Parameters, paths, sharding and the rest of the forward pass are
tunix's, so the key maps, LoRA and the exports see the same model.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from typing import Any

from nnx_shard._families._rope import Rope, apply_rope, inverse_frequencies

#: tunix's modules whose attention ignores the config's theta: (module, model class).
ROPE_MODELS = {
    "tunix.models.llama3.model": "Llama3",
    "tunix.models.qwen3.model": "Qwen3",
}


def _with_rope(block: types.FunctionType) -> Any:
    """tunix's ``Attention.block``, calling ``apply_rope`` with the frequencies of ``self.config``."""

    def rope_block(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = self.config
        rope = Rope(float(config.rope_theta), config.rope_kind, config.rope_parameters)
        bound = functools.partial(apply_rope, inv_freq=inverse_frequencies(rope, self.head_dim))
        run = types.FunctionType(
            block.__code__, {**block.__globals__, "apply_rope": bound}, block.__name__, block.__defaults__
        )
        return run(self, *args, **kwargs)

    rope_block.__doc__ = block.__doc__
    return rope_block


@functools.cache
def rope_model(module_name: str) -> tuple[type, type]:
    """``(model class, ModelConfig class)``: tunix's, with the attention applying the config's RoPE.

    >>> import pytest; _ = pytest.importorskip("tunix")
    >>> cls, config_cls = rope_model("tunix.models.llama3.model")
    >>> cls.__name__, [f.name for f in dataclasses.fields(config_cls)][-2:]
    ('Llama3', ['rope_kind', 'rope_parameters'])
    """
    module = importlib.import_module(module_name)
    base = getattr(module, ROPE_MODELS[module_name])
    block = module.Attention.block
    if block.__closure__ or "apply_rope" not in block.__code__.co_names:
        raise ImportError(f"{module_name}.Attention.block no longer calls apply_rope as nnx_shard expects")
    config_cls = dataclasses.make_dataclass(
        "ModelConfig",
        [
            ("rope_kind", str, dataclasses.field(default="default")),
            ("rope_parameters", tuple, dataclasses.field(default=())),
        ],
        bases=(module.ModelConfig,),
        frozen=module.ModelConfig.__dataclass_params__.frozen,  # as tunix's (Qwen3's is not)
        namespace={
            "__module__": __name__,
            "__doc__": f"{module_name}.ModelConfig with the RoPE's kind and parameters.",
        },
    )
    attention = type("Attention", (module.Attention,), {"block": _with_rope(block), "__module__": __name__})

    def __init__(self: Any, config: Any, *, rngs: Any) -> None:
        base.__init__(self, config, rngs=rngs)
        for layer in self.layers:
            object.__setattr__(layer.attn, "__class__", attention)

    doc = f"{module_name}.{base.__name__} whose attention applies the RoPE of its config (theta and scaling)."
    model = type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__, "__doc__": doc})
    return model, config_cls
