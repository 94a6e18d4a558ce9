"""Generated protobuf/gRPC code: present, importable, fresh, and on contract.

The stubs in ``mmadmit_client.proto`` (one copy, for client and service) are
build outputs (``setup.py`` and ``clients/setup.py`` run ``scripts/gen_protos.py``
on ``pip install .`` and ``pip install -e .``); nothing generated is committed.
These tests fail when they are missing, or stale with respect to ``protos/``
(edit a ``.proto``, forget to reinstall), and pin the field numbers docs/spec/GRPC.md
fixes (shared with SMG's ``GenerateRequest``).

Run with: python -m pytest tests/test_proto_codegen.py -q
"""

from __future__ import annotations

import ast
import importlib
import pickle
import re
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO_ROOT, module_from_file

PROTO_ROOT = REPO_ROOT / "protos"
GEN_SCRIPT = REPO_ROOT / "scripts" / "gen_protos.py"
REINSTALL = "regenerate: pip install -e . (or python scripts/gen_protos.py)"


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is missing ({exc}); {REINSTALL}", pytrace=False)


def _source(module: ModuleType) -> Path:
    assert module.__file__ is not None
    return Path(module.__file__)


@pytest.fixture(scope="module")
def pb2() -> ModuleType:
    return _import("mmadmit_client.proto.admission_pb2")


@pytest.fixture(scope="module")
def pb2_grpc() -> ModuleType:
    return _import("mmadmit_client.proto.admission_pb2_grpc")


@pytest.fixture(scope="module")
def gen_protos() -> ModuleType:
    return module_from_file("_gen_protos_under_test", GEN_SCRIPT)


# --------------------------------------------------------------------------
# Round trips


def _tensor(pb2: ModuleType, shape: list[int], dtype: str, data: bytes) -> object:
    return pb2.TensorData(shape=shape, dtype=dtype, inline=data)


def test_admit_request_round_trip(pb2: ModuleType) -> None:
    req = pb2.AdmitRequest(
        request_id="r-1",
        tokenized=pb2.TokenizedInput(input_ids=[1, 2, 151655, 151655, 3], original_text="hi"),
        mm_inputs=pb2.MultimodalInputs(
            items=[
                pb2.MultimodalItem(
                    modality=pb2.IMAGE,
                    content_hash=(0x0102030405060708).to_bytes(8, "little"),
                    encoder_input=_tensor(pb2, [4, 1176], "bfloat16", b"\x00" * 8),
                    model_specific_tensors={
                        "image_grid_thw": _tensor(pb2, [1, 3], "int64", b"\x01" * 24)
                    },
                    placeholders=[pb2.PlaceholderRange(offset=2, length=2)],
                    placeholder_token_id=151655,
                    pad_value=0,  # 0 is a value: presence is tracked
                ),
                pb2.MultimodalItem(
                    modality=pb2.VIDEO,
                    encoder_input=pb2.TensorData(
                        shape=[2],
                        dtype="float32",
                        shm=pb2.ShmHandle(name="/seg", offset=64, nbytes=8, owner_id="gw-0"),
                    ),
                ),
            ]
        ),
        input_ids_unpadded=[1, 2, 7, 7, 3],
        mrope=pb2.MropeInputs(positions=_tensor(pb2, [3, 5], "int64", b"\x00" * 120), delta=-3),
        echo_features=True,
        timeout_ms=2500,
    )
    back = pb2.AdmitRequest.FromString(req.SerializeToString())
    assert back == req
    item0, item1 = back.mm_inputs.items
    assert item0.HasField("pad_value") and item0.pad_value == 0
    assert item0.HasField("placeholder_token_id")
    assert not item1.HasField("pad_value") and not item1.HasField("placeholder_token_id")
    assert item0.encoder_input.WhichOneof("payload") == "inline"
    assert item1.encoder_input.WhichOneof("payload") == "shm"
    assert back.mrope.HasField("delta") and back.mrope.delta == -3
    assert int.from_bytes(item0.content_hash[:8], "little") == 0x0102030405060708


def test_admit_response_round_trip(pb2: ModuleType) -> None:
    ok = pb2.AdmitResponse(
        request_id="r-1",
        materialized=pb2.MaterializedRequest(
            input_ids=[1, 2, 99, 99, 3],
            input_ids_unpadded=[1, 2, 7, 7, 3],
            items=[
                pb2.MaterializedItem(
                    modality=pb2.AUDIO,
                    hash=2**64 - 1,
                    pad_value=99,
                    placeholders=[pb2.PlaceholderRange(offset=2, length=2)],
                )
            ],
            mrope_positions=_tensor(pb2, [3, 5], "int64", b"\x00" * 120),
            mrope_position_delta=0,
            passthrough=False,
        ),
    )
    back = pb2.AdmitResponse.FromString(ok.SerializeToString())
    assert back == ok
    assert back.WhichOneof("outcome") == "materialized"
    assert back.materialized.items[0].hash == 2**64 - 1
    assert back.materialized.HasField("mrope_position_delta")

    aborted = pb2.AdmitResponse(
        request_id="r-2", abort=pb2.AbortStatus(code=pb2.TOO_LARGE, message="too many tokens")
    )
    back = pb2.AdmitResponse.FromString(aborted.SerializeToString())
    assert back == aborted and back.WhichOneof("outcome") == "abort"
    assert pb2.AbortCode.Name(back.abort.code) == "TOO_LARGE"


def test_generate_request_fields_still_parse(pb2: ModuleType) -> None:
    # GenerateRequest fields 3..8, 11 (sampling, logprobs, ...) are kept as
    # unknown fields: a TokenSpeed frontend's bytes parse unchanged.
    base = pb2.AdmitRequest(request_id="r", tokenized=pb2.TokenizedInput(input_ids=[5, 6]))
    extra = bytes([3 << 3 | 2, 2, 0x0D, 0x00]) + bytes([8 << 3 | 0, 1])  # sampling_params, stream
    back = pb2.AdmitRequest.FromString(base.SerializeToString() + extra)
    assert back.request_id == "r" and list(back.tokenized.input_ids) == [5, 6]
    assert back.SerializeToString().endswith(extra)


def test_encode_bootstrap_info_is_generate_requests_own(pb2: ModuleType) -> None:
    # field 10 is SMG's GenerateRequest.encode_bootstrap_info, byte for byte both ways
    from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts

    smg = ts.GenerateRequest(request_id="r")
    smg.mm_inputs.items.add().content_hash = b"\x01" * 8
    smg.encode_bootstrap_info.items.add(
        item_index=0, bootstrap_host="10.0.0.7", bootstrap_port=8998, bootstrap_room=2**62 + 5
    )
    ours = pb2.AdmitRequest.FromString(smg.SerializeToString())
    (entry,) = ours.encode_bootstrap_info.items
    assert (entry.item_index, entry.bootstrap_host, entry.bootstrap_port, entry.bootstrap_room) == (
        0, "10.0.0.7", 8998, 2**62 + 5,
    )  # fmt: skip
    assert ts.GenerateRequest.FromString(ours.SerializeToString()) == smg


def test_messages_pickle(pb2: ModuleType) -> None:
    # gen_protos sets __module__ to the real import path, so pickling works.
    assert pb2.AdmitRequest.__module__ == "mmadmit_client.proto.admission_pb2"
    msg = pb2.AbortRequest(request_id="r", reason="client gone")
    assert pickle.loads(pickle.dumps(msg)) == msg


# --------------------------------------------------------------------------
# Contract (docs/spec/GRPC.md)


def test_service_and_methods(pb2: ModuleType, pb2_grpc: ModuleType) -> None:
    service = pb2.DESCRIPTOR.services_by_name["Admission"]
    assert service.full_name == "mmadmit.v1.Admission"
    shapes = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
        for m in service.methods
    }
    assert shapes == {
        "Admit": ("AdmitRequest", "AdmitResponse", False, False),
        "AdmitStream": ("AdmitRequest", "AdmitResponse", True, True),
        "Abort": ("AbortRequest", "AbortResponse", False, False),
        "GetModelInfo": ("GetModelInfoRequest", "GetModelInfoResponse", False, False),
    }
    assert hasattr(pb2_grpc, "AdmissionServicer") and hasattr(pb2_grpc, "AdmissionStub")
    assert callable(pb2_grpc.add_AdmissionServicer_to_server)


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        (
            "AdmitRequest",
            {"request_id": 1, "tokenized": 2, "mm_inputs": 9, "encode_bootstrap_info": 10,
             "input_ids_unpadded": 100, "mrope": 101, "echo_features": 102, "timeout_ms": 103},
        ),
        ("EncodeBootstrapInfo", {"items": 1}),
        (
            "EncodeItemBootstrapInfo",
            {"item_index": 1, "bootstrap_host": 2, "bootstrap_port": 3, "bootstrap_room": 4},
        ),
        ("EncodeHandshake", {"bootstrap_host": 1, "bootstrap_port": 2, "bootstrap_room": 3}),
        ("TokenizedInput", {"input_ids": 1, "original_text": 2}),
        (
            "MultimodalItem",
            {"modality": 1, "content_hash": 2, "encoder_input": 3, "model_specific_tensors": 4,
             "placeholders": 5, "placeholder_token_id": 6, "pad_value": 100},
        ),
        ("TensorData", {"shape": 1, "dtype": 2, "inline": 3, "shm": 4}),
        ("ShmHandle", {"name": 1, "offset": 2, "nbytes": 3, "owner_id": 4}),
        ("MropeInputs", {"positions": 1, "delta": 2}),
        (
            "MaterializedRequest",
            {"input_ids": 1, "input_ids_unpadded": 2, "items": 3, "mrope_positions": 4,
             "mrope_position_delta": 5, "passthrough": 6},
        ),
        (
            "MaterializedItem",
            {"modality": 1, "hash": 2, "pad_value": 3, "placeholders": 4, "encoder_input": 5,
             "model_specific_tensors": 6, "encode_handshake": 7},
        ),
        (
            "GetModelInfoResponse",
            {"family": 1, "model_type": 2, "architectures": 3, "vocab_size": 4,
             "max_model_len": 5, "image_token_id": 6, "video_token_id": 7, "audio_token_id": 8,
             "role": 9, "language_model_only": 10, "multimodal_active": 11, "uses_mrope": 12},
        ),
    ],
)  # fmt: skip
def test_field_numbers(pb2: ModuleType, message: str, fields: dict[str, int]) -> None:
    descriptor = pb2.DESCRIPTOR.message_types_by_name[message]
    assert {f.name: f.number for f in descriptor.fields} == fields


def test_optional_token_ids_and_enums(pb2: ModuleType) -> None:
    info = pb2.GetModelInfoResponse(image_token_id=0)
    assert info.HasField("image_token_id") and not info.HasField("video_token_id")
    assert dict(pb2.Modality.items()) == {
        "MODALITY_UNSPECIFIED": 0, "IMAGE": 1, "AUDIO": 2, "VIDEO": 3,
    }  # fmt: skip
    assert dict(pb2.AbortCode.items()) == {
        "ABORT_CODE_UNSPECIFIED": 0, "INVALID_REQUEST": 1, "TEXT_ONLY_MODEL": 2,
        "UNSUPPORTED": 3, "TOO_LARGE": 4, "OVERLOADED": 5, "CANCELLED": 6,
        "DEADLINE_EXCEEDED": 7, "SHUTTING_DOWN": 8, "INTERNAL": 9,
    }  # fmt: skip


# --------------------------------------------------------------------------
# Freshness


_HEADER_VERSION = re.compile(r"^# Generated from .* \(grpcio-tools (?P<version>[^)]+)\)", re.M)
_SERIALIZED = re.compile(r"AddSerializedFile\((b'.*?')\)\n", re.S)


def _tools_version(text: str) -> str | None:
    m = _HEADER_VERSION.search(text)
    return m.group("version") if m else None


def test_generated_code_is_fresh(pb2: ModuleType, gen_protos: ModuleType, tmp_path: Path) -> None:
    """Regenerate from protos/ and compare with the installed mmadmit_client.proto.

    Always compared: the set of files and the serialized descriptor (changes
    iff a .proto changed). Whole files are compared byte for byte when both
    were made by the same grpcio-tools version (a pip build-isolation
    environment may hold another one; that is not staleness).
    """
    pytest.importorskip("grpc_tools", reason="grpcio-tools (test extra) regenerates the code")
    installed_dir = _source(pb2).parent
    fresh_dir = tmp_path / "_proto"
    fresh = {p.name: p.read_text(encoding="utf-8") for p in gen_protos.generate(fresh_dir)}

    generated_suffixes = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "__init__.py")
    installed_names = {
        p.name for p in installed_dir.iterdir() if p.name.endswith(generated_suffixes)
    }
    assert installed_names == set(fresh), f"generated file set differs; {REINSTALL}"

    for name, text in fresh.items():
        installed = (installed_dir / name).read_text(encoding="utf-8")
        if _tools_version(installed) == _tools_version(text):
            assert installed == text, f"{name} is stale; {REINSTALL}"
        else:  # pragma: no cover - depends on the build environment
            assert installed.startswith("# mypy: ignore-errors\n"), name

    # Serialized FileDescriptorProto: a literal in the fresh file vs the loaded module.
    m = _SERIALIZED.search(fresh["admission_pb2.py"])
    assert m is not None
    assert pb2.DESCRIPTOR.serialized_pb == ast.literal_eval(m.group(1)), (
        f"admission_pb2 does not match protos/; {REINSTALL}"
    )


def test_generated_code_shape(pb2: ModuleType, pb2_grpc: ModuleType) -> None:
    for module in (pb2, pb2_grpc):
        text = _source(module).read_text(encoding="utf-8")
        assert text.startswith("# mypy: ignore-errors\n# Generated from protos/mmadmit/v1/")
        assert "do not edit" in text.splitlines()[1]
        assert not re.search(r"^\s*(from|import) mmadmit\.v1\b", text, re.M), "absolute import"
    assert "from . import admission_pb2" in _source(pb2_grpc).read_text(encoding="utf-8")
    assert pb2.DESCRIPTOR.name == "mmadmit/v1/admission.proto"  # what reflection reports
    assert (PROTO_ROOT / pb2.DESCRIPTOR.name).is_file()
