"""Write the seed corpora ``fuzz/corpus/<target>/`` from the wire vectors.

``python fuzz/make_corpus.py`` (idempotent; the corpora are kept in the
repository, so this only runs again when the vectors or a target's input
layout change). Large feature frames are replaced by small tensors of the same
dtype (the materializer only hashes them), so each seed stays a few KiB.
Inputs that once failed a target are kept beside the seeds as ``regress-*``
(written by hand, see RELIABILITY.md) and are never touched here.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import workloads  # noqa: E402
from conftest import load_vector, vector_names  # noqa: E402
from mmadmit import wire  # noqa: E402
from mmadmit.model import Request, Tensor  # noqa: E402
from mmadmit_client.proto import admission_pb2 as pb  # noqa: E402

from fuzz.targets import grpc_target, smg_target, zmq_target  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus"
PROFILE_OF = {"qwen3_5": "qwen3_5", "qwen3_omni": "qwen3_omni_moe", "llama": "llama"}
_MODALITY_NAME = {1: "image", 2: "video", 3: "audio"}


def _shrunk(req: Request) -> Request:
    """``req`` with every feature a tiny tensor (and the hash kept, so pads are unchanged)."""
    if req.mm is None:
        return req
    for item in req.mm.items:
        if item.feature is not None and item.feature.nbytes > 64:
            item.feature = Tensor.from_numpy(np.arange(8, dtype=np.float32).reshape(2, 4))
    extra = req.extra
    if isinstance(extra, wire.WireExtra):  # blank the frames only features used
        for k in extra.feature_aux:
            extra.aux[k - 1] = memoryview(b"")
            extra.sources[k - 1] = b""
    return req


def _grpc_request(req: Request) -> object:
    return workloads.admit_request(req)


def _write(target: str, name: str, data: bytes) -> None:
    folder = CORPUS / target
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}-{hashlib.sha1(data).hexdigest()[:10]}").write_bytes(data)


def _take_seeds() -> list[tuple[str, bytes]]:
    """AdmitRequests for take_ids: unpadded ids, two messages merged (protobuf
    concatenates their repeated fields), ids and unpadded ids sent unpacked."""
    a = pb.AdmitRequest(request_id="u")
    a.tokenized.input_ids.extend([1, 200, 70000, 151655, 0])
    a.tokenized.original_text = "hi"
    a.input_ids_unpadded.extend([1, 2, 3, 4, 5])
    b = pb.AdmitRequest()
    b.tokenized.input_ids.extend([9, 8])
    b.input_ids_unpadded.extend([7])
    tokenized = bytes([0x08, 0x05, 0x08, 0x81, 0x01])  # input_ids 5 and 129, one tag each
    unpacked = bytes([0x12, len(tokenized)]) + tokenized + bytes([0xA0, 0x06, 0x03])
    one = a.SerializeToString()
    return [("unpadded", one), ("merged", one + b.SerializeToString()), ("unpacked", unpacked)]


def main() -> None:
    for folder in CORPUS.glob("*"):  # regenerate the seeds, keep regress-* inputs
        for path in folder.glob("seed-*"):
            path.unlink()
    for name in vector_names():
        vec = load_vector(name)
        profile = PROFILE_OF[vec.meta["family"]]
        msg = wire.decode_message(list(vec.frames))
        if msg.request is None:
            continue
        req = _shrunk(msg.request)
        frames = [b"\x00", *wire.encode_request(req)]
        frames = [bytes(memoryview(f).cast("B")) for f in frames]
        _write("zmq", f"seed-{name}", zmq_target.seed_input(profile, frames))
        payload = frames[1]
        _write("intcodec", f"seed-split-{name}", b"\x02" + payload)
        # decode_add (first byte 230), default and tight limits, the payload as it is
        _write("intcodec", f"seed-add-{name}", b"\xe6\x00\x00" + payload)
        _write("intcodec", f"seed-add-tight-{name}", b"\xe6\x01\x00" + payload)
        raw = wire._SPLIT.decode(payload)
        _write("intcodec", f"seed-decode-{name}", b"\x00" + bytes(raw[wire.F_INPUT_IDS])[:8192])
        if len(raw) > wire.F_MM and bytes(raw[wire.F_MM]) != b"\xc0":
            mm_raw = wire._SPLIT.decode(raw[wire.F_MM])
            items_raw = bytes(mm_raw[0])
            _write("intcodec", f"seed-spans-{name}", b"\x03" + items_raw)
            # int_rows, width 2 (offsets), starts from the spans (flag byte 99: not free)
            _write("intcodec", f"seed-rows-{name}", b"\x04\x01\x63\x00" + items_raw)
        try:
            admit = _grpc_request(req)
        except (ValueError, TypeError) as exc:
            print(f"{name}: no gRPC seed ({exc})")
        else:
            data = grpc_target.seed_input(profile, admit)
            _write("grpc", f"seed-{name}", data)
            _write("pbwire", f"seed-strip-{name}", b"\x00\x20" + data[2:])
            _write("pbwire", f"seed-take-{name}", b"\x07\x00" + data[2:])  # unpadded too
        mm = req.mm
        tokens = {
            i: mm.im_token_id if item.modality == 1 else mm.video_token_id
            for i, item in enumerate(mm.items if mm is not None else [])
            if item.modality in (1, 2) and mm is not None
        }
        tokens = {i: t for i, t in tokens.items() if t is not None}
        generate = workloads.generate_request(req, req.rid, placeholders=tokens)
        _write("smg", f"seed-{name}", smg_target.seed_input(profile, generate))
    rng = random.Random(12)
    ids = np.array([0, 1, 127, 128, 65535, 2**31, 2**32 + 5], "<i8").tobytes()
    _write("pbwire", "seed-packed", b"\x01\x08\x00\x00\x00" + ids)
    for name, data in _take_seeds():
        _write("pbwire", f"seed-take-{name}", b"\x07\x00" + data)
    _write("intcodec", "seed-encode", b"\x01\x00" + ids)
    for target, count, size in (("planner", 24, 160), ("kernels", 16, 48)):
        for k in range(count):
            _write(target, f"seed-random{k}", bytes(rng.randrange(256) for _ in range(size)))
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"corpus: {sum(1 for p in CORPUS.rglob('*') if p.is_file())} files, {total} bytes")


if __name__ == "__main__":
    main()
