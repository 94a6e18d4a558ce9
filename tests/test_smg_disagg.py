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

The EPD mode's stack (``disagg_stack(epd=True)``, the encode worker stand-in of
``tests/epd_encoder.py``) is here; its tests come with mmadmit's EPD support.

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
import numpy as np
import pytest
import smg_gateway as g
import zmq.asyncio
from epd_encoder import EncodeWorker, model_info_of
from mmadmit.model import Request
from test_smg_real import FAMILY_PARTS, Mmadmit, check_materialized

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

    def add(self, rid: str) -> Request:
        """The one ADD this leg's scheduler got for ``rid``."""
        adds = [req for kind, req in self.seen if kind == "ADD" and req.rid == rid]
        assert len(adds) == 1, f"{self.role}: {len(adds)} ADDs for {rid}: {self.seen}"
        return adds[0]


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
        return self.prefill.add(rid), self.decode.add(rid)


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
