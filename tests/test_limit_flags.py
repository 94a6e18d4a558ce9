"""Every ``--max-*`` setting, table-driven (issue 33: settings every operator can reach).

One row per flag in :data:`FLAGS` (a new ``--max-*`` field without a row fails
:func:`test_every_max_flag_has_a_row`), and for each:

* its range (``config.IntRange``) is the row's, is shown in ``--help``, and is
  checked: its bounds accepted, one past either refused, and so are a
  non-integer, a blank and a huge number, from a flag, from the environment and
  as a typed value; ``mmadmit serve`` with a value out of range exits 2 with one
  line naming the flag (and the variable, when it came from there);
* the service started in-process (``server.start_server``, as ``mmadmit serve``
  does) with the flag at its smallest valid value becomes ready (the built-in
  warm-up is built within the limits), and the next request just over the limit
  is refused with the limit's code on every transport that enforces it (gRPC
  ``Admit``, ZMQ reply), while one at the limit is materialized where a request
  can be; a flag whose smallest value admits no request at its limit has a second
  start at a value that does.

The concurrency limits (``--max-inflight``, ``--max-peer-inflight``,
``--max-grpc-streams``, ``--max-stream-inflight``) are started here at their
smallest value; one past them needs held workers, which the tests named in their
rows do (checked to exist). The SMG gRPC face enforces the request limits through
the same materializer (its requests run on the same pool) and
``--max-message-bytes`` / ``--max-grpc-streams`` through the same ``GrpcPort``;
it is not started here (it needs a scheduler).

Run with: ``.venv/bin/python -m pytest -q -p no:cacheprovider tests/test_limit_flags.py``
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from client_helpers import add_frames, grpc_admit, grpc_client, proto_of, zmq_admit, zmq_client
from conftest import CONFIGS, REPO_ROOT, serving
from mmadmit import cli
from mmadmit.config import IntRange, ServeConfig, build_config, env_name, flag_name
from mmadmit.errors import ConfigError
from mmadmit.limits import INT32_MAX, INT64_MAX, MAX_DEPTH, MAX_RANK, MSGPACK_MAX_LEN
from mmadmit.model import Item, Materialized, Modality, MultimodalInputs, Request, Tensor
from mmadmit.server import ServerHandle, warmup_request

MODEL = CONFIGS / "qwen3_5.json"
IMAGE = 248056  # Qwen3.5 <|image_pad|>; its spatial merge is 2: a [1, 2, 2] grid is 1 token
pytestmark = [
    pytest.mark.skipif(not MODEL.is_file(), reason=f"no model config at {MODEL}"),
    pytest.mark.timeout(120),
]

# --------------------------------------------------------------------------- requests

Frames = list[Any]
Build = Callable[[], Request | Frames]


def text(n: int) -> Callable[[], Request]:
    return lambda: Request(rid=f"text-{n}", input_ids=np.full(n, 100, np.int64))


def image(
    items: int = 1, grid: Any = ((1, 2, 2),), dtype: Any = np.int64, extra: int = 0
) -> Callable[[], Request]:
    """``items`` one-token images, each with the grid ``grid`` (``dtype``) and, with
    ``extra``, a side tensor of ``extra`` int8 values (its bytes and its dimension)."""

    def build() -> Request:
        ids = np.full(2 * items + 1, 100, np.int64)
        its = []
        for k in range(items):
            ids[2 * k + 1] = IMAGE
            side = {"image_grid_thw": Tensor.from_numpy(np.array(grid, dtype))}
            if extra:
                side["note"] = Tensor.from_numpy(np.zeros(extra, np.int8))
            its.append(
                Item(
                    modality=int(Modality.IMAGE),
                    hash=k + 1,
                    offsets=np.array([[2 * k + 1, 2 * k + 1]], np.int64),
                    side=side,
                )
            )
        return Request(rid=f"image-{items}", input_ids=ids, mm=MultimodalInputs(items=its))

    return build


def long_array(n: int) -> Callable[[], Frames]:
    """A text ADD whose sampling params (element 5) are an array of ``n`` elements."""

    def build() -> Frames:
        frames = add_frames(text(1)())
        elems = msgspec.msgpack.decode(frames[1], type=list[msgspec.Raw])
        elems[5] = msgspec.Raw(msgspec.msgpack.encode(list(range(n))))
        return [frames[0], msgspec.msgpack.encode(elems), *frames[2:]]

    return build


def nested_payload(depth: int) -> Callable[[], Frames]:
    """A text ADD whose sampling params (element 5) nest ``depth`` arrays: the payload
    is ``depth + 1`` deep."""

    def build() -> Frames:
        frames = add_frames(text(1)())
        elems = msgspec.msgpack.decode(frames[1], type=list[msgspec.Raw])
        value: Any = 1
        for _ in range(depth):
            value = [value]
        elems[5] = msgspec.Raw(msgspec.msgpack.encode(value))
        return [frames[0], msgspec.msgpack.encode(elems), *frames[2:]]

    return build


def extra_frame() -> Frames:
    """A text ADD with one aux frame it does not use: three frames."""
    return [*add_frames(text(1)()), b"aux"]


def abort_of(n: int) -> Callable[[], Frames]:
    return lambda: [b"\x01", msgspec.msgpack.encode([f"r{i}" for i in range(n)])]


def message_of_bytes(n: int) -> Callable[[], Frames]:
    """A text ADD of exactly ``n`` bytes, all frames (padded in its original text)."""

    def build() -> Frames:
        frames = add_frames(text(1)())
        elems = msgspec.msgpack.decode(frames[1], type=list[msgspec.Raw])
        for pad in range(n):  # element 2: the text (a str); its header grows with it
            elems[2] = msgspec.Raw(msgspec.msgpack.encode("x" * pad))
            payload = msgspec.msgpack.encode(elems)
            if len(frames[0]) + len(payload) == n:
                return [frames[0], payload]
        raise AssertionError(f"no message of {n} bytes (a str header grows at 32)")

    return build


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Probe:
    """One request sent after start-up: materialized (``code`` None) or refused with
    ``code`` naming ``flag`` in its message; ``transports`` it is sent on."""

    build: Build
    code: str | None
    transports: tuple[str, ...] = ("grpc", "zmq")
    names_flag: bool = True


@dataclass(frozen=True)
class Start:
    """One start of the service with the flag at ``value`` and what is sent then."""

    value: int
    probes: tuple[Probe, ...]


@dataclass(frozen=True)
class Row:
    """A ``--max-*`` flag: its range, its starts, and where one past a concurrency
    limit is tested (``past_elsewhere``: ``FILE::TEST`` names)."""

    lo: int
    hi: int
    starts: tuple[Start, ...]
    past_elsewhere: tuple[str, ...] = field(default=())


def at(build: Build, transports: tuple[str, ...] = ("grpc", "zmq")) -> Probe:
    return Probe(build, None, transports)


def over(build: Build, code: str = "TOO_LARGE", transports: tuple[str, ...] = ("grpc", "zmq"),
         names_flag: bool = True) -> Probe:  # fmt: skip
    return Probe(build, code, transports, names_flag)


ZMQ = ("zmq",)
FLAGS: dict[str, Row] = {
    # the materializer's limits: both transports
    "max_model_len": Row(2, INT32_MAX, (
        Start(2, (at(text(1)), over(text(2), names_flag=False))),
    )),
    "max_tokens": Row(1, INT32_MAX, (
        Start(1, (at(text(1)), over(text(2)))),
    )),
    "max_items": Row(1, INT32_MAX, (
        Start(1, (at(image(1)), over(image(2)))),
    )),
    "max_tensor_bytes": Row(1, INT64_MAX, (
        Start(1, (at(text(1)), over(image(grid=(1, 2, 2), dtype=np.int8)))),  # 3 bytes
        Start(24, (at(image()), over(image(extra=25)))),  # the int64 grid: 24 bytes
    )),
    "max_tensor_rank": Row(1, MAX_RANK, (
        Start(1, (at(image(grid=(1, 2, 2))), over(image(grid=((1, 2, 2),))))),
    )),
    "max_tensor_dim": Row(1, INT64_MAX, (
        Start(1, (at(text(1)), over(image(grid=(1, 2, 2))))),  # a grid's dimension is 3
        Start(3, (at(image()), over(image(extra=4)))),
    )),
    # the transports' own limits
    "max_message_bytes": Row(1, INT64_MAX, (
        Start(1, (over(message_of_bytes(101), transports=ZMQ),)),
        Start(101, (at(message_of_bytes(101), ZMQ), over(message_of_bytes(102), transports=ZMQ))),
    ), past_elsewhere=("test_grpc_api.py::test_message_limit_is_clamped_to_grpc_max",)),
    "max_msgpack_depth": Row(2, MAX_DEPTH, (
        Start(2, (at(nested_payload(1), ZMQ),
                  over(nested_payload(2), "INVALID_REQUEST", transports=ZMQ))),
    )),
    "max_msgpack_len": Row(1, MSGPACK_MAX_LEN, (
        Start(1, (over(text(1), transports=ZMQ),)),  # the ADD payload is an array of 24
        Start(24, (at(text(1), ZMQ), over(long_array(25), transports=ZMQ))),
    ), past_elsewhere=("test_limits.py::test_grpc_request_counted_before_protobuf_parses_it",)),
    "max_frames": Row(2, INT32_MAX, (
        Start(2, (at(text(1), ZMQ), over(extra_frame, transports=ZMQ))),
    )),
    "max_abort_ids": Row(1, MSGPACK_MAX_LEN, (
        Start(1, (at(text(1)),)),  # an ABORT has no reply: one past it is dropped
    ), past_elsewhere=("test_limits.py::test_abort_ids",)),
    # concurrency: one past them needs held workers
    "max_inflight": Row(1, INT32_MAX, (Start(1, (at(image()),)),),
                        past_elsewhere=("test_grpc_api.py::test_overloaded_when_the_pool_is_full",
                                        "test_zmq_ingest.py::test_overloaded_when_pool_full")),
    "max_peer_inflight": Row(1, INT32_MAX, (Start(1, (at(image(), ZMQ),)),),
                             past_elsewhere=(
                                 "test_zmq_ingest.py::test_one_peer_cannot_take_the_whole_pool",)),
    "max_grpc_streams": Row(1, INT32_MAX, (Start(1, (at(image(), ("grpc",)),)),),
                            past_elsewhere=(
                                "test_grpc_api.py::test_max_grpc_streams_refuses_calls_past_it",)),
    "max_stream_inflight": Row(1, INT32_MAX, (Start(1, (at(image(), ("grpc",)),)),),
                               past_elsewhere=(
                                   "test_grpc_api.py::test_stream_inflight_limit_bounds_one_stream",)),
}  # fmt: skip


def test_every_max_flag_has_a_row() -> None:
    limit_fields = {name for name in ServeConfig.__dataclass_fields__ if name.startswith("max_")}
    assert limit_fields == set(FLAGS), "a --max-* flag without a row in FLAGS"
    for name, row in FLAGS.items():
        parse = ServeConfig.__dataclass_fields__[name].metadata.get("parse")
        assert isinstance(parse, IntRange), name
        assert (parse.lo, parse.hi) == (row.lo, row.hi), name
        assert row.starts[0].value == row.lo, f"{name}: the first start is the smallest value"


def test_tests_named_elsewhere_exist() -> None:
    for name, row in FLAGS.items():
        for ref in row.past_elsewhere:
            path, test = ref.split("::")
            source = (REPO_ROOT / "tests" / path).read_text()
            assert re.search(rf"^(async )?def {test}\(", source, re.M), (name, ref)


# --------------------------------------------------------------------------- the ranges

NAMES = sorted(FLAGS)


@pytest.mark.parametrize("name", NAMES)
def test_range_bounds_accepted_one_past_refused(name: str) -> None:
    row, flag = FLAGS[name], flag_name(name)
    for value in (row.lo, row.hi):
        assert getattr(build_config({name: str(value)}, environ={}), name) == value
        assert getattr(build_config({name: value}, environ={}), name) == value  # typed
        assert getattr(build_config({}, environ={env_name(name): str(value)}), name) == value
    refusals = {
        str(row.lo - 1): f"{flag} must be at least {row.lo}",
        str(row.hi + 1): f"{flag} must be at most {row.hi}",
        "9" * 5000: f"{flag} must be at most {row.hi}",
        "-" + "9" * 5000: f"{flag} must be at least {row.lo}",
        "x": f"{flag} must be an integer in {row.lo}..{row.hi}",
        "1.5": f"{flag} must be an integer in {row.lo}..{row.hi}",
        "1e3": f"{flag} must be an integer in {row.lo}..{row.hi}",
        "": f"{flag} must be an integer in {row.lo}..{row.hi}",
    }
    for raw, start in refusals.items():
        with pytest.raises(ConfigError) as info:
            build_config({name: raw}, environ={})
        message = str(info.value)
        assert message.startswith(start) and "\n" not in message, message
        assert message.endswith(")") and "(got " in message and len(message) < 200, message
        with pytest.raises(ConfigError) as info:
            build_config({}, environ={env_name(name): raw})
        in_env = f"{env_name(name)} ({flag}) " + start.removeprefix(flag + " ")
        assert str(info.value).startswith(in_env), info.value
    with pytest.raises(ConfigError, match=rf"^{flag} must be at least {row.lo}"):
        build_config({name: row.lo - 1}, environ={})  # a typed value is held to it too
    assert build_config({name: f" {row.lo} "}, environ={}) is not None  # blanks around


def test_help_shows_every_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name, row in FLAGS.items():
        assert re.search(
            rf"{flag_name(name)} VALUE .*?range {row.lo}\.\.{row.hi} \(env {env_name(name)};",
            help_text,
        ), name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("source", ["flag", "env"])
def test_serve_out_of_range_exits_2_with_one_line(
    name: str, source: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    row, flag = FLAGS[name], flag_name(name)
    argv = ["serve"]
    if source == "flag":
        argv += [f"{flag}={row.lo - 1}"]
        expected = f"mmadmit: {flag} must be at least {row.lo}"
    else:
        monkeypatch.setenv(env_name(name), str(row.hi + 1))
        expected = f"mmadmit: {env_name(name)} ({flag}) must be at most {row.hi}"
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines


# --------------------------------------------------------------------------- live


@contextlib.asynccontextmanager
async def running(**settings: str) -> AsyncIterator[tuple[ServerHandle, Any, Any]]:
    """The service as ``mmadmit serve`` starts it (ephemeral ports, one worker), and a
    client per transport."""
    async with contextlib.AsyncExitStack() as stack:
        handle = await stack.enter_async_context(serving(model=str(MODEL), **settings))
        gc = await stack.enter_async_context(grpc_client(handle.addresses["grpc"]))
        zc = await stack.enter_async_context(zmq_client(handle.addresses["zmq"], timeout_s=10))
        yield handle, gc, zc


async def send(transport: str, gc: Any, zc: Any, message: Request | Frames) -> Any:
    if transport == "zmq":
        return await zmq_admit(zc, message)
    assert isinstance(message, Request), "a raw ZMQ message has no gRPC form"
    return await grpc_admit(gc, proto_of(message))


STARTS = [(name, start) for name in NAMES for start in FLAGS[name].starts]


@pytest.mark.parametrize(("name", "start"), STARTS, ids=[f"{n}={s.value}" for n, s in STARTS])
async def test_starts_at_the_value_and_enforces_it(name: str, start: Start) -> None:
    flag = flag_name(name)
    async with running(**{name: str(start.value)}) as (handle, gc, zc):
        # ready: the warm-up ran within the limits
        assert await gc.health() == "SERVING"
        assert handle.pool.stats.completed == 1  # through the pool, materialized
        for probe in start.probes:
            for transport in probe.transports:
                out = await send(transport, gc, zc, probe.build())
                where = (flag, start.value, transport, probe.code)
                if probe.code is None:
                    assert out.materialized, (*where, out)
                    continue
                assert not out.materialized and out.code == probe.code, (*where, out)
                if probe.names_flag:
                    assert flag in out.message, (*where, out.message)
                else:
                    assert str(start.value) in out.message, (*where, out.message)


async def test_smallest_values_together_start() -> None:
    """Every --max-* flag at its smallest value at once (--max-message-bytes excepted:
    see the next test): still ready, and a one-token text request (what such a service
    can admit over gRPC) is materialized."""
    smallest = {name: str(row.lo) for name, row in FLAGS.items() if name != "max_message_bytes"}
    async with running(**smallest) as (_, gc, _zc):
        assert await gc.health() == "SERVING"
        assert (await send("grpc", gc, None, text(1)())).materialized


async def test_grpc_reply_is_not_held_to_the_receive_limit() -> None:
    """--max-message-bytes bounds what is received; a reply (a materialized one carries
    positions, so it is often larger than its request) is sent whatever its size."""
    msg = proto_of(image()())
    size = len(msg.SerializeToString())
    async with running(max_message_bytes=str(size)) as (_, gc, _zc):
        out = await grpc_admit(gc, msg)  # the request is at the limit
        assert out.materialized, out


@pytest.mark.parametrize(
    ("settings", "image"),
    [
        ({}, True),
        ({"max_model_len": "2"}, True),
        ({"max_tokens": "1"}, True),
        ({"max_tensor_rank": "1"}, True),
        ({"max_tensor_bytes": "3"}, True),
        ({"max_tensor_dim": "3"}, True),
        ({"max_tensor_dim": "2"}, False),
        ({"max_tensor_bytes": "2"}, False),
    ],
)
def test_warmup_keeps_the_image_path_while_any_image_can_pass(
    settings: dict[str, str], image: bool
) -> None:
    """The warm-up is built within the limits: with an image while the limits let any
    image request through, text alone when none can (so it always materializes)."""
    from mmadmit.materializer import Materializer

    config = build_config({"model": str(MODEL), **settings}, environ={})
    materializer = Materializer(config.load_profile(), config.limits)
    req = warmup_request(materializer.profile, materializer)
    assert (req.mm is not None) is image
    assert isinstance(materializer.run(req), Materialized)
