"""mmadmit in front of the real SMG gateway (``smg`` 1.13.0, the PyPI wheel's Rust binary).

Both of mmadmit's SMG faces, driven through SMG's own HTTP API with the
project's test scheduler (``tests/engine_peers.py``, which answers every ADD
the way TokenSpeed's scheduler does) behind mmadmit:

* **the SMG gRPC face** (``--smg-grpc-listen``, docs/spec/SMG_GRPC.md): SMG sends every
  Qwen-VL family only over gRPC. A text request; Qwen2.5-VL with two images;
  Qwen3-VL and Qwen3.5 with an image and a video; Qwen3-Omni with an image and
  audio: each reaches the scheduler materialized, and the test checks what the
  scheduler received against computations of its own: the pad values from
  docs/spec/MATERIALIZE.md rule 6's formula over the item hash, the substitution against
  the unpadded ids, and the M-RoPE positions and delta against transformers'
  ``get_rope_index`` (``tests/hf_oracle.py``) over the unpadded ids and the
  grids SMG sent. Then: a client that goes away (the ABORT follows the ADD), a
  refused request (HTTP 400 whose message names mmadmit's code, nothing
  forwarded), and the scheduler's death (mmadmit exits 3, SMG answers an error).
* **engine mode** (``--smg-handshake``, docs/spec/WIRE.md "Engine mode"): text, a client
  that goes away (SMG's ABORT reaches the scheduler after the ADD), the
  scheduler's death (``ENGINE_CORE_DEAD`` to SMG, exit 3) and a LLaVA image.

Model folders are built by the test (``tests/smg_gateway.py``: a tokenizer made
with ``tokenizers``, configs, no weights); media are made in the test (PNG by
hand, MP4 with ffmpeg, WAV with ``wave``). Video cases skip only where ffmpeg is
missing (``.ci/run`` installs it when it can).

Run with: python -m pytest tests/test_smg_real.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import engine_peers
import numpy as np
import pytest
import smg_gateway as g
import zmq.asyncio
from conftest import free_ports
from hf_oracle import checkpoint_config, hf_positions
from mmadmit.model import Modality, Request

pytestmark = pytest.mark.timeout(120)

ENGINE_LINE = re.compile(r"^mmadmit engine-handshake (\S+)$")
READY_LINE = re.compile(r"^mmadmit ready .*?(?:smg-grpc=(\S+) )?engine=(\S+)$")
PAD_BASE = 1_000_000
PAD_SLOTS = (2**31 - 1 - PAD_BASE + 1) // 3
# the families' names in hf_oracle, by the harness's family name
ORACLE = {
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_5": "qwen3_5",
    "qwen3_omni": "qwen3_omni_moe",
}
needs_ffmpeg = pytest.mark.skipif(not g.have_ffmpeg(), reason="ffmpeg is not installed")


# --------------------------------------------------------------------------- processes


class Mmadmit:
    """``mmadmit serve`` as a child process; a thread collects its stderr lines."""

    def __init__(self, model: Path, *args: str) -> None:
        cmd = [
            sys.executable, "-m", "mmadmit", "serve", "--model", str(model), "--device", "cpu",
            "--workers", "1", "--grpc-listen", "off", "--zmq-listen", "off",
            "--metrics-listen", "off", "--engine-handshake-listen", "tcp://127.0.0.1:0", *args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, bufsize=1,
        )  # fmt: skip
        self.lines: list[str] = []
        self.engine: str | None = None  # the scheduler's handshake address
        self.smg_grpc: str | None = None
        self.ready = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            if (m := ENGINE_LINE.match(line)) is not None:
                self.engine = m.group(1)
            elif (m := READY_LINE.match(line)) is not None:
                self.smg_grpc = m.group(1)
                self.ready.set()

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    async def wait_for(self, cond: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"mmadmit exited {self.proc.returncode}:\n{self.stderr}")
            if time.monotonic() > end:
                raise AssertionError(f"mmadmit: no {what} within {timeout_s}s:\n{self.stderr}")
            await asyncio.sleep(0.02)

    async def wait_exit(self, timeout_s: float = 20) -> int:
        end = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            if time.monotonic() > end:
                raise AssertionError(f"mmadmit still running after {timeout_s}s:\n{self.stderr}")
            await asyncio.sleep(0.05)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._pump_thread.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@dataclass
class Stack:
    """SMG -> mmadmit -> test scheduler, all real processes but the scheduler (in process)."""

    gateway: g.SmgGateway
    mmadmit: Mmadmit
    model: Path
    seen: list[tuple[str, Any]] = field(default_factory=list)
    scheduler_task: asyncio.Task[None] | None = None

    def adds(self) -> list[Request]:
        return [req for kind, req in self.seen if kind == "ADD"]

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.seen]

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A blocking harness call (HTTP to SMG) off the event loop, which runs the scheduler."""
        return await asyncio.to_thread(fn, *args, **kwargs)


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {timeout_s}s: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def grpc_stack(
    tmp_path: Path,
    family: str,
    *,
    mmadmit_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
    **scheduler: Any,
) -> AsyncIterator[Stack]:
    """SMG over gRPC in front of mmadmit's face, a test scheduler behind it."""
    model = g.make_model_dir(tmp_path, family)
    mm = Mmadmit(model, "--smg-grpc-listen", "127.0.0.1:0", *mmadmit_args)
    ctx = zmq.asyncio.Context()
    gateway: g.SmgGateway | None = None
    task: asyncio.Task[None] | None = None
    try:
        await mm.wait_for(lambda: mm.engine is not None, "engine-handshake line")
        seen: list[tuple[str, Any]] = []
        assert mm.engine is not None
        task = asyncio.ensure_future(
            engine_peers.run_scheduler(ctx, mm.engine, report=False, seen=seen, **scheduler)
        )
        await mm.wait_for(mm.ready.is_set, "ready line")
        gateway = g.SmgGateway(
            model,
            worker_urls=[f"grpc://{mm.smg_grpc}"],
            work_dir=tmp_path / "smg",
            extra_args=("--disable-circuit-breaker", *gateway_args),
        )
        await asyncio.to_thread(gateway.start)
        yield Stack(gateway, mm, model, seen, task)
    finally:
        if gateway is not None:
            await asyncio.to_thread(gateway.stop, 10.0, graceful=False)
        mm.stop()
        # the scheduler's sockets close only when its task ends: ctx.term() waits on them
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        ctx.term()


@contextlib.asynccontextmanager
async def engine_stack(
    tmp_path: Path, family: str, *, mmadmit_args: tuple[str, ...] = (), **scheduler: Any
) -> AsyncIterator[Stack]:
    """SMG over its msgpack ZMQ wire (engine mode) in front of mmadmit, a test scheduler
    behind it."""
    model = g.make_model_dir(tmp_path, family)
    gateway = g.SmgGateway(
        model, engine_mode=True, work_dir=tmp_path / "smg", wait_for_worker=False
    )
    await asyncio.to_thread(gateway.start)
    ctx = zmq.asyncio.Context()
    assert gateway.engine_handshake is not None
    mm = Mmadmit(model, "--smg-handshake", gateway.engine_handshake, *mmadmit_args)
    stack = Stack(gateway, mm, model)
    try:
        await mm.wait_for(lambda: mm.engine is not None, "engine-handshake line")
        assert mm.engine is not None
        stack.scheduler_task = asyncio.ensure_future(
            engine_peers.run_scheduler(ctx, mm.engine, report=False, seen=stack.seen, **scheduler)
        )
        await mm.wait_for(mm.ready.is_set, "ready line")
        await asyncio.to_thread(gateway.wait_worker_ready, 30.0)
        yield stack
    finally:
        await asyncio.to_thread(gateway.stop, 10.0, graceful=False)
        mm.stop()
        if stack.scheduler_task is not None:
            stack.scheduler_task.cancel()
            await asyncio.gather(stack.scheduler_task, return_exceptions=True)
        ctx.term()


# --------------------------------------------------------------------------- checks


def check_materialized(family: str, add: Request) -> None:
    """What the scheduler received is the request SMG sent, materialized: checked
    against independent computations, not against mmadmit's own code."""
    assert add.validation_error is None, add.validation_error
    assert add.input_ids_unpadded is not None
    ids, unpadded = add.input_ids, add.input_ids_unpadded
    assert add.mm is not None and add.mm.items
    touched = np.zeros(len(ids), bool)
    for item in add.mm.items:
        assert item.hash is not None, "SMG sends a content hash for every item"
        tag = int(item.modality) - 1  # rule 6: image 0, video 1, audio 2
        assert item.pad_value == PAD_BASE + tag * PAD_SLOTS + item.hash % PAD_SLOTS
        assert item.offsets is not None
        for start, end in item.offsets.tolist():
            assert (ids[start : end + 1] == item.pad_value).all()
            touched[start : end + 1] = True
    np.testing.assert_array_equal(ids[~touched], unpadded[~touched])
    if family not in ORACLE:
        assert add.mm.mrope_positions is None
        return
    cfg = checkpoint_config(ORACLE[family])
    thinker = cfg.get("thinker_config", cfg)
    token_of = {
        Modality.IMAGE: thinker["image_token_id"],
        Modality.VIDEO: thinker["video_token_id"],
        Modality.AUDIO: thinker.get("audio_token_id"),
    }
    oracle_ids = unpadded.copy()
    images: list[list[int]] = []
    videos: list[list[int]] = []
    seconds: list[float] = []
    audio: list[int] = []
    for item in add.mm.items:
        modality = Modality(item.modality)
        assert item.offsets is not None
        for start, end in item.offsets.tolist():
            # SMG's placeholder may be another id than the config's (Qwen2.5-VL images
            # arrive as <|vision_pad|>): transformers finds runs by the config's ids.
            oracle_ids[start : end + 1] = token_of[modality]
        side = {k: v.to_numpy() for k, v in item.side.items()}
        if modality is Modality.IMAGE:
            images += side["image_grid_thw"].reshape(-1, 3).tolist()
        elif modality is Modality.VIDEO:
            videos += side["video_grid_thw"].reshape(-1, 3).tolist()
            for key in ("second_per_grid_ts", "video_second_per_grid"):
                if key in side:
                    seconds += side[key].reshape(-1).astype(float).tolist()
        else:
            audio += side["audio_feature_lengths"].reshape(-1).tolist()
    want, delta = hf_positions(
        ORACLE[family],
        oracle_ids,
        image_grid_thw=images or None,
        video_grid_thw=videos or None,
        second_per_grid_ts=seconds or None,
        audio_seqlens=audio or None,
    )
    positions = add.mm.mrope_positions
    assert positions is not None
    np.testing.assert_array_equal(positions.to_numpy(), want)
    assert add.mm.mrope_position_delta_scalar == delta


# --------------------------------------------------------------------------- the gRPC face

FAMILY_PARTS: dict[str, Callable[[], list[Any]]] = {
    "qwen2_5_vl": lambda: [
        g.image_part(g.png_data_url(64, 64, 1)),
        g.image_part(g.png_data_url(56, 84, 2)),
        "Compare the two.",
    ],
    "qwen3_vl": lambda: [g.image_part(g.png_data_url()), g.video_part(g.mp4_data_url()), "What?"],
    "qwen3_5": lambda: [g.image_part(g.png_data_url()), g.video_part(g.mp4_data_url()), "What?"],
    "qwen3_omni": lambda: [g.image_part(g.png_data_url()), g.audio_part(g.wav_bytes()), "Hear?"],
}
GRPC_FAMILIES = [
    pytest.param("qwen2_5_vl"),
    pytest.param("qwen3_vl", marks=needs_ffmpeg),
    pytest.param("qwen3_5", marks=needs_ffmpeg),
    pytest.param("qwen3_omni"),
]


def test_gateway_ports_are_distinct() -> None:
    # SMG refuses --port equal to --prometheus-port; two free_port() calls may agree
    for _ in range(200):
        ports = free_ports(2)
        assert len(set(ports)) == 2


async def test_stack_tears_down_when_the_gateway_fails_to_start(tmp_path: Path) -> None:
    # a gateway that exits at start must fail the test, not hang its teardown on the
    # scheduler's open sockets (CI once lost two tests that way)
    with pytest.raises(RuntimeError, match="SMG exited"):
        async with grpc_stack(tmp_path, "text", gateway_args=("--no-such-flag",)):
            pass


async def test_grpc_face_text(tmp_path: Path) -> None:
    async with grpc_stack(tmp_path, "text") as st:
        result = await st.call(st.gateway.chat, [g.user_message("Hello there")])
        assert result.status == 200, result.text
        choice = result.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert result.json()["usage"]["completion_tokens"] == 3
        (add,) = st.adds()
        assert add.mm is None and add.input_ids_unpadded is None
        assert add.input_ids.tolist()[0] == g.special_token_id("text", "<|begin_of_text|>")
        streamed = await st.call(
            st.gateway.chat_stream, [g.user_message("Hello again")], max_tokens=16
        )
        assert streamed.status == 200 and streamed.finish_reasons() == ["stop"]
        assert streamed.content() == result.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("family", GRPC_FAMILIES)
async def test_grpc_face_every_qwen_vl_family_arrives_materialized(
    tmp_path: Path, family: str
) -> None:
    async with grpc_stack(tmp_path, family) as st:
        result = await st.call(st.gateway.chat, [g.user_message(*FAMILY_PARTS[family]())])
        assert result.status == 200, f"{result.text}\n{st.mmadmit.stderr}"
        assert result.json()["choices"][0]["finish_reason"] == "stop"
        (add,) = st.adds()
        assert add.rid.startswith("chatcmpl-")
        check_materialized(family, add)
        modalities = sorted(Modality(item.modality).name for item in add.mm.items)  # type: ignore[union-attr]
        want = {
            "qwen2_5_vl": ["IMAGE", "IMAGE"],
            "qwen3_vl": ["IMAGE", "VIDEO"],
            "qwen3_5": ["IMAGE", "VIDEO"],
            "qwen3_omni": ["AUDIO", "IMAGE"],
        }[family]
        assert modalities == want


async def test_grpc_face_client_gone_aborts_after_the_add(tmp_path: Path) -> None:
    # The scheduler holds its answer; the client gives up after 1 s: SMG cancels the
    # Generate call and mmadmit sends the scheduler an ABORT after the ADD.
    async with grpc_stack(tmp_path, "qwen2_5_vl", delay_s=30) as st:
        with pytest.raises(OSError):  # socket timeout: the client goes away
            await st.call(
                st.gateway.chat,
                [g.user_message(g.image_part(g.png_data_url()), "x")],
                timeout=1.0,
            )
        await until(lambda: st.kinds() == ["ADD", "ABORT"], f"ADD then ABORT: {st.kinds()}")
        rid = st.adds()[0].rid
        assert st.seen[1][1] == [rid]
        # mmadmit is still serving the next request
        st.seen.clear()


async def test_grpc_face_refused_request_is_http_400_naming_the_code(tmp_path: Path) -> None:
    async with grpc_stack(tmp_path, "qwen3_5", mmadmit_args=("--max-tokens", "20")) as st:
        result = await st.call(
            st.gateway.chat, [g.user_message(g.image_part(g.png_data_url()), "describe")]
        )
        assert result.status == 400, result.text
        assert "TOO_LARGE: " in result.error_message()
        assert "--max-tokens" in result.error_message() or "20" in result.error_message()
        await asyncio.sleep(0.2)
        assert st.seen == []  # never reached the scheduler


async def test_grpc_face_scheduler_death_exits_3_and_smg_answers_an_error(
    tmp_path: Path,
) -> None:
    async with grpc_stack(tmp_path, "text", dead_after=1, delay_s=30) as st:
        result = await st.call(st.gateway.chat, [g.user_message("Hello")], timeout=30.0)
        assert result.status >= 500, result.text
        assert await st.mmadmit.wait_exit() == 3
        assert "the scheduler went away" in st.mmadmit.stderr


# --------------------------------------------------------------------------- engine mode


async def test_engine_mode_text_through_the_real_smg(tmp_path: Path) -> None:
    async with engine_stack(tmp_path, "text") as st:
        result = await st.call(st.gateway.chat, [g.user_message("Hello there")])
        assert result.status == 200, result.text
        assert result.json()["choices"][0]["finish_reason"] == "stop"
        assert result.json()["usage"]["completion_tokens"] == 3
        (add,) = st.adds()
        assert add.mm is None and add.validation_error is None


async def test_engine_mode_llava_image_through_the_real_smg(tmp_path: Path) -> None:
    async with engine_stack(tmp_path, "llava") as st:
        result = await st.call(
            st.gateway.chat, [g.user_message(g.image_part(g.png_data_url()), "What is it?")]
        )
        assert result.status == 200, f"{result.text}\n{st.mmadmit.stderr}"
        (add,) = st.adds()
        check_materialized("llava", add)


async def test_engine_mode_client_gone_aborts_after_the_add(tmp_path: Path) -> None:
    async with engine_stack(tmp_path, "text", delay_s=30) as st:
        with pytest.raises(OSError):
            await st.call(st.gateway.chat, [g.user_message("Hello")], timeout=1.0)
        await until(lambda: st.kinds() == ["ADD", "ABORT"], f"ADD then ABORT: {st.kinds()}")
        assert st.seen[1][1] == [st.adds()[0].rid]


async def test_engine_mode_scheduler_death_reaches_smg(tmp_path: Path) -> None:
    async with engine_stack(tmp_path, "text", dead_after=1, delay_s=30) as st:
        result = await st.call(st.gateway.chat, [g.user_message("Hello")], timeout=30.0)
        assert result.status >= 500, result.text
        assert await st.mmadmit.wait_exit() == 3
        assert "ENGINE_CORE_DEAD" in st.mmadmit.stderr


async def test_grpc_face_stream_dropped_abort_ends_the_stream(tmp_path: Path) -> None:
    # A streaming client goes away after the first chunk. SMG notices at its next
    # write and calls Abort("Stream dropped") but keeps the Generate stream open:
    # mmadmit sends the ABORT after the ADD and ends the stream itself.
    async with grpc_stack(tmp_path, "text", chunks=20, chunk_interval_s=0.25) as st:
        result = await st.call(
            st.gateway.chat_stream, [g.user_message("Hello")], max_tokens=64, disconnect_after=1
        )
        assert result.disconnected
        await until(lambda: st.kinds() == ["ADD", "ABORT"], f"ADD then ABORT: {st.kinds()}")
        await st.mmadmit.wait_for(
            lambda: "aborted by SMG" in st.mmadmit.stderr, "the Abort call in the log"
        )
        # the stream ended at once: the next request is served normally
        st.seen.clear()
        again = await st.call(st.gateway.chat, [g.user_message("Hello")], max_tokens=64)
        assert again.status == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 20


async def test_engine_mode_a_stalled_scheduler_does_not_look_dead_to_smg(tmp_path: Path) -> None:
    # SMG fails a request whose frame the engine has not accepted within 10 s (and
    # opens its circuit breaker), and declares the engine dead after 300 s without
    # one. The scheduler here stops reading its input for 12 s after the first
    # request while a burst arrives: mmadmit keeps taking SMG's frames (its own
    # intake pauses only while forwards wait at their bound), so every request is
    # answered once the scheduler reads again and SMG never reports its window.
    stall_s = 12.0
    async with engine_stack(
        tmp_path, "text", mmadmit_args=("--max-inflight", "1"),
        stall_after=1, stall_s=stall_s, rcvhwm=1,
    ) as st:  # fmt: skip
        first = await st.call(st.gateway.chat, [g.user_message("first")])
        assert first.status == 200, first.text
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        with ThreadPoolExecutor(40) as pool:
            burst = await asyncio.gather(
                *(
                    loop.run_in_executor(
                        pool, lambda i=i: st.gateway.chat([g.user_message(f"n{i}")], timeout=60.0)
                    )
                    for i in range(40)
                )
            )
        elapsed = time.monotonic() - started
        assert [r.status for r in burst] == [200] * 40, [r.text for r in burst if r.status != 200]
        assert elapsed > 10.0, f"the stall ({elapsed:.1f}s) must outlast SMG's 10 s send window"
        log = st.gateway.log_text()
        assert "send window" not in log and "death window" not in log
        assert len(st.adds()) == 41


async def test_grpc_face_a_concurrent_mix_through_the_real_smg(tmp_path: Path) -> None:
    """40 clients at once through SMG and the face: streamed and whole answers, images
    and text, a third of the streams dropped after their first event. Every request
    that stayed reaches the scheduler once and is answered; every dropped stream's
    request is aborted at the scheduler after its ADD; nothing stays open."""
    async with grpc_stack(tmp_path, "qwen2_5_vl", chunks=20, chunk_interval_s=0.05) as st:
        image = g.image_part(g.png_data_url(64, 64, 3))

        def one(i: int) -> Any:
            parts = [image, f"q{i}"] if i % 2 else [f"q{i}"]
            if i % 3 == 0:
                return st.gateway.chat_stream(
                    [g.user_message(*parts)], max_tokens=64, disconnect_after=1
                )
            if i % 3 == 1:
                return st.gateway.chat_stream([g.user_message(*parts)], max_tokens=64)
            return st.gateway.chat([g.user_message(*parts)], max_tokens=64)

        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(40) as pool:
            results = await asyncio.gather(
                *(loop.run_in_executor(pool, lambda i=i: one(i)) for i in range(40))
            )
        for i, result in enumerate(results):
            if i % 3 == 0:
                assert result.disconnected, i
            elif i % 3 == 1:
                assert result.status == 200 and result.finish_reasons() == ["stop"], i
            else:
                assert result.status == 200, result.text
                assert result.json()["usage"]["completion_tokens"] == 20
        dropped = sum(1 for i in range(40) if i % 3 == 0)
        await until(lambda: len(st.adds()) == 40, f"40 ADDs: {len(st.adds())}")
        await until(
            lambda: len([k for k, _ in st.seen if k == "ABORT"]) == dropped,
            f"ABORTs for the dropped streams: {st.kinds().count('ABORT')}",
        )
        aborted = [rid for kind, rids in st.seen if kind == "ABORT" for rid in rids]
        assert len(aborted) == len(set(aborted))  # one ABORT per request at most
        add_at = {req.rid: n for n, (kind, req) in enumerate(st.seen) if kind == "ADD"}
        for n, (kind, rids) in enumerate(st.seen):
            if kind == "ABORT":
                assert all(add_at[rid] < n for rid in rids)  # never before its ADD
        for req in st.adds():
            if req.mm is not None:
                check_materialized("qwen2_5_vl", req)


async def test_engine_mode_a_refusal_reaches_the_client_as_an_abort(tmp_path: Path) -> None:
    # Over the msgpack wire a refused request is forwarded marked with its
    # validation_error (what was decoded of it, never a feature); the scheduler
    # answers it "abort", which
    # SMG reports to its client as the choice's finish reason.
    async with engine_stack(tmp_path, "llava", mmadmit_args=("--max-tokens", "64")) as st:
        result = await st.call(
            st.gateway.chat, [g.user_message(g.image_part(g.png_data_url()), "What is it?")]
        )
        (add,) = st.adds()
        assert add.validation_error is not None
        assert add.validation_error.startswith("TOO_LARGE: ")
        # a codec breach is never decoded: the minimal marked request, no features
        assert add.mm is None and len(add.input_ids) == 0
        assert result.status == 200, result.text
        assert result.json()["choices"][0]["finish_reason"] == "abort", result.text
