"""Where an engine's routers sit, read from the ``config.json`` the engine loaded (no torch).

vLLM and SGLang return expert ids per token and MoE layer, without saying which decoder
layer a row of the layer axis is, nor how many experts there are. The model's own config
says: which layers are MoE (DeepSeek's ``first_k_dense_replace`` and ``moe_layer_freq``,
Qwen's ``decoder_sparse_step`` and ``mlp_only_layers``, transformers 5's ``mlp_layer_types``),
how many routed experts, and the top-k. Routers are named as the transformers modules are
(``model.layers.3.mlp.gate``), so rules written against the embedded model apply as they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mla_watch.common.describe import describe_value
from mla_watch.common.setting_errors import SettingsError
from mla_watch.routing.routers import RouterInfo

__all__ = ["EngineGeometry", "GeometryError", "load_geometry", "parse_geometry"]

# Keys that name the same idea in different families, in the order they are looked up.
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "experts_per_token", "moe_topk")
# The router module of a MoE layer, by model_type (transformers 5 module paths); others use DEFAULT.
ROUTER_PATHS = {"gpt_oss": "model.layers.{layer}.mlp.router"}
DEFAULT_ROUTER_PATH = "model.layers.{layer}.mlp.gate"
MAX_CONFIG_BYTES = 4 << 20
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16  # vLLM returns int16 expert ids
MAX_CONTEXT = 1 << 24  # a context length past this is not believed: positions are then not counted


class GeometryError(SettingsError):
    """The model config cannot describe the engine's routers."""

    what = "model config"


@dataclass(frozen=True)
class EngineGeometry:
    """The MoE layers of a model, in the order the engines' layer axis lists them."""

    model_type: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # decoder-layer index of each MoE layer
    num_experts: int
    top_k: int
    router_path: str = DEFAULT_ROUTER_PATH
    context_length: int | None = None  # max_position_embeddings, where the config says it

    @property
    def router_names(self) -> list[str]:
        return [self.router_path.format(layer=layer) for layer in self.moe_layers]

    def routers(self) -> list[RouterInfo]:
        """One expert router per MoE layer, as the embedded probe would describe it."""
        return [
            RouterInfo(name, layer, "expert", self.num_experts, self.top_k)
            for name, layer in zip(self.router_names, self.moe_layers, strict=True)
        ]

    def describe(self) -> str:
        first = self.moe_layers[0] if self.moe_layers else "-"
        return (
            f"{self.model_type}: {len(self.moe_layers)} MoE layers of {self.num_hidden_layers} (first {first}), "
            f"{self.num_experts} experts, top-{self.top_k}"
        )


def load_geometry(path: str | Path) -> EngineGeometry:
    """The geometry in ``path``: a ``config.json``, or the model directory holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise GeometryError([f"{file}: larger than {MAX_CONFIG_BYTES} bytes; expected a model's config.json"])
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise GeometryError(
            [
                f"{file}: cannot be read ({error.strerror or type(error).__name__}); expected the "
                "config.json the engine loaded, or its model directory"
            ]
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        where = f" (line {error.lineno})" if isinstance(error, json.JSONDecodeError) else ""
        raise GeometryError([f"{file}: not JSON{where}; expected the config.json the engine loaded"]) from None
    return parse_geometry(data, str(file))


def parse_geometry(data: Any, where: str = "config.json") -> EngineGeometry:
    """The geometry of a parsed ``config.json`` (a multimodal one's ``text_config`` when it has one)."""
    if not isinstance(data, dict):
        raise GeometryError([f"{where}: expected a JSON object"])
    model_type = name if isinstance(name := data.get("model_type"), str) else "unknown"
    if "num_hidden_layers" not in data and isinstance(data.get("text_config"), dict):
        data, where = data["text_config"], f"{where}: text_config"
        model_type = name if isinstance(name := data.get("model_type"), str) else model_type
    layers = _integer(data, "num_hidden_layers", where, 1, MAX_LAYERS)
    experts = _first_integer(data, EXPERT_KEYS, where, 1, MAX_EXPERTS)
    top_k = _first_integer(data, TOP_K_KEYS, where, 1, experts)
    moe_layers = _moe_layers(data, layers, where)
    if not moe_layers:
        raise GeometryError([f"{where}: no layer of the {layers} is a MoE layer; expected a mixture-of-experts model"])
    context = data.get("max_position_embeddings")
    context_length = context if type(context) is int and 1 <= context <= MAX_CONTEXT else None
    return EngineGeometry(
        model_type,
        layers,
        moe_layers,
        experts,
        top_k,
        ROUTER_PATHS.get(model_type, DEFAULT_ROUTER_PATH),
        context_length,
    )


def _moe_layers(data: dict[str, Any], layers: int, where: str) -> tuple[int, ...]:
    types = data.get("mlp_layer_types")
    if types is not None:  # transformers 5 spells the dense-first layers out
        if not isinstance(types, list) or len(types) != layers or not set(types) <= {"dense", "sparse"}:
            raise GeometryError(
                [
                    f"{where}: key 'mlp_layer_types' = {describe_value(types)}: expected a list of "
                    f"{layers} entries, each 'dense' or 'sparse'"
                ]
            )
        return tuple(i for i, kind in enumerate(types) if kind == "sparse")
    if "first_k_dense_replace" in data:  # DeepSeek-V2/V3, GLM-4.5 and their kin
        first = _integer(data, "first_k_dense_replace", where, 0, layers)
        every = _integer(data, "moe_layer_freq", where, 1, layers) if "moe_layer_freq" in data else 1
        return tuple(i for i in range(first, layers) if i % every == 0)
    if "decoder_sparse_step" in data or "mlp_only_layers" in data:  # Qwen2-MoE, Qwen3-MoE
        step = _integer(data, "decoder_sparse_step", where, 1, layers) if "decoder_sparse_step" in data else 1
        dense = data.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(type(i) is int and 0 <= i < layers for i in dense):
            raise GeometryError(
                [
                    f"{where}: key 'mlp_only_layers' = {describe_value(dense)}: expected a list of "
                    f"layer indices in [0, {layers - 1}]"
                ]
            )
        return tuple(i for i in range(layers) if i not in set(dense) and (i + 1) % step == 0)
    return tuple(range(layers))  # Mixtral, OLMoE, gpt-oss: every layer routes


def _integer(data: dict[str, Any], key: str, where: str, low: int, high: int) -> int:
    value = data.get(key)
    if type(value) is not int or not low <= value <= high:
        raise GeometryError([f"{where}: key {key!r} = {describe_value(value)}: expected an integer in [{low}, {high}]"])
    return value


def _first_integer(data: dict[str, Any], keys: tuple[str, ...], where: str, low: int, high: int) -> int:
    for key in keys:
        if data.get(key) is not None:
            return _integer(data, key, where, low, high)
    raise GeometryError(
        [
            f"{where}: none of the keys {', '.join(keys)} is set: expected the number of "
            f"{'routed experts' if keys is EXPERT_KEYS else 'experts chosen per token'}"
        ]
    )
