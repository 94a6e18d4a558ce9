"""The real SMG gateway (``smg`` 1.13.0) in its disaggregated modes, in front of mmadmit's
SMG gRPC face (docs/spec/SMG_GRPC.md, "Disaggregation").

Each leg is its own ``mmadmit serve --role ROLE --smg-grpc-listen ...`` process with its
own test scheduler behind it (``tests/engine_peers.py``, which records every ADD it
decodes); the legs are started before SMG (see ``tests/smg_gateway.py``):

* **PD** (``smg launch --backend tokenspeed --pd-disaggregation --prefill grpc://P none
  --decode grpc://D``). SMG sends every chat to both legs with the same
  ``kv_bootstrap_info``: host the prefill URL's host, port SMG's default 8998 (the
  prefill's bootstrap port is ``none``), and a room minted per request. Checked: image,
  two-image and text chats answer 200; the prefill ADD is materialized as
  ``tests/test_smg_real.py`` checks it (pads from rule 6 over the content hash,
  substitution, positions and delta from transformers' ``get_rope_index``); both ADDs
  carry that rendezvous (elements 16/17/18, docs/spec/WIRE.md); the decode leg
  materializes like the prefill, except with ``--language-model-only`` (rule 2 of
  docs/spec/MATERIALIZE.md): no items, the prefill's M-RoPE delta, the ids as received.
* **EPD** (``--epd-disaggregation --encode grpc://E PORT --prefill grpc://P none --decode
  grpc://D``), with the encode worker stand-in of ``tests/epd_encoder.py``. SMG sends one
  ``Encode`` per item (its room) and, without waiting for their replies, the prefill a
  ``Generate`` whose items carry no encoder input (their ``content_hash`` only) and
  whose ``encode_bootstrap_info`` pairs each item with its room at the encode worker's
  (URL host, ``PORT``); the prefill also
  gets the KV rendezvous, which the decode gets as in PD. Checked: the chats answer 200;
  every prefill ADD item carries that item's ``encode_handshake`` (item element 9) with
  the room the encode worker got for it; the decode ADD carries the prefill's KV room.
  And, straight to the face without SMG, a malformed ``encode_bootstrap_info`` (an item
  index out of range, two entries for one item, entries without ``mm_inputs``) ends
  ``INVALID_ARGUMENT`` with an ``INVALID_REQUEST: `` message naming the entry.

Run with: python -m pytest tests/test_smg_disagg.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_peers
import grpc
import numpy as np
import pytest
import smg_gateway as g
import zmq.asyncio
from epd_encoder import EncodeWorker, model_info_of
from mmadmit.model import Request
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as ts_grpc
from test_smg_real import FAMILY_PARTS, Mmadmit, check_materialized, until

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not g.have_smg(), reason="the smg binary is not installed (pip install smg==1.13.0)"
    ),
]

FAMILY = "qwen2_5_vl"
# SMG's bootstrap port for a prefill registered with ``none``
SMG_DEFAULT_BOOTSTRAP_PORT = 8998
# the encode worker's bootstrap port as registered with SMG (``--encode URL PORT``);
# nothing listens there (SMG logs that its probe was refused, and carries on)
ENCODE_BOOTSTRAP_PORT = 17099


def handshake_on_wire(item_fields: list[Any]) -> Any:
    """An item's ``encode_handshake`` as the scheduler received it: ``MultimodalDataItem``
    element 9 (docs/spec/WIRE.md), None when nil or absent."""
    return item_fields[9] if len(item_fields) > 9 else None


# --------------------------------------------------------------------------- the stack


class Leg:
    """One disaggregated worker: ``mmadmit serve --role ROLE`` (its SMG gRPC face) and
    its own test scheduler (in process, recording what it receives in :attr:`seen`)."""

    def __init__(self, model: Path, role: str, *args: str) -> None:
        self.role = role
        # started at once: the legs import torch side by side
        self.mmadmit = Mmadmit(model, "--role", role, "--smg-grpc-listen", "127.0.0.1:0", *args)
        self.seen: list[tuple[str, Any]] = []
        self.scheduler: asyncio.Task[None] | None = None

    async def connect(self, ctx: zmq.asyncio.Context) -> None:
        """The scheduler handshakes once mmadmit listens; returns when mmadmit is ready."""
        mm = self.mmadmit
        await mm.wait_for(lambda: mm.engine is not None, f"{self.role}: engine-handshake line")
        assert mm.engine is not None
        self.scheduler = asyncio.ensure_future(
            engine_peers.run_scheduler(ctx, mm.engine, report=False, seen=self.seen)
        )
        await mm.wait_for(mm.ready.is_set, f"{self.role}: ready line")

    async def close(self) -> None:
        self.mmadmit.stop()  # drains while its scheduler still runs
        if self.scheduler is not None:
            self.scheduler.cancel()
            await asyncio.gather(self.scheduler, return_exceptions=True)

    @property
    def address(self) -> str:
        assert self.mmadmit.smg_grpc is not None
        return self.mmadmit.smg_grpc

    async def add(self, rid: str) -> Request:
        """The one ADD this leg's scheduler got for ``rid`` (SMG may answer its client
        before the other leg's call has reached its scheduler: it is awaited)."""

        def adds() -> list[Request]:
            return [req for kind, req in self.seen if kind == "ADD" and req.rid == rid]

        await until(lambda: bool(adds()), f"{self.role}: an ADD for {rid}", 10)
        assert len(adds()) == 1, f"{self.role}: {len(adds())} ADDs for {rid}: {self.seen}"
        return adds()[0]


@dataclass
class Disagg:
    gateway: g.SmgGateway
    prefill: Leg
    decode: Leg
    encoder: EncodeWorker | None = None

    async def chat(self, *parts: Any) -> tuple[Request, Request]:
        """One chat through SMG, answered 200; the prefill's and the decode's ADD for it."""
        result = await asyncio.to_thread(self.gateway.chat, [g.user_message(*parts)])
        if result.status != 200:
            encoded = "" if self.encoder is None else f"{len(self.encoder.calls)} Encode calls; "
            legs = f"{self.prefill.mmadmit.stderr}\n{self.decode.mmadmit.stderr}"
            raise AssertionError(f"{result.text}\n{encoded}{legs}\n{self.gateway.log_tail()}")
        assert result.json()["choices"][0]["finish_reason"] == "stop"
        rid = result.json()["id"]  # SMG's request id, the ADD's rid
        return await self.prefill.add(rid), await self.decode.add(rid)


@contextlib.asynccontextmanager
async def disagg_stack(
    tmp_path: Path, *, decode_args: tuple[str, ...] = (), epd: bool = False
) -> AsyncIterator[Disagg]:
    """A prefill and a decode leg (and with ``epd`` the encode worker stand-in), then SMG
    launched in PD (EPD) mode in front of them."""
    model = g.make_model_dir(tmp_path, FAMILY)
    ctx = zmq.asyncio.Context()
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(ctx.term)  # last: after every socket is closed
        legs = [Leg(model, "prefill"), Leg(model, "decode", *decode_args)]
        for leg in legs:
            stack.push_async_callback(leg.close)
        for leg in legs:
            await leg.connect(ctx)
        prefill, decode = legs
        encoder = None
        if epd:
            encoder = EncodeWorker(await model_info_of(prefill.address))
            stack.push_async_callback(encoder.stop)
            workers = g.epd_workers(
                f"grpc://{await encoder.start()}",
                f"grpc://{prefill.address}",
                f"grpc://{decode.address}",
                encode_bootstrap_port=ENCODE_BOOTSTRAP_PORT,
            )
        else:
            workers = g.pd_workers(f"grpc://{prefill.address}", f"grpc://{decode.address}")
        gateway = g.SmgGateway(
            model,
            disaggregated=workers,
            work_dir=tmp_path / "smg",
            extra_args=("--disable-circuit-breaker",),
        )
        stack.callback(gateway.stop, 10.0, graceful=False)
        await asyncio.to_thread(gateway.start)
        yield Disagg(gateway, prefill, decode, encoder)


def one_image() -> list[Any]:
    return [g.image_part(g.png_data_url(64, 64, 5)), "What is it?"]


def kv_room(prefill: Request, decode: Request) -> int:
    """The KV rendezvous both legs' ADDs carry (the same on both), its room returned."""
    host, port, room = engine_peers.kv_bootstrap(prefill)
    assert (host, port) == ("127.0.0.1", SMG_DEFAULT_BOOTSTRAP_PORT), (host, port)
    assert isinstance(room, int) and room > 0, room
    assert engine_peers.kv_bootstrap(decode) == (host, port, room)
    return room


# --------------------------------------------------------------------------- PD


async def test_pd_both_legs_get_one_kv_room_and_the_decode_leg_materializes(
    tmp_path: Path,
) -> None:
    async with disagg_stack(tmp_path) as st:
        rooms = []
        for parts, n_items in ((one_image(), 1), (FAMILY_PARTS[FAMILY](), 2)):
            prefill, decode = await st.chat(*parts)
            rooms.append(kv_room(prefill, decode))
            check_materialized(FAMILY, prefill)
            assert prefill.mm is not None and len(prefill.mm.items) == n_items
            # without --language-model-only the decode role materializes like prefill
            check_materialized(FAMILY, decode)
            np.testing.assert_array_equal(decode.input_ids, prefill.input_ids)
            assert decode.mm is not None and prefill.mm.mrope_positions is not None
            assert decode.mm.mrope_positions is not None
            np.testing.assert_array_equal(
                decode.mm.mrope_positions.to_numpy(), prefill.mm.mrope_positions.to_numpy()
            )
        prefill, decode = await st.chat("Hello there")
        rooms.append(kv_room(prefill, decode))
        assert prefill.mm is None and decode.mm is None
        np.testing.assert_array_equal(decode.input_ids, prefill.input_ids)
        assert len(set(rooms)) == 3, f"one room per request: {rooms}"


async def test_pd_language_model_only_decode_keeps_the_delta_and_no_items(
    tmp_path: Path,
) -> None:
    async with disagg_stack(tmp_path, decode_args=("--language-model-only",)) as st:
        prefill, decode = await st.chat(*FAMILY_PARTS[FAMILY]())
        kv_room(prefill, decode)
        check_materialized(FAMILY, prefill)
        assert prefill.mm is not None and prefill.input_ids_unpadded is not None
        delta = prefill.mm.mrope_position_delta_scalar
        assert isinstance(delta, int) and delta != 0
        # rule 2: the ids as SMG sent them (the prefill's originals), no items (an empty
        # list on the wire, not nil), no positions, the delta as tensor and scalar
        np.testing.assert_array_equal(decode.input_ids, prefill.input_ids_unpadded)
        assert decode.input_ids_unpadded is None
        assert decode.mm is not None and decode.mm.items == []
        assert engine_peers.envelope_field(decode, 22)[0] == []
        assert decode.mm.mrope_positions is None
        assert decode.mm.mrope_position_delta_scalar == delta
        assert decode.mm.mrope_position_delta is not None
        assert decode.mm.mrope_position_delta.to_numpy().tolist() == [[delta]]


# --------------------------------------------------------------------------- EPD


async def test_epd_each_prefill_item_carries_its_encode_room(tmp_path: Path) -> None:
    async with disagg_stack(tmp_path, epd=True) as st:
        encoder = st.encoder
        assert encoder is not None
        for parts, n_items in ((one_image(), 1), (FAMILY_PARTS[FAMILY](), 2)):
            encoder.calls.clear()
            prefill, decode = await st.chat(*parts)
            # one Encode per item, each one item and its room. SMG does not wait for the
            # Encode replies (the prefill waits for the embedding itself), so a call may
            # reach the encode worker after the chat has been answered.
            await until(lambda n=n_items: len(encoder.calls) >= n, f"{n_items} Encode call(s)", 10)
            assert len(encoder.calls) == n_items
            room_at: dict[int, int] = {}  # the item's first placeholder -> its room
            for call in encoder.calls:
                (item,) = call.mm_inputs.items
                (assignment,) = call.items
                assert item.encoder_input.WhichOneof("payload") == "inline"
                room_at[item.placeholders[0].offset] = assignment.bootstrap_room
            assert len(set(room_at.values())) == n_items
            check_materialized(FAMILY, prefill)  # from the content hashes alone
            assert prefill.mm is not None and len(prefill.mm.items) == n_items
            wire_items = engine_peers.wire_items(prefill)
            for k, item in enumerate(prefill.mm.items):
                assert item.feature is None  # SMG sends the prefill no encoder input
                assert item.offsets is not None
                want = {
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": ENCODE_BOOTSTRAP_PORT,
                    "bootstrap_room": room_at[int(item.offsets[0][0])],
                }
                on_wire = handshake_on_wire(wire_items[k])
                assert on_wire == want, f"item {k}: element 9 {on_wire!r}, SMG sent {want!r}"
                got = getattr(item, "encode_handshake", "<no encode_handshake attribute>")
                assert got == want, f"item {k}"
            kv_room(prefill, decode)  # the decode gets the prefill's KV room
            assert decode.mm is not None
            # the decode gets no encode_bootstrap_info: no item of its carries a handshake
            assert [handshake_on_wire(it) for it in engine_peers.wire_items(decode)] == [
                None
            ] * n_items
        encoder.calls.clear()
        prefill, decode = await st.chat("Hello there")
        assert encoder.calls == [] and prefill.mm is None
        kv_room(prefill, decode)
        assert encoder.generates == []


def epd_generate(rid: str, entries: list[int] | None) -> ts.GenerateRequest:
    """A Qwen2.5-VL prompt with two 4-token images as SMG sends it to an EPD prefill (a
    content hash, no encoder input); one ``encode_bootstrap_info`` entry per index in
    ``entries`` (None: no ``mm_inputs``, one entry)."""
    image = g.special_token_id(FAMILY, "<|image_pad|>")
    start = g.special_token_id(FAMILY, "<|vision_start|>")
    end = g.special_token_id(FAMILY, "<|vision_end|>")
    ids = [g.special_token_id(FAMILY, "<|im_start|>"), *g.byte_token_ids("user\n")]
    msg = ts.GenerateRequest(request_id=rid)
    msg.sampling_params.max_new_tokens = 4
    grid = np.array([[1, 4, 4]], np.int64).tobytes()
    for k in range(2):
        ids.append(start)
        if entries is not None:
            item = msg.mm_inputs.items.add(modality=common_pb2.IMAGE)
            item.content_hash = (0x5EED_0000 + k).to_bytes(8, "little")
            item.placeholders.add(offset=len(ids), length=4)
            item.placeholder_token_id = image
            item.model_specific_tensors["image_grid_thw"].CopyFrom(
                ts.TensorData(shape=[1, 3], dtype="int64", inline=grid)
            )
            ids += [image] * 4
        ids.append(end)
    msg.tokenized.input_ids.extend([*ids, *g.byte_token_ids("Same?")])
    for n, k in enumerate(entries if entries is not None else [0]):
        msg.encode_bootstrap_info.items.add(
            item_index=k, bootstrap_host="10.0.0.7", bootstrap_port=9000, bootstrap_room=7 + n
        )
    return msg


async def test_epd_malformed_encode_bootstrap_info_is_refused_naming_the_entry(
    tmp_path: Path,
) -> None:
    model = g.make_model_dir(tmp_path, FAMILY)
    ctx = zmq.asyncio.Context()
    leg = Leg(model, "prefill")
    try:
        await leg.connect(ctx)
        async with grpc.aio.insecure_channel(leg.address) as channel:
            stub = ts_grpc.TokenSpeedSchedulerStub(channel)
            # well formed, out of order: each item gets its own entry's handshake
            responses = [r async for r in stub.Generate(epd_generate("good", [1, 0]))]
            assert responses[-1].complete.finish_reason == "stop"
            add = await leg.add("good")
            check_materialized(FAMILY, add)
            handshakes = [handshake_on_wire(it) for it in engine_peers.wire_items(add)]
            assert handshakes == [
                {"bootstrap_host": "10.0.0.7", "bootstrap_port": 9000, "bootstrap_room": room}
                for room in (8, 7)
            ]
            cases = {
                "out_of_range": ([0, 2], "encode_bootstrap_info.items[1]"),
                "twice": ([1, 1], "encode_bootstrap_info.items[1]"),
                "no_mm_inputs": (None, "encode_bootstrap_info"),
            }
            for rid, (entries, names) in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    _ = [r async for r in stub.Generate(epd_generate(rid, entries))]
                err = caught.value
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (rid, err.details())
                details = err.details() or ""
                assert details.startswith("INVALID_REQUEST: "), (rid, details)
                assert names in details, (rid, details)
        await asyncio.sleep(0.2)
        assert [kind for kind, _ in leg.seen] == ["ADD"], "a refusal reached the scheduler"
    finally:
        await leg.close()
        ctx.term()
