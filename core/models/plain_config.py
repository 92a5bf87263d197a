"""A model's configuration as plain attributes, free of transformers.

The engine reads a checkpoint's config once with transformers (``AutoConfig``: its defaults, its aliases, its
families' quirks) and hands every rank a :class:`PlainConfig` holding the same values. Our models only read
attributes, so they build from either; a rank's process then never imports transformers (several seconds of
imports per actor, for nothing it uses).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

_SCALARS = (bool, int, float, str, type(None), torch.dtype)
_DROP = object()  # a value that is not plain data (a class, a function): left out
# properties transformers keeps as deprecated aliases (reading them logs a warning): their values are carried under
# the current names (``dtype``, ``return_dict``)
_DEPRECATED = frozenset({"torch_dtype", "use_return_dict"})


class PlainConfig(SimpleNamespace):
    """Attributes read off a transformers ``PretrainedConfig``; nested configs (a multimodal checkpoint's
    ``text_config``) are PlainConfigs too. Picklable with no transformers import."""


def plain_config(config: Any) -> PlainConfig:
    """``config`` (a transformers ``PretrainedConfig``) as a :class:`PlainConfig`: its instance attributes, the values
    of its properties (``rope_scaling``, ``num_labels``), ``model_type`` and its ``attribute_map`` aliases
    (DeepSeek-V3's ``num_local_experts`` for ``n_routed_experts``)."""
    if isinstance(config, PlainConfig):
        return config
    cls = type(config)
    values: dict[str, Any] = {}
    for name in dir(cls):
        if name in _DEPRECATED or name.startswith("__") or not isinstance(inspect.getattr_static(cls, name), property):
            continue
        try:
            value = getattr(config, name)
        except (AttributeError, KeyError, TypeError, ValueError, NotImplementedError):
            continue  # a property this config cannot answer: nothing to carry
        if type(value) is cls:  # a fresh copy of this config itself (WavTokenizer's encoder_config): endless nesting
            continue
        values[name] = value
    values["model_type"] = getattr(config, "model_type", None)
    values.update(vars(config))
    spec = vars(config).get("_heterogeneity_spec")
    if spec is not None:  # a per-layer config's overrides (Gemma 4's full layers' head_dim), layer -> {field: value}
        values["per_layer_config"] = {int(i): dict(o) for i, o in spec.per_layer_overrides.items()}
    for alias, target in (getattr(cls, "attribute_map", None) or {}).items():
        if target in values:
            values[alias] = values[target]
    plain = {name: _plain(value) for name, value in values.items()}
    return PlainConfig(**{name: value for name, value in plain.items() if value is not _DROP})


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(type(value), "attribute_map")


def _plain(value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if _is_config(value):
        return plain_config(value)
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items()}
        return _DROP if any(v is _DROP for v in items.values()) else items
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _DROP if any(v is _DROP for v in items) else type(value)(items)
    return _DROP
