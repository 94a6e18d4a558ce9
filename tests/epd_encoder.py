"""An EPD encode worker stand-in for driving the real SMG (``smg`` 1.13) in EPD mode.

Nothing here is a test. :class:`EncodeWorker` is an in-process ``grpc.aio`` server on
a loopback ephemeral port that serves what SMG asks of a TokenSpeed encode worker:

* ``tokenspeed.grpc.encoder.TokenSpeedEncoder/Encode``: every call's request is
  recorded (:attr:`EncodeWorker.calls`) and answered ``accepted=True``. A real
  worker would run the vision tower and push the embedding to the prefill over
  Mooncake, keyed by the item's ``bootstrap_room``; here nothing is pushed (the
  prefill leg in the tests is mmadmit, which never waits for an embedding).
* the ``tokenspeed.grpc.scheduler.TokenSpeedScheduler`` RPCs SMG uses to register
  any gRPC worker: ``HealthCheck`` (healthy from the start: SMG retries a failed
  first probe only after 30 s), ``GetModelInfo`` (the response it was given; the
  tests pass a prefill leg's own, so that SMG sees one model), ``GetServerInfo``
  (``disaggregation_mode: encode``) and ``GetLoads`` (idle). ``Generate`` ends
  ``FAILED_PRECONDITION`` and is recorded (:attr:`EncodeWorker.generates`), as
  TokenSpeed's encode worker refuses it. The rest of the contract answers
  ``UNIMPLEMENTED`` (the generated servicer's default).

What SMG 1.13 sends in EPD mode (``--epd-disaggregation --encode grpc://E PORT
--prefill grpc://P none --decode grpc://D``), as observed with this stand-in, mmadmit
legs and a recording prefill:

* at registration, on the encode worker: ``HealthCheck`` (then every
  ``--health-check-interval-secs``), ``GetModelInfo``, ``GetServerInfo``, ``GetLoads``
  once each; and a TCP connect to its bootstrap port (``PORT``), which only logs a
  warning when refused;
* per chat, one ``Encode`` per multimodal item, concurrently (in no fixed order): its
  ``request_id`` is ``encode-<uuid>`` (not the chat's id), ``mm_inputs`` holds that one
  item as the aggregated path carries it (``encoder_input`` inline, ``content_hash``,
  grids in ``model_specific_tensors``, ``placeholders``, ``placeholder_token_id``) and
  ``items`` one ``EncodeItemAssignment``, a random 63-bit ``bootstrap_room`` per item;
* and, without waiting for the ``Encode`` replies (a call may reach the encode
  worker after the chat has been answered: a real prefill waits for the embedding
  itself), one ``Generate`` to the prefill whose items are the same **without
  ``encoder_input``** (``content_hash``, grids, placeholders only), with
  ``encode_bootstrap_info.items[k]`` = (``item_index``; ``bootstrap_host``: the host of
  the encode worker's URL; ``bootstrap_port``: ``PORT`` as registered on SMG's command
  line, which it logs as ``bootstrap_port_source="registered"``, or SMG's default 8998
  for ``none``, logged ``"default"``; this stand-in's ``GetServerInfo`` names no
  bootstrap port; ``bootstrap_room``: the room that item's ``Encode`` carried), and
  ``kv_bootstrap_info`` (the prefill URL's host, 8998, a room per request); and one
  ``Generate`` to the decode with the same ``kv_bootstrap_info``, no
  ``encode_bootstrap_info``, its items also without ``encoder_input``.

``tests/test_smg_disagg.py`` asserts what it relies on of this, so a newer SMG that
sends otherwise fails there rather than contradicting this text silently.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import (
    tokenspeed_encoder_pb2 as enc,
)
from smg_grpc_proto.generated import (
    tokenspeed_encoder_pb2_grpc as enc_grpc,
)
from smg_grpc_proto.generated import (
    tokenspeed_scheduler_pb2 as ts,
)
from smg_grpc_proto.generated import (
    tokenspeed_scheduler_pb2_grpc as ts_grpc,
)

VERSION = "epd-encoder-stand-in-0"


class _Encoder(enc_grpc.TokenSpeedEncoderServicer):
    def __init__(self, owner: EncodeWorker) -> None:
        self.owner = owner

    async def Encode(  # noqa: N802 - the contract's name
        self, request: enc.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> enc.EncodeResponse:
        self.owner.calls.append(request)
        return enc.EncodeResponse(accepted=True)


class _Discovery(ts_grpc.TokenSpeedSchedulerServicer):
    """The scheduler surface SMG probes on every gRPC worker it registers."""

    def __init__(self, owner: EncodeWorker) -> None:
        self.owner = owner

    async def Generate(  # noqa: N802
        self, request: ts.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        self.owner.generates.append(request)
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION, "Generate is unavailable on an encode worker"
        )

    async def HealthCheck(  # noqa: N802
        self, request: ts.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> ts.HealthCheckResponse:
        self.owner.probes["HealthCheck"] += 1
        return ts.HealthCheckResponse(healthy=True, message="ok")

    async def GetModelInfo(  # noqa: N802
        self, request: ts.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetModelInfoResponse:
        self.owner.probes["GetModelInfo"] += 1
        return self.owner.model_info

    async def GetServerInfo(  # noqa: N802
        self, request: ts.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetServerInfoResponse:
        self.owner.probes["GetServerInfo"] += 1
        args = struct_pb2.Struct()
        args.update(
            {
                "served_model_name": self.owner.model_info.served_model_name,
                "disaggregation_mode": "encode",
            }
        )
        resp = ts.GetServerInfoResponse(
            server_args=args,
            uptime_seconds=time.time() - self.owner.started_at,
            tokenspeed_version=VERSION,
        )
        resp.start_time.FromSeconds(int(self.owner.started_at))
        return resp

    async def GetLoads(  # noqa: N802
        self, request: ts.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetLoadsResponse:
        self.owner.probes["GetLoads"] += 1
        return ts.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=VERSION,
            dp_rank_count=1,
            loads=[ts.SchedulerLoad(dp_rank=0)],
            aggregate=ts.AggregateMetrics(),
        )


class EncodeWorker:
    """The stand-in, on ``127.0.0.1`` at an ephemeral port (:attr:`address` once started).

    ``model_info`` is what ``GetModelInfo`` answers (pass a prefill leg's own).
    """

    def __init__(self, model_info: ts.GetModelInfoResponse) -> None:
        self.model_info = model_info
        self.calls: list[enc.EncodeRequest] = []
        self.generates: list[ts.GenerateRequest] = []
        self.probes: Counter[str] = Counter()  # the discovery RPCs answered, by name
        self.started_at = time.time()
        self.address: str | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Serve; returns ``HOST:PORT``."""
        server = grpc.aio.server()
        enc_grpc.add_TokenSpeedEncoderServicer_to_server(_Encoder(self), server)
        ts_grpc.add_TokenSpeedSchedulerServicer_to_server(_Discovery(self), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    def rooms(self) -> list[int]:
        """Every ``bootstrap_room`` assigned so far, in call order."""
        return [a.bootstrap_room for call in self.calls for a in call.items]


async def model_info_of(address: str, timeout_s: float = 10.0) -> ts.GetModelInfoResponse:
    """``GetModelInfo`` of the TokenSpeed worker at ``HOST:PORT`` (a mmadmit face)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = ts_grpc.TokenSpeedSchedulerStub(channel)
        info: ts.GetModelInfoResponse = await stub.GetModelInfo(
            ts.GetModelInfoRequest(), timeout=timeout_s
        )
        return info
