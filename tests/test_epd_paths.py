"""EPD (encoder disaggregation) on the admission paths other than the SMG face.

An item whose embedding comes from an encode worker carries an
``encode_handshake`` (``{"bootstrap_host", "bootstrap_port", "bootstrap_room"}``):
on the gRPC admission API as the request's ``encode_bootstrap_info`` entry
for it (docs/spec/GRPC.md), on the msgpack wire as item element 9
(docs/spec/WIRE.md). Pinned here, through the client library against the real
server (``mmadmit.server.start_server`` on ephemeral ports):

* such an item may come without its encoder input (its ``content_hash`` is the
  hash): it is materialized like any other (pad value by rule 6 over the hash,
  substitution, positions) and its handshake comes back on that item, on both
  transports; an item beside it without a handshake gets none;
* the ZMQ forward output passes element 9 to the scheduler unchanged;
* element 9 that is not nil or a map (what TokenSpeed's decoder types it) is
  refused ``INVALID_REQUEST`` naming the item, and a malformed gRPC entry is
  refused naming the entry (the face's cases are in tests/test_smg_grpc.py).

Run with: python -m pytest tests/test_epd_paths.py -q -p no:cacheprovider
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from client_helpers import grpc_admit
from conftest import Sockets
from mmadmit import wire
from mmadmit_client import Aborted, Item, Materialized, Request, grid
from mmadmit_client import wire as client_wire
from mmadmit_client._grpc_codec import request_to_proto
from test_admission_both_transports import QWEN35_IMAGE, running
from test_zmq_ingest import Factory, dealer, pull_at, recv

pytestmark = pytest.mark.timeout(60)

PAD_BASE = 1_000_000
PAD_SLOTS = (2**31 - 1 - PAD_BASE + 1) // 3
HASH = 0x1234_5678_9ABC_DEF0


def handshake(i: int) -> dict[str, Any]:
    return {"bootstrap_host": f"10.1.0.{i}", "bootstrap_port": 8998, "bootstrap_room": 2**62 + i}


def epd_request(rid: str, **first: Any) -> Request:
    """Qwen3.5, two images: the first from an encode worker (a hash, no feature, a
    handshake), the second with its feature and no handshake. ``first``: fields of
    the first item to override."""
    ids = np.full(60, 100, np.int64)
    ids[10:26] = QWEN35_IMAGE
    ids[40:44] = QWEN35_IMAGE
    fields: dict[str, Any] = {
        "hash": HASH,
        "side": {"image_grid_thw": grid([1, 8, 8])},
        "encode_handshake": handshake(0),
        **first,
    }
    remote = Item("image", [[10, 25]], **fields)
    local = Item(
        "image",
        [[40, 43]],
        feature=np.arange(16 * 32, dtype=np.float32).reshape(16, 32),
        side={"image_grid_thw": grid([1, 4, 4])},
    )
    return Request(rid, ids, items=(remote, local))


@pytest.mark.parametrize("transport", ["grpc", "zmq"])
async def test_an_epd_item_is_materialized_and_keeps_its_handshake(transport: str) -> None:
    async with running(hook=False) as svc:
        client = svc.grpc if transport == "grpc" else svc.zmq
        out = await client.admit(epd_request(f"epd-{transport}"))
        assert isinstance(out, Materialized), out
        remote, local = out.items
        assert remote.hash == HASH and remote.pad_value == PAD_BASE + HASH % PAD_SLOTS
        assert remote.encode_handshake == handshake(0)
        assert local.encode_handshake is None and local.pad_value is not None
        assert (out.input_ids[10:26] == remote.pad_value).all()
        assert (out.input_ids[40:44] == local.pad_value).all()
        assert out.mrope_positions is not None and out.mrope_positions.shape == (3, 60)


async def test_an_epd_item_without_a_hash_or_feature_is_refused_naming_it() -> None:
    async with running(hook=False) as svc:
        for client in (svc.grpc, svc.zmq):
            out = await client.admit(epd_request("nohash", hash=None))
            assert isinstance(out, Aborted) and out.code == "INVALID_REQUEST", out
            assert out.message.startswith("item 0: no pad_value and no content hash")


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [(5, "got `int`"), ([1, 2], "got `array`"), ({1: 2}, "a key: Expected `str`")],
)
async def test_a_zmq_handshake_that_is_not_a_map_of_names_is_refused(
    bad: Any, fragment: str
) -> None:
    # element 9 as TokenSpeed's decoder types it (dict | None, string keys here): a
    # message its decoder would refuse never reaches the scheduler
    elements = (None,) * 9 + (msgspec.Raw(msgspec.msgpack.encode(bad)),)
    req = epd_request("bad", encode_handshake=None, wire_elements=elements)
    async with running(hook=False) as svc:
        out = await svc.zmq.admit(req)
        assert isinstance(out, Aborted) and out.code == "INVALID_REQUEST", out
        assert out.message.startswith("item 0: encode_handshake: ")
        assert fragment in out.message


async def test_a_grpc_entry_for_a_missing_item_is_refused_naming_it() -> None:
    msg = request_to_proto(epd_request("range"))
    msg.encode_bootstrap_info.items.add(item_index=2, bootstrap_room=1)
    async with running(hook=False) as svc:
        out = await grpc_admit(svc.grpc, msg)
        assert isinstance(out, Aborted) and out.code == "INVALID_REQUEST", out
        assert out.message.startswith("encode_bootstrap_info.items[1]: item_index 2 is out of")


async def test_forward_mode_passes_element_9_to_the_scheduler_unchanged(
    service: Factory, zctx: Sockets
) -> None:
    pull, address = await pull_at(zctx)
    svc = await service("qwen3_5", forward=address)
    frames = client_wire.encode_add(epd_request("fwd"))
    sent_item = msgspec.msgpack.decode(frames[1])[22][0][0]
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames, copy=False)
    got = [bytes(f.buffer) for f in await recv(pull)]
    payload = msgspec.msgpack.decode(got[1])
    assert payload[1] == "fwd"
    items = payload[22][0]
    assert items[0][9] == sent_item[9] == handshake(0)
    assert items[1][9] is None
    req = wire.decode_message(got).request
    assert req is not None and req.validation_error is None
    assert req.mm is not None and req.mm.items[0].encode_handshake == handshake(0)
