"""Test harness for driving the real SMG gateway (``smg`` 1.13, a Rust binary) in tests.

Nothing here is a test. It provides:

* :func:`make_model_dir`: a tiny, weight-less Hugging Face style model folder per
  family (``text``, ``llava``, ``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_5``,
  ``qwen3_omni``): ``config.json`` (the project's preset, so mmadmit's materializer
  agrees with SMG's preprocessor), ``tokenizer.json`` built at test time with the
  ``tokenizers`` library (byte-level BPE, no merges: every byte is one token, the
  family's special tokens keep their real ids), ``tokenizer_config.json`` with a
  chat template, and the preprocessor configs SMG reads. SMG picks its multimodal
  processor by matching the *model id* (the worker's ``served_model_name``; in
  engine mode the ``--model-path`` string) and the config's ``model_type``, so each
  folder is named like the family's public checkpoint (``Qwen2.5-VL-tiny`` ...);
  serve it under that basename (or its path, if no other family's name appears in
  it: SMG tries LLaVA before Qwen). Nothing is downloaded.
* media makers for OpenAI content parts: :func:`png_data_url`,
  :func:`mp4_data_url` (needs ``ffmpeg``; check :func:`have_ffmpeg`) and
  :func:`wav_data_url`, plus :func:`image_part`, :func:`video_part`,
  :func:`audio_part`.
* :class:`SmgGateway`: starts ``smg launch`` on an ephemeral loopback port in front
  of a gRPC TokenSpeed worker (``grpc://HOST:PORT``), of disaggregated gRPC workers
  (:func:`pd_workers`, :func:`epd_workers`) or, in engine mode, binding a
  ZMQ handshake address that engines connect to; waits until it is ready; offers
  small HTTP helpers (plain and streaming, with a mid-stream disconnect); stops it
  with SIGTERM then SIGKILL. SMG's output goes to a log file whose tail is quoted
  in every failure.

Start a gRPC worker *before* the gateway and have its ``HealthCheck`` answer OK
from the start: SMG retries a failed first probe only after 30 s.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import wave
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from conftest import free_ports

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESETS = REPO_ROOT / "service" / "mmadmit" / "presets"

FAMILIES: tuple[str, ...] = (
    "text",
    "llava",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5",
    "qwen3_omni",
)

# --------------------------------------------------------------------------- model folders

# Byte tokens occupy ids BYTE_BASE .. BYTE_BASE + 255 (LLaVA's <unk>, <s>, </s> are 0..2).
BYTE_BASE = 3

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_HALF = [0.5, 0.5, 0.5]

_QWEN2_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
_QWEN3_5_TOKENS: dict[str, int] = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": 248053,
    "<|vision_end|>": 248054,
    "<|vision_pad|>": 248055,
    "<|image_pad|>": 248056,
    "<|video_pad|>": 248057,
}
_OMNI_TOKENS: dict[str, int] = {
    **_QWEN2_TOKENS,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<|audio_pad|>": 151675,
}
_LLAMA_TOKENS: dict[str, int] = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eot_id|>": 128009,
}
_LLAVA_TOKENS: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 32000, "<pad>": 32001}

# Each family's media markup inside a user turn, per content-part kind.
_QWEN_PARTS = (
    "{%- if c.type == 'text' -%}{{ c.text }}"
    "{%- elif c.type in ('image', 'image_url') -%}<|vision_start|>IMAGE<|vision_end|>"
    "{%- elif c.type in ('video', 'video_url') -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif c.type in ('audio', 'audio_url', 'input_audio') -%}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{%- endif -%}"
)
_QWEN_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}{{ '\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- else -%}{%- for c in m.content -%}" + _QWEN_PARTS + "{%- endfor -%}{%- endif -%}"
    "<|im_end|>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)
_LLAMA_TEMPLATE = (
    "{{- bos_token -}}{%- for m in messages -%}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- else -%}{%- for c in m.content -%}{%- if c.type == 'text' -%}{{ c.text }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}<|eot_id|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}"
    "{%- endif -%}"
)
_LLAVA_TEMPLATE = (
    "{%- for m in messages -%}{{ (m.role | upper) ~ ': ' }}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type in ('image', 'image_url') -%}<image>{{ '\\n' }}"
    "{%- elif c.type == 'text' -%}{{ c.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}ASSISTANT:{%- endif -%}"
)


@dataclass(frozen=True)
class FamilySpec:
    """How one family's tiny model folder looks."""

    dir_name: str
    preset: str | None
    special_tokens: dict[str, int]
    chat_template: str
    bos: str | None
    eos: str
    pad: str | None
    preprocessor: dict[str, Any] | None = None
    video_preprocessor: dict[str, Any] | None = None
    config_extra: dict[str, Any] = field(default_factory=dict)


def _qwen_image_proc(patch: int, mean: list[float], std: list[float]) -> dict[str, Any]:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": mean,
        "image_std": std,
        "merge_size": 2,
        "patch_size": patch,
        "temporal_patch_size": 2,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    }


def _qwen3_video_proc(mean: list[float], std: list[float]) -> dict[str, Any]:
    return {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "do_sample_frames": True,
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "image_mean": mean,
        "image_std": std,
        "merge_size": 2,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    }


_WHISPER = {
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "sampling_rate": 16000,
    "hop_length": 160,
    "chunk_length": 300,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "dither": 0.0,
}


def _qwen3_vl_family(dir_name: str, preset: str, tokens: Any) -> FamilySpec:
    """Qwen3-VL and Qwen3.5: one processor (16-pixel patches, half mean/std), one template."""
    return FamilySpec(
        dir_name=dir_name,
        preset=preset,
        special_tokens=tokens,
        chat_template=_QWEN_TEMPLATE.replace("IMAGE", "<|image_pad|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        preprocessor={
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "processor_class": "Qwen3VLProcessor",
            **_qwen_image_proc(16, _HALF, _HALF),
            "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        },
        video_preprocessor=_qwen3_video_proc(_HALF, _HALF),
        config_extra={"max_position_embeddings": 262144, "torch_dtype": "bfloat16"},
    )


SPECS: dict[str, FamilySpec] = {
    "text": FamilySpec(
        dir_name="Llama-3-tiny",
        preset="llama.json",
        special_tokens=_LLAMA_TOKENS,
        chat_template=_LLAMA_TEMPLATE,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        config_extra={"max_position_embeddings": 8192, "torch_dtype": "bfloat16"},
    ),
    "llava": FamilySpec(
        dir_name="llava-1.5-tiny",
        preset=None,
        special_tokens=_LLAVA_TOKENS,
        chat_template=_LLAVA_TEMPLATE,
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        preprocessor={
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "crop_size": {"height": 336, "width": 336},
            "do_center_crop": True,
            "do_convert_rgb": True,
            "do_normalize": True,
            "do_rescale": True,
            "do_resize": True,
            "image_mean": _CLIP_MEAN,
            "image_std": _CLIP_STD,
            "resample": 3,
            "rescale_factor": 0.00392156862745098,
            "size": {"shortest_edge": 336},
        },
        config_extra={
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "image_token_index": 32000,
            "pad_token_id": 32001,
            "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default",
            "projector_hidden_act": "gelu",
            "vision_config": {
                "model_type": "clip_vision_model",
                "image_size": 336,
                "patch_size": 14,
                "hidden_size": 1024,
            },
            "text_config": {
                "model_type": "llama",
                "vocab_size": 32064,
                "max_position_embeddings": 4096,
            },
            "vocab_size": 32064,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float16",
        },
    ),
    "qwen2_5_vl": FamilySpec(
        dir_name="Qwen2.5-VL-tiny",
        preset="qwen2_5_vl.json",
        # SMG's Qwen2/2.5-VL spec expands a literal "<image>" token (which must be in the
        # vocabulary) into `vision_token_id` pads; the real checkpoint has no such token,
        # so it takes an unused id from the padded range.
        special_tokens={**_QWEN2_TOKENS, "<image>": 151665},
        chat_template=_QWEN_TEMPLATE.replace("IMAGE", "<image>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        preprocessor={
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            **_qwen_image_proc(14, _CLIP_MEAN, _CLIP_STD),
        },
        config_extra={"max_position_embeddings": 128000, "torch_dtype": "bfloat16"},
    ),
    "qwen3_vl": _qwen3_vl_family("Qwen3-VL-tiny", "qwen3_vl.json", _QWEN2_TOKENS),
    "qwen3_5": _qwen3_vl_family("Qwen3.5-tiny", "qwen3_5.json", _QWEN3_5_TOKENS),
    "qwen3_omni": FamilySpec(
        dir_name="Qwen3-Omni-tiny",
        preset="qwen3_omni_moe.json",
        special_tokens=_OMNI_TOKENS,
        chat_template=_QWEN_TEMPLATE.replace("IMAGE", "<|image_pad|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        preprocessor={
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3OmniMoeProcessor",
            **_qwen_image_proc(16, _HALF, _HALF),
            **_WHISPER,
        },
        video_preprocessor=None,
        config_extra={"torch_dtype": "bfloat16"},
    ),
}


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 characters ByteLevel maps bytes to."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, int] = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + n
            n += 1
    return [chr(table[b]) for b in range(256)]


def build_tokenizer(special_tokens: dict[str, int]) -> Any:
    """A byte-level BPE tokenizer without merges: one token per byte, ids ``BYTE_BASE + b``.

    The special tokens keep the given ids and are matched before byte splitting.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: BYTE_BASE + i for i, ch in enumerate(_byte_alphabet())}
    clash = set(vocab.values()) & set(special_tokens.values())
    if clash:
        raise ValueError(f"special token ids clash with byte ids: {sorted(clash)}")
    vocab.update(special_tokens)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    for t, i in special_tokens.items():
        got = tok.token_to_id(t)
        if got != i:
            raise AssertionError(f"{t}: id {got}, wanted {i}")
    return tok


def model_config(family: str) -> dict[str, Any]:
    """The ``config.json`` written for *family*: the project's preset plus extras."""
    spec = SPECS[family]
    cfg: dict[str, Any] = {}
    if spec.preset is not None:
        cfg = json.loads((PRESETS / spec.preset).read_text())
    cfg.update(spec.config_extra)
    return cfg


def make_model_dir(tmp_path: Path, family: str) -> Path:
    """Write a tiny model folder for *family* under *tmp_path* and return its path.

    The folder name follows the public checkpoint's (SMG chooses its processor by
    it), so pass the returned path to SMG as ``--model-path`` unchanged.
    """
    if family not in SPECS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    spec = SPECS[family]
    d = Path(tmp_path) / spec.dir_name
    d.mkdir(parents=True, exist_ok=True)
    cfg = model_config(family)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tokenizer(spec.special_tokens).save(str(d / "tokenizer.json"))
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "chat_template": spec.chat_template,
        "eos_token": spec.eos,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if spec.bos is not None:
        tcfg["bos_token"] = spec.bos
    if spec.pad is not None:
        tcfg["pad_token"] = spec.pad
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    special_map = {"eos_token": spec.eos}
    if spec.bos is not None:
        special_map["bos_token"] = spec.bos
    (d / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    gen: dict[str, Any] = {"eos_token_id": spec.special_tokens[spec.eos]}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if spec.preprocessor is not None:
        (d / "preprocessor_config.json").write_text(json.dumps(spec.preprocessor, indent=2))
    if spec.video_preprocessor is not None:
        (d / "video_preprocessor_config.json").write_text(
            json.dumps(spec.video_preprocessor, indent=2)
        )
    return d


def special_token_id(family: str, token: str) -> int:
    """The id of *token* in *family*'s tokenizer."""
    return SPECS[family].special_tokens[token]


def byte_token_ids(text: str) -> list[int]:
    """The ids the tiny tokenizers give *text* (no special tokens in it)."""
    return [BYTE_BASE + b for b in text.encode()]


# --------------------------------------------------------------------------- media


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def png_bytes(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    """An RGB PNG of a deterministic pattern (no third-party imaging library needed)."""
    rows = []
    for y in range(height):
        row = bytearray([0])
        for x in range(width):
            row += bytes(((x * 7 + seed) % 256, (y * 5 + seed * 3) % 256, ((x + y) * 3) % 256))
        rows.append(bytes(row))

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


def png_data_url(width: int = 64, height: int = 64, seed: int = 0) -> str:
    """``data:image/png;base64,...`` of :func:`png_bytes`."""
    return _data_url("image/png", png_bytes(width, height, seed))


def have_ffmpeg() -> bool:
    """Whether ``ffmpeg`` and ``ffprobe`` are on PATH (SMG decodes video with them)."""
    return shutil.which("ffmpeg") is not None and shutil.which("ffprobe") is not None


def mp4_bytes(width: int = 64, height: int = 64, seconds: float = 2.0, fps: int = 2) -> bytes:
    """A tiny H.264 MP4 test pattern made with ``ffmpeg`` (see :func:`have_ffmpeg`)."""
    if not have_ffmpeg():
        raise RuntimeError("ffmpeg not installed")
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "clip.mp4"
        cmd = [
            "ffmpeg", "-hide_banner", "-loglevel", "error", "-y",
            "-f", "lavfi", "-i", f"testsrc=size={width}x{height}:rate={fps}",
            "-t", str(seconds), "-pix_fmt", "yuv420p", "-c:v", "libx264",
            "-movflags", "+faststart", str(out),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        return out.read_bytes()


def mp4_data_url(width: int = 64, height: int = 64, seconds: float = 2.0, fps: int = 2) -> str:
    """``data:video/mp4;base64,...`` of :func:`mp4_bytes`."""
    return _data_url("video/mp4", mp4_bytes(width, height, seconds, fps))


def wav_bytes(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> bytes:
    """A mono 16-bit PCM WAV sine tone."""
    import math

    n = int(seconds * rate)
    frames = b"".join(
        struct.pack("<h", int(12000 * math.sin(2 * math.pi * freq * i / rate))) for i in range(n)
    )
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def wav_data_url(seconds: float = 1.0, rate: int = 16000, freq: float = 440.0) -> str:
    """``data:audio/wav;base64,...`` of :func:`wav_bytes`."""
    return _data_url("audio/wav", wav_bytes(seconds, rate, freq))


def text_part(text: str) -> dict[str, Any]:
    """An OpenAI ``text`` content part."""
    return {"type": "text", "text": text}


def image_part(url: str) -> dict[str, Any]:
    """An OpenAI ``image_url`` content part."""
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict[str, Any]:
    """A ``video_url`` content part (what SMG accepts for video)."""
    return {"type": "video_url", "video_url": {"url": url}}


def audio_part(wav: bytes) -> dict[str, Any]:
    """An OpenAI ``input_audio`` content part (base64 WAV)."""
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode("ascii"), "format": "wav"},
    }


def user_message(*parts: dict[str, Any] | str) -> dict[str, Any]:
    """A user message from content parts (strings become text parts)."""
    return {
        "role": "user",
        "content": [text_part(p) if isinstance(p, str) else p for p in parts],
    }


# --------------------------------------------------------------------------- the gateway

SMG_BINARY_ENV = "MMADMIT_SMG_BINARY"


def smg_binary() -> str | None:
    """Path of the ``smg`` launcher: ``$MMADMIT_SMG_BINARY``, next to this Python, or on PATH."""
    env = os.environ.get(SMG_BINARY_ENV)
    if env:
        return env
    beside = Path(sys.executable).parent / "smg"
    if beside.exists():
        return str(beside)
    return shutil.which("smg")


def have_smg() -> bool:
    """Whether the real SMG gateway can be launched here."""
    return smg_binary() is not None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def zmq_handshake_port(ipc_path: str) -> int:
    """The TCP port SMG binds its engine handshake on for worker URL ``ipc://<ipc_path>``.

    ``20000 + FNV-1a-64(path) % 10000`` (SMG 1.13 derives it; there is no flag for it).
    """
    h = 0xCBF29CE484222325
    for b in ipc_path.encode():
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return 20000 + h % 10000


def engine_ipc_base(directory: Path) -> tuple[str, str]:
    """An ``ipc://`` worker URL under *directory* whose derived handshake port is free.

    Returns ``(worker_url, handshake_address)``; the engine dials the handshake.
    SMG creates ``<base>-in.sock`` / ``<base>-out.sock`` beside it.
    """
    sock_dir = Path(directory).resolve() / "zmq"
    for n in range(1000):
        path = str(sock_dir / f"engine{n}.ipc")
        port = zmq_handshake_port(path)
        if _port_free(port):
            return f"ipc://{path}", f"tcp://127.0.0.1:{port}"
    raise RuntimeError("no ipc path with a free derived handshake port")


_ANSI = None
# Paths the harness polls; their access-log lines are left out of log tails.
_POLLED = ("path=/health ", "path=/workers ", "path=/v1/models ", "path=/v1/tokenizers ")


def _strip_ansi(text: str) -> str:
    global _ANSI
    if _ANSI is None:
        import re

        _ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
    return _ANSI.sub("", text)


@dataclass
class HttpResult:
    """One complete HTTP answer."""

    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def error_message(self) -> str:
        """SMG's ``error.message`` (or the raw body when it is not SMG's error shape)."""
        try:
            doc = self.json()
        except ValueError:
            return self.text
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return str(doc["error"].get("message", ""))
        return self.text


@dataclass
class StreamResult:
    """What a streamed (SSE) request produced before it ended or was cut off."""

    status: int
    headers: dict[str, str]
    events: list[Any] = field(default_factory=list)
    done: bool = False
    disconnected: bool = False
    body: bytes = b""

    def content(self) -> str:
        """The concatenated ``delta.content`` (chat) or ``text`` (completions) of every event."""
        out: list[str] = []
        for ev in self.events:
            if not isinstance(ev, dict):
                continue
            for ch in ev.get("choices") or []:
                delta = ch.get("delta") or {}
                piece = delta.get("content") if "delta" in ch else ch.get("text")
                if piece:
                    out.append(piece)
        return "".join(out)

    def finish_reasons(self) -> list[str]:
        return [
            ch["finish_reason"]
            for ev in self.events
            if isinstance(ev, dict)
            for ch in ev.get("choices") or []
            if ch.get("finish_reason")
        ]

    def errors(self) -> list[Any]:
        """In-stream error events (``{"error": ...}``)."""
        return [ev for ev in self.events if isinstance(ev, dict) and "error" in ev]


def pd_workers(prefill: str, decode: str, bootstrap_port: int | None = None) -> list[str]:
    """``smg launch`` arguments for PD disaggregation: one prefill and one decode gRPC
    worker (``grpc://HOST:PORT``); ``bootstrap_port`` is the prefill's KV bootstrap
    port (``none`` when not given)."""
    port = "none" if bootstrap_port is None else str(bootstrap_port)
    return ["--pd-disaggregation", "--prefill", prefill, port, "--decode", decode]


def epd_workers(
    encode: str,
    prefill: str,
    decode: str,
    *,
    encode_bootstrap_port: int | None = None,
    prefill_bootstrap_port: int | None = None,
) -> list[str]:
    """``smg launch`` arguments for EPD disaggregation: one encode, one prefill and one
    decode gRPC worker; each bootstrap port ``none`` when not given."""

    def port(p: int | None) -> str:
        return "none" if p is None else str(p)

    return [
        "--epd-disaggregation",
        "--encode", encode, port(encode_bootstrap_port),
        "--prefill", prefill, port(prefill_bootstrap_port),
        "--decode", decode,
    ]  # fmt: skip


class SmgGateway:
    """The real SMG gateway as a child process on loopback, for one model.

    Give exactly one of ``worker_urls`` (gRPC TokenSpeed workers,
    ``grpc://127.0.0.1:PORT``), ``disaggregated`` (the worker arguments of a PD or EPD
    launch: :func:`pd_workers`, :func:`epd_workers`; :meth:`wait_worker_ready` then
    waits for every worker of every role) or ``engine_mode=True`` (SMG binds a ZMQ
    handshake that an engine dials; the
    address is :attr:`engine_handshake` once constructed). Use as a context manager
    or call :meth:`start` / :meth:`stop`. ``ready_timeout`` bounds the wait for a
    ready worker; in engine mode the engine must have completed its handshake by
    then unless ``wait_for_worker=False`` (then only the handshake port is awaited
    and :meth:`wait_worker_ready` can be called after the engine is started).
    """

    def __init__(
        self,
        model_dir: Path | str,
        *,
        worker_urls: Sequence[str] = (),
        disaggregated: Sequence[str] = (),
        engine_mode: bool = False,
        work_dir: Path | str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
        wait_for_worker: bool = True,
        health_check_interval: int | None = None,
    ) -> None:
        if bool(worker_urls) + bool(disaggregated) + engine_mode != 1:
            raise ValueError(
                "give worker_urls (gRPC), disaggregated or engine_mode=True, exactly one"
            )
        self.model_dir = Path(model_dir)
        self.worker_urls = list(worker_urls)
        self.disaggregated = list(disaggregated)
        self.engine_mode = engine_mode
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None
        if work_dir is None:
            self._own_dir = tempfile.TemporaryDirectory(prefix="smg-")
            work_dir = self._own_dir.name
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.work_dir / "smg.log"
        self.extra_args = list(extra_args)
        self.env = env
        self.ready_timeout = ready_timeout
        self.wait_for_worker = wait_for_worker
        # Engine mode: SMG binds its ZMQ sockets when its health probe first reaches the
        # ipc:// worker; a worker registered before the manager starts waits for the
        # first periodic probe (60 s by default), so probe every second.
        if health_check_interval is None and engine_mode:
            health_check_interval = 1
        self.health_check_interval = health_check_interval
        self.engine_worker_url: str | None = None
        self.engine_handshake: str | None = None
        if engine_mode:
            self.engine_worker_url, self.engine_handshake = engine_ipc_base(self.work_dir)
        self.port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.model_id: str | None = None
        self._log_file: Any = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        binary = smg_binary()
        if binary is None:
            raise RuntimeError("the smg gateway is not installed (pip install smg==1.13.0)")
        urls = [self.engine_worker_url] if self.engine_mode else self.worker_urls
        workers = self.disaggregated or ["--worker-urls", *[u for u in urls if u]]
        cmd = [
            binary, "launch", "--backend", "tokenspeed", *workers,
            "--model-path", str(self.model_dir),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
        ]  # fmt: skip
        if self.health_check_interval is not None:
            cmd += ["--health-check-interval-secs", str(self.health_check_interval)]
        return cmd + self.extra_args

    def start(self) -> SmgGateway:
        """Launch SMG and wait until it is ready (see the class docstring)."""
        if self.proc is not None:
            raise RuntimeError("already started")
        self.port, self.metrics_port = free_ports(2)
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NO_COLOR": "1"})
        if self.env:
            env.update(self.env)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _fail(self, why: str) -> RuntimeError:
        return RuntimeError(f"SMG {why}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise self._fail(f"exited with status {self.proc.returncode}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        # 1. HTTP up (/health answers 200 from the start, workers or not)
        while True:
            self._check_alive()
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.get("/health", timeout=1.0).status == 200:
                    break
            if time.monotonic() > deadline:
                raise self._fail(f"did not answer HTTP within {self.ready_timeout:.0f} s")
            time.sleep(0.05)
        # 2. engine mode: the handshake port is bound
        if self.engine_mode:
            assert self.engine_handshake is not None
            hs_port = int(self.engine_handshake.rsplit(":", 1)[1])
            while not _port_open(hs_port):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise self._fail(f"did not bind its handshake {self.engine_handshake}")
                time.sleep(0.05)
            if not self.wait_for_worker:
                return
        self.wait_worker_ready(max(0.0, deadline - time.monotonic()))

    def wait_worker_ready(self, timeout: float = 30.0) -> None:
        """Wait until every worker is ``ready`` and healthy and the model is listed."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            self._check_alive()
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                workers = self.get("/workers", timeout=1.0).json().get("workers", [])
                last = workers
                if workers and all(
                    w.get("is_healthy") and w.get("status") == "ready" for w in workers
                ):
                    models = self.models()
                    # The model's tokenizer is registered by a job of its own, which may
                    # finish after the worker is ready; until then chat answers 503
                    # ("Tokenizer not yet registered for a served model").
                    if models and set(models) <= self.tokenizer_names():
                        self.model_id = models[0]
                        return
            if time.monotonic() > deadline:
                raise self._fail(f"has no ready worker after {timeout:.0f} s; /workers: {last}")
            time.sleep(0.1)

    def wait_worker_status(self, status: str, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until the (first) worker's ``status`` is *status* (``ready``, ``not_ready``,
        ``pending`` ...); returns its ``/workers`` record."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            self._check_alive()
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError):
                workers = self.workers()
                last = workers
                if workers and workers[0].get("status") == status:
                    return workers[0]
            if time.monotonic() > deadline:
                raise self._fail(f"worker not {status!r} after {timeout:.0f} s; /workers: {last}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0, *, graceful: bool = True) -> int | None:
        """SIGTERM, then SIGKILL after *timeout* seconds; returns the exit status.

        An idle SMG 1.13 still takes about 5 s to exit on SIGTERM (it keeps its
        listener open for a fixed load-balancer settle window); ``graceful=False``
        sends SIGKILL at once.
        """
        rc: int | None = None
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.kill()
                    self.proc.wait(timeout=10)
            rc = self.proc.returncode
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return rc

    def close(self) -> None:
        """:meth:`stop` and remove the private work directory (if one was made)."""
        self.stop()
        if self._own_dir is not None:
            self._own_dir.cleanup()
            self._own_dir = None

    def __enter__(self) -> SmgGateway:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def log_text(self) -> str:
        """SMG's whole log so far, ANSI colours removed."""
        try:
            return _strip_ansi(self.log_path.read_bytes().decode("utf-8", "replace"))
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The last *lines* log lines, without the access lines of the harness's own polling."""
        kept = [
            line
            for line in self.log_text().splitlines()
            if not ("http_request{" in line and any(p in line for p in _POLLED))
        ]
        return "\n".join(kept[-lines:])

    # ------------------------------------------------------------------ HTTP

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> HttpResult:
        """One HTTP request (``body`` is sent as JSON unless it is bytes)."""
        conn = self._conn(timeout)
        try:
            data: bytes | None
            hdrs = dict(headers or {})
            if body is None:
                data = None
            elif isinstance(body, bytes):
                data = body
            else:
                data = json.dumps(body).encode()
                hdrs.setdefault("content-type", "application/json")
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return HttpResult(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def get(self, path: str, *, timeout: float = 10.0) -> HttpResult:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any, *, timeout: float = 60.0) -> HttpResult:
        return self.request("POST", path, body, timeout=timeout)

    def models(self) -> list[str]:
        """Model ids ``GET /v1/models`` lists."""
        doc = self.get("/v1/models").json()
        return [m["id"] for m in doc.get("data", [])]

    def tokenizer_names(self) -> set[str]:
        """Names of the tokenizers SMG has registered (``GET /v1/tokenizers``)."""
        doc = self.get("/v1/tokenizers").json()
        return {t["name"] for t in doc.get("tokenizers", [])}

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``'s worker records."""
        return list(self.get("/workers").json().get("workers", []))

    def _body(self, extra: dict[str, Any], max_tokens: int | None, **base: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model_id or "default", **base}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.update(extra)
        return body

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = 16,
        timeout: float = 60.0,
        **extra: Any,
    ) -> HttpResult:
        """``POST /v1/chat/completions`` without streaming."""
        return self.post(
            "/v1/chat/completions", self._body(extra, max_tokens, messages=messages),
            timeout=timeout,
        )  # fmt: skip

    def completion(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int | None = 16,
        timeout: float = 60.0,
        **extra: Any,
    ) -> HttpResult:
        """``POST /v1/completions`` without streaming."""
        return self.post(
            "/v1/completions", self._body(extra, max_tokens, prompt=prompt), timeout=timeout
        )

    def stream(
        self,
        path: str,
        body: dict[str, Any],
        *,
        disconnect_after: int | None = None,
        timeout: float = 60.0,
    ) -> StreamResult:
        """POST *body* with ``stream: true`` and read the SSE events.

        ``disconnect_after=N`` closes the connection abruptly once N data events
        have arrived (a client going away mid-stream); ``0`` closes it as soon as
        the response head has arrived.
        """
        body = dict(body, stream=True)
        conn = self._conn(timeout)
        try:
            conn.request(
                "POST", path, body=json.dumps(body).encode(),
                headers={"content-type": "application/json", "accept": "text/event-stream"},
            )  # fmt: skip
            resp = conn.getresponse()
            result = StreamResult(resp.status, dict(resp.getheaders()))
            if resp.status != 200:
                result.body = resp.read()
                return result
            if disconnect_after == 0:
                result.disconnected = True
                _abort_connection(conn)
                return result
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    result.done = True
                    break
                try:
                    result.events.append(json.loads(payload))
                except ValueError:
                    result.events.append(payload.decode("utf-8", "replace"))
                if disconnect_after is not None and len(result.events) >= disconnect_after:
                    result.disconnected = True
                    _abort_connection(conn)
                    return result
            return result
        finally:
            conn.close()

    def chat_stream(
        self,
        messages: list[dict[str, Any]],
        *,
        max_tokens: int | None = 16,
        disconnect_after: int | None = None,
        timeout: float = 60.0,
        **extra: Any,
    ) -> StreamResult:
        """Streamed ``POST /v1/chat/completions`` (see :meth:`stream`)."""
        return self.stream(
            "/v1/chat/completions", self._body(extra, max_tokens, messages=messages),
            disconnect_after=disconnect_after, timeout=timeout,
        )  # fmt: skip

    def completion_stream(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int | None = 16,
        disconnect_after: int | None = None,
        timeout: float = 60.0,
        **extra: Any,
    ) -> StreamResult:
        """Streamed ``POST /v1/completions`` (see :meth:`stream`)."""
        return self.stream(
            "/v1/completions", self._body(extra, max_tokens, prompt=prompt),
            disconnect_after=disconnect_after, timeout=timeout,
        )  # fmt: skip


def _abort_connection(conn: http.client.HTTPConnection) -> None:
    """Close the socket with RST (SO_LINGER 0) so the server sees the client vanish at once."""
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            sock.close()
    conn.sock = None
