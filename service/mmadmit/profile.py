"""The model profile: what the materializer needs to know about the served model.

Built once per process from a Hugging Face ``config.json`` (a file, or a
directory holding one; never a download) or from a built-in preset name, plus
the deployment role and the ``language_model_only`` flag. Lookups follow
docs/spec/MATERIALIZE.md "The model profile": placeholder ids on the config and then its
nested configs, the family from ``model_type`` then ``architectures``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError
from .model import Modality

Role = Literal["aggregated", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("aggregated", "prefill", "decode")

PRESETS: tuple[str, ...] = (
    "llama",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_omni_moe",
)


class Family(enum.Enum):
    """Architecture families (docs/spec/MATERIALIZE.md table). Values are the names reported
    by ``GetModelInfo``."""

    TEXT_ONLY = "text_only"
    QWEN2_VL = "qwen2_vl"
    QWEN2_5_VL = "qwen2_5_vl"
    QWEN3_VL = "qwen3_vl"
    QWEN3_5 = "qwen3_5"
    QWEN3_OMNI = "qwen3_omni"
    OTHER_MULTIMODAL = "other_multimodal"

    @property
    def uses_mrope(self) -> bool:
        return self not in (Family.TEXT_ONLY, Family.OTHER_MULTIMODAL)

    @property
    def video_run_per_frame(self) -> bool:
        """Qwen3-VL / Qwen3.5: one placeholder run per temporal frame of a video row."""
        return self in (Family.QWEN3_VL, Family.QWEN3_5)


_MODEL_TYPES: dict[str, Family] = {
    "qwen2_vl": Family.QWEN2_VL,
    "qwen2_5_vl": Family.QWEN2_5_VL,
    "qwen3_vl": Family.QWEN3_VL,
    "qwen3_vl_moe": Family.QWEN3_VL,
    "qwen3_5": Family.QWEN3_5,
    "qwen3_5_moe": Family.QWEN3_5,
    "qwen3_omni_moe": Family.QWEN3_OMNI,
}

_ARCHITECTURES: dict[str, Family] = {
    "Qwen2VLForConditionalGeneration": Family.QWEN2_VL,
    "Qwen2_5_VLForConditionalGeneration": Family.QWEN2_5_VL,
    "Qwen3VLForConditionalGeneration": Family.QWEN3_VL,
    "Qwen3VLMoeForConditionalGeneration": Family.QWEN3_VL,
    "Qwen3_5ForConditionalGeneration": Family.QWEN3_5,
    "Qwen3_5MoeForConditionalGeneration": Family.QWEN3_5,
    "Qwen3OmniMoeForConditionalGeneration": Family.QWEN3_OMNI,
    "Qwen3OmniMoeThinkerForConditionalGeneration": Family.QWEN3_OMNI,
}

_IMAGE_KEYS = (
    "image_token_id",
    "image_token_index",
    "image_placeholder_token_id",
    "media_placeholder_token_id",
)
_VIDEO_KEYS = (
    "video_token_id",
    "video_token_index",
    "video_placeholder_token_id",
    "media_placeholder_token_id",
)
_AUDIO_KEYS = ("audio_token_id", "audio_token_index", "audio_placeholder_token_id")
_NESTED = ("thinker_config", "text_config")
_VISION_KEYS = ("vision_config", "visual", "vision_tower_config")
_AUDIO_CONFIG_KEYS = ("audio_config", "audio_tower_config")


@dataclass(frozen=True)
class ModelProfile:
    """Everything the materializer knows about the model; immutable, built once."""

    source: str
    family: Family
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    max_model_len: int | None
    image_token_id: int | None
    video_token_id: int | None
    audio_token_id: int | None
    vision_start_token_id: int | None
    spatial_merge_size: int
    tokens_per_second: float | None  # Qwen2.5-VL video time scale
    position_id_per_seconds: float | None  # Qwen3-Omni
    seconds_per_chunk: float | None  # Qwen3-Omni default seconds per video grid row
    has_vision: bool
    has_audio: bool
    role: Role = "aggregated"
    language_model_only: bool = False

    @property
    def multimodal(self) -> bool:
        return self.has_vision or self.has_audio

    @property
    def multimodal_active(self) -> bool:
        return self.multimodal and not self.language_model_only

    @property
    def uses_mrope(self) -> bool:
        return self.family.uses_mrope

    def placeholder_id(self, modality: Modality) -> int | None:
        return {
            Modality.IMAGE: self.image_token_id,
            Modality.VIDEO: self.video_token_id,
            Modality.AUDIO: self.audio_token_id,
        }[modality]

    def supports(self, modality: Modality) -> bool:
        """Whether the profile can take items of this modality."""
        if modality is Modality.AUDIO:
            return self.has_audio and self.audio_token_id is not None
        return self.has_vision and self.placeholder_id(modality) is not None


def _scopes(config: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The config, then its nested configs, in lookup order (thinker's text too)."""
    yield config
    for key in _NESTED:
        sub = config.get(key)
        if isinstance(sub, Mapping):
            yield sub
            inner = sub.get("text_config")
            if isinstance(inner, Mapping):
                yield inner


def _lookup(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for scope in _scopes(config):
        for key in keys:
            value = scope.get(key)
            if value is not None:
                return value
    return None


def _int_or_none(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"model config: {what} must be a non-negative integer, got {value!r}")
    return value


def _number_or_none(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"model config: {what} must be a positive number, got {value!r}")
    return float(value)


def _family(model_type: str, architectures: tuple[str, ...], multimodal: bool) -> Family:
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    return Family.OTHER_MULTIMODAL if multimodal else Family.TEXT_ONLY


def profile_from_config(
    config: Mapping[str, Any],
    *,
    source: str = "<config>",
    role: Role = "aggregated",
    language_model_only: bool = False,
    max_model_len: int | None = None,
) -> ModelProfile:
    """Build a profile from a parsed ``config.json``; :class:`ConfigError` names what is wrong."""
    if role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    model_type = config.get("model_type") or ""
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: model_type must be a string")
    archs_raw = config.get("architectures") or []
    if not isinstance(archs_raw, list) or not all(isinstance(a, str) for a in archs_raw):
        raise ConfigError(f"{source}: architectures must be a list of strings")
    architectures = tuple(archs_raw)

    vision_cfg: Mapping[str, Any] | None = None
    audio_cfg: Mapping[str, Any] | None = None
    for scope in _scopes(config):
        for key in _VISION_KEYS:
            if vision_cfg is None and isinstance(scope.get(key), Mapping):
                vision_cfg = scope[key]
        for key in _AUDIO_CONFIG_KEYS:
            if audio_cfg is None and isinstance(scope.get(key), Mapping):
                audio_cfg = scope[key]
    has_vision = vision_cfg is not None
    has_audio = audio_cfg is not None
    family = _family(model_type, architectures, has_vision or has_audio)
    if family is not Family.TEXT_ONLY and family is not Family.OTHER_MULTIMODAL and not has_vision:
        raise ConfigError(f"{source}: a {family.value} config needs a vision_config")

    vocab = config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), Mapping):
        vocab = config["text_config"].get("vocab_size")
    thinker = config.get("thinker_config")
    if (
        vocab is None
        and isinstance(thinker, Mapping)
        and isinstance(thinker.get("text_config"), Mapping)
    ):
        vocab = thinker["text_config"].get("vocab_size")
    if vocab is None:
        raise ConfigError(
            f"{source}: missing vocab_size (looked at the top level, text_config and "
            "thinker_config.text_config)"
        )
    vocab_size = _int_or_none(vocab, "vocab_size")
    assert vocab_size is not None
    if vocab_size == 0:
        raise ConfigError(f"{source}: vocab_size must be positive")

    image_id = _int_or_none(_lookup(config, _IMAGE_KEYS), "image token id") if has_vision else None
    video_id = _int_or_none(_lookup(config, _VIDEO_KEYS), "video token id") if has_vision else None
    audio_id = _int_or_none(_lookup(config, _AUDIO_KEYS), "audio token id") if has_audio else None
    vision_start = _int_or_none(
        _lookup(config, ("vision_start_token_id",)), "vision_start_token_id"
    )

    merge = 1
    tokens_per_second = None
    if vision_cfg is not None:
        merge_raw = vision_cfg.get("spatial_merge_size", 2 if family.uses_mrope else 1)
        merge_val = _int_or_none(merge_raw, "vision_config.spatial_merge_size")
        if not merge_val:
            raise ConfigError(f"{source}: vision_config.spatial_merge_size must be positive")
        merge = merge_val
        tokens_per_second = _number_or_none(
            vision_cfg.get("tokens_per_second"), "vision_config.tokens_per_second"
        )

    pips = spc = None
    if family is Family.QWEN2_5_VL and tokens_per_second is None:
        raise ConfigError(f"{source}: a qwen2_5_vl config needs vision_config.tokens_per_second")
    if family is Family.QWEN3_OMNI:
        scope = thinker if isinstance(thinker, Mapping) else config
        pips = _number_or_none(scope.get("position_id_per_seconds"), "position_id_per_seconds")
        spc = _number_or_none(scope.get("seconds_per_chunk", 2.0), "seconds_per_chunk")
        if pips is None:
            raise ConfigError(
                f"{source}: a Qwen3-Omni config needs thinker_config.position_id_per_seconds"
            )

    if family.uses_mrope:
        missing = [
            name
            for name, value in (
                ("image_token_id", image_id),
                ("video_token_id", video_id),
                ("vision_start_token_id", vision_start),
            )
            if value is None
        ]
        if family is Family.QWEN3_OMNI and audio_id is None:
            missing.append("audio_token_id")
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)} for family {family.value}")

    # Only the operator's --max-model-len limits prompts (not the config's own value).
    if max_model_len is not None and max_model_len <= 1:
        raise ConfigError(f"max_model_len must be at least 2, got {max_model_len}")

    return ModelProfile(
        source=source,
        family=family,
        model_type=model_type,
        architectures=architectures,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        image_token_id=image_id,
        video_token_id=video_id,
        audio_token_id=audio_id,
        vision_start_token_id=vision_start,
        spatial_merge_size=merge,
        tokens_per_second=tokens_per_second,
        position_id_per_seconds=pips,
        seconds_per_chunk=spc,
        has_vision=has_vision,
        has_audio=has_audio,
        role=role,
        language_model_only=language_model_only,
    )


def read_config(model: str) -> tuple[dict[str, Any], str]:
    """Read a preset or a local config file/directory; return (config, source)."""
    if model in PRESETS:
        text = resources.files(__package__).joinpath("presets", f"{model}.json").read_text()
        return json.loads(text), f"preset:{model}"
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"--model {model!r} is neither a built-in profile ({', '.join(PRESETS)}) nor a "
            "config.json file or a directory holding one (models are never downloaded)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read a JSON config ({exc})") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: a config.json must hold a JSON object")
    return config, str(path)


def load_profile(
    model: str,
    *,
    role: Role = "aggregated",
    language_model_only: bool = False,
    max_model_len: int | None = None,
) -> ModelProfile:
    """Build the profile for ``--model`` (a preset name or a local config path)."""
    config, source = read_config(model)
    return profile_from_config(
        config,
        source=source,
        role=role,
        language_model_only=language_model_only,
        max_model_len=max_model_len,
    )
