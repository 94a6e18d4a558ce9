"""Shared test helpers: where the wire vectors live and how to load them.

``VECTORS`` is ``$MMADMIT_VECTORS`` or ``tests/data/vectors``, the copy of the
reference vectors the repository carries (see its ``README.md`` for provenance), so
a clone with nothing beside it runs the whole suite. Helpers here are plain functions
(importable as ``from conftest import ...`` because pytest puts ``tests/`` on
``sys.path``) plus thin fixtures around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

if TYPE_CHECKING:
    from mmadmit.model import Request
    from mmadmit.pool import MaterializerPool
    from mmadmit.server import ServerHandle
    from mmadmit.zmq_ingest import ZmqIngest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SERVICE_DIR = REPO_ROOT / "service"

# The package is normally installed (`pip install -e .`); fall back to the source
# tree so a fresh checkout still runs its tests.
try:  # pragma: no cover - depends on the environment
    import mmadmit  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(SERVICE_DIR))

# hf_oracle / prompt_gen are imported as top-level modules by the tests.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

VECTORS = Path(os.environ.get("MMADMIT_VECTORS") or (TESTS_DIR / "data" / "vectors"))
CONFIGS = VECTORS / "configs"

FAMILY_CONFIG = {
    "qwen3_5": "qwen3_5.json",
    "qwen3_omni": "qwen3_omni_moe.json",
    "llama": "llama.json",
}


def forged_tensor(dtype: Any, shape: tuple[int, ...], data: memoryview) -> Any:
    """A :class:`mmadmit.model.Tensor` whose shape does not match its bytes, made by
    going around its constructor (which refuses it): only to show that code handed
    one anyway (the compiled rules) never reads past its bytes."""
    import msgspec
    from mmadmit.model import Tensor

    t = Tensor(dtype, (data.nbytes // dtype.itemsize,), data)
    msgspec.structs.force_setattr(t, "shape", shape)
    return t


def vector_names() -> list[str]:
    """Names of every vector case (``<name>.frames``), sorted; empty if absent."""
    if not VECTORS.is_dir():
        return []
    return sorted(p.stem for p in VECTORS.glob("*.frames"))


def config_for_family(family: str) -> Path:
    """The ``configs/`` file serving a vector's ``meta['family']``."""
    try:
        return CONFIGS / FAMILY_CONFIG[family]
    except KeyError:
        raise KeyError(f"no vector config known for family {family!r}") from None


@dataclass
class Vector:
    name: str
    frames: list[memoryview]  # [type, payload, *aux] as zero-copy views of the container
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]
    blob: bytes  # the raw .frames container

    @property
    def config(self) -> Path:
        return config_for_family(self.meta["family"])

    @property
    def error(self) -> dict[str, Any] | None:
        return self.meta.get("error")

    @property
    def frames_path(self) -> Path:
        return VECTORS / f"{self.name}.frames"


def load_vector(name: str) -> Vector:
    """Frames (via ``mmadmit_client.frames.parse_frames``), expected arrays and metadata."""
    from mmadmit_client.frames import parse_frames

    blob = (VECTORS / f"{name}.frames").read_bytes()
    frames = parse_frames(blob)
    with np.load(VECTORS / f"{name}.npz") as npz:
        arrays = {key: npz[key] for key in npz.files}
    meta = json.loads((VECTORS / f"{name}.json").read_text())
    return Vector(name=name, frames=frames, arrays=arrays, meta=meta, blob=blob)


def require_vectors() -> None:
    if not vector_names():
        pytest.skip(f"no wire vectors at {VECTORS} (set MMADMIT_VECTORS)")


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    require_vectors()
    return VECTORS


@pytest.fixture(scope="session")
def vector_loader():
    """``vector_loader(name)`` -> :class:`Vector` (skips when the vectors are absent)."""
    require_vectors()
    return load_vector


def module_from_file(name: str, path: Path) -> ModuleType:
    """The Python file at ``path`` run as a module named ``name`` (not a package's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def compat_pb2(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """``tests/protos/generate_compat.proto`` compiled: a frontend's ``GenerateRequest``
    (skips without ``grpc_tools``)."""
    grpc_tools = pytest.importorskip("grpc_tools.protoc")
    out = tmp_path_factory.mktemp("compat")
    protos = TESTS_DIR / "protos"
    rc = grpc_tools.main(
        ["grpc_tools.protoc", f"-I{protos}", f"--python_out={out}", "generate_compat.proto"]
    )
    assert rc == 0, "protoc failed on tests/protos/generate_compat.proto"
    return module_from_file("generate_compat_pb2", Path(out) / "generate_compat_pb2.py")


def generate_request(c: ModuleType, input_ids: list[int], encode_item: int) -> Any:
    """A frontend's ``GenerateRequest`` (``c``: the :func:`compat_pb2` module) with every
    scheduler field set (sampling, logprobs, stream, the encode bootstrap of item
    ``encode_item``, the KV bootstrap, a data-parallel rank); no item yet."""
    return c.GenerateRequest(
        request_id="smg-1",
        tokenized=c.TokenizedInput(input_ids=input_ids, original_text="hi"),
        sampling_params=c.SamplingParams(
            temperature=0.7,
            top_k=20,
            max_new_tokens=64,
            stop=["</s>"],
            json_schema="{}",
            sampling_seed=7,
            logit_bias={"a": 1.0},
        ),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=5,
        token_ids_logprob=[1, 2, 3],
        stream=True,
        encode_bootstrap_info=c.EncodeBootstrapInfo(
            items=[c.EncodeItemBootstrapInfo(item_index=encode_item, bootstrap_room=9)]
        ),
        kv_bootstrap_info=c.KvBootstrapInfo(
            bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=2**62
        ),
        data_parallel_rank=1,
    )


def _session_native() -> bool:
    """``MMADMIT_NATIVE=0 make test`` runs the whole suite on the Python sources
    only (what ``--native off`` serves with); in-process and spawned servers read
    the same variable. The ``native_mode`` cases still run both ways."""
    from mmadmit.config import build_config

    environ = {"MMADMIT_NATIVE": os.environ.get("MMADMIT_NATIVE", "1")}
    return build_config({}, environ=environ).native


SESSION_NATIVE = _session_native()


def pytest_configure(config: pytest.Config) -> None:
    from mmadmit import native

    native.set_enabled(SESSION_NATIVE)


def pytest_report_header(config: pytest.Config) -> str:
    return f"mmadmit native extensions: {'on' if SESSION_NATIVE else 'off (MMADMIT_NATIVE)'}"


def rules_builds() -> list[Any]:
    """pytest params of every build of ``rules.py``: the source interpreted, then
    each compiled build this CPU runs (``planner.COMPILED``: ``_rules_c``, and
    ``_rules_avx2`` where the CPU has AVX2), whatever the session's native switch
    (the tests call the modules directly); a skipped ``compiled`` where none is built."""
    from mmadmit import planner, rules

    compiled = [pytest.param(m, id=name) for name, m in planner.COMPILED.items()] or [
        pytest.param(None, id="compiled", marks=pytest.mark.skip(reason="_rules_c not built"))
    ]
    return [pytest.param(rules, id="interpreted"), *compiled]


@contextlib.contextmanager
def native_as(on: bool) -> Iterator[None]:
    """Native code switched ``on`` (or off) whatever the session's setting
    (``MMADMIT_NATIVE``); the session's setting restored afterwards, also on failure."""
    from mmadmit import native

    native.set_enabled(on)
    try:
        yield
    finally:
        native.set_enabled(SESSION_NATIVE)


@pytest.fixture(params=["native", "fallback"])
def native_mode(request: pytest.FixtureRequest) -> Any:
    """Run a test twice: C extensions on, then Python fallbacks only (``--native off``).

    The vector and transport tests use it (``pytestmark``), so the suite proves
    both ways serve every vector and transport case. In-process servers started
    in the test get the same setting (their config's ``native``; see
    ``test_admission_both_transports.running``).
    """
    from mmadmit import intcodec, model, native, pbwire, planner  # noqa: F401 (register)

    on = request.param == "native"
    if on and not any(native.built().values()):
        pytest.skip("no C extension is built: the fallback run covers it")
    with native_as(on):
        yield on


def free_port() -> int:
    """A loopback TCP port that nothing listens on: bound, then released.

    A plain socket, never listening, closed synchronously: unlike a ZMQ socket
    (whose close completes later in libzmq's I/O thread) it cannot accept a
    connection made just after this returns.
    """
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """*n* distinct free loopback TCP ports, as :func:`free_port` finds one.

    All *n* sockets stay bound until every port is chosen: two calls to
    :func:`free_port` may return the same port, since the kernel is free to hand a
    released port out again at once.
    """
    with contextlib.ExitStack() as stack:
        socks = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)
        ]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


async def http_get(address: str, path: str = "/metrics", method: str = "GET") -> tuple[int, str]:
    """One plain HTTP/1.1 request to the metrics endpoint: (status, body)."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split(" ", 2)[1]), body


async def scrape_metrics(address: str, attempts: int = 1) -> dict[str, float]:
    """One ``GET /metrics`` (status 200): every sample by its name and labels, as
    ``{'name{label="value"}': value}``. Tried ``attempts`` times while the server closes
    the connection without an answer."""
    for attempt in range(attempts):
        try:
            status, body = await http_get(address)
            break
        except (IndexError, ValueError, ConnectionError):
            if attempt == attempts - 1:
                raise
    assert status == 200
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def communicate(
    proc: asyncio.subprocess.Process, timeout_s: float, what: str
) -> tuple[bytes, bytes]:
    """``proc.communicate()``: its (stdout, stderr) once it exits; still running after
    ``timeout_s``, it is killed and the test fails naming ``what``."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{what}: still running after {timeout_s}s") from None
    assert proc.returncode is not None
    return out, err


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``cond`` on the running loop every 5 ms; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


class Sockets:
    """Raw test sockets on the test's own context. It keeps a reference to
    every socket until teardown closes them (a socket dropped unclosed when the
    test coroutine ends would raise a ResourceWarning)."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._made: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self._made:
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
async def zctx() -> AsyncIterator[Sockets]:
    net = Sockets()
    yield net
    net.close()


# --------------------------------------------------------------------------- in-process server


@contextlib.asynccontextmanager
async def serving(
    *,
    before_run: Callable[[Request], None] | None = None,
    release: Callable[[], None] | None = None,
    **settings: Any,
) -> AsyncIterator[ServerHandle]:
    """The whole server in this process (``mmadmit.server.start_server``), configured as
    ``mmadmit serve`` from ``settings`` (the flags' names; no environment) over these:
    ``--device cpu --workers 1``, gRPC and ZMQ on ephemeral loopback ports, no metrics
    endpoint. ``before_run``: the pool's hook; ``release`` (a holding hook's) is called
    as the server stops, before its pool does and again after, so that whatever fails
    no worker is left blocked."""
    from mmadmit.config import build_config
    from mmadmit.server import start_server

    config = build_config(
        {
            "device": "cpu",
            "workers": 1,
            "grpc_listen": "127.0.0.1:0",
            "zmq_listen": "tcp://127.0.0.1:0",
            "metrics_listen": "off",
            **settings,
        },
        environ={},
    )
    async with contextlib.AsyncExitStack() as stack:
        if release is not None:
            stack.callback(release)
        handle = await start_server(config, stack, before_run=before_run)
        if release is not None:
            stack.callback(release)  # LIFO: before the pool stops
        yield handle


# --------------------------------------------------------------------------- in-process ZMQ service


class Gate:
    """``before_run`` hook: holds requests whose rid starts with ``hold`` until
    :meth:`open`, raises for ``boom``; records every request a worker was handed.

    A held request the test never releases fails after ``HOLD_S`` (the worker
    raises and the fixture reports it) instead of quietly going on."""

    HOLD_S = 10.0

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.started: list[str] = []
        self.seen: list[Request] = []
        self.timed_out: list[str] = []

    def __call__(self, req: Request) -> None:
        with self._lock:
            self.seen.append(req)
            if req.rid.startswith("hold"):
                self.started.append(req.rid)
        if req.rid.startswith("hold") and not self._open.wait(self.HOLD_S):
            self.timed_out.append(req.rid)
            raise AssertionError(f"{req.rid} was held {self.HOLD_S} s and never released")
        if req.rid.startswith("boom"):
            raise RuntimeError("a worker bug")

    def open(self) -> None:
        self._open.set()


@dataclass
class Service:
    """An in-process ZMQ service (see the ``service`` fixture)."""

    pool: MaterializerPool
    ingest: ZmqIngest
    endpoint: str
    gate: Gate


def _output(kw: dict[str, Any]) -> Any:
    """The ingest's output strategy from the ``service`` fixture's keywords (popped)."""
    from mmadmit.zmq_output import Forward, Reply

    forward = kw.pop("forward", None)
    hook = kw.pop("sent_hook", None)
    if forward is not None:
        return Forward(forward, max_pending=kw.pop("max_pending_forwards", None), sent_hook=hook)
    return Reply(send_timeout_s=kw.pop("send_timeout_s", 5.0), sent_hook=hook)


@pytest.fixture
async def service() -> AsyncIterator[Callable[..., Any]]:
    """``await service(family, **kw)`` -> a started :class:`Service` (``MaterializerPool``
    + ``ZmqIngest`` on ``tcp://127.0.0.1:0``, intake watchdog off); all torn down."""
    from mmadmit.materializer import Materializer
    from mmadmit.pool import MaterializerPool
    from mmadmit.profile import load_profile
    from mmadmit.zmq_ingest import ZmqIngest

    made: list[Service] = []
    contexts: list[zmq.asyncio.Context] = []

    async def make(
        family: str = "qwen3_5",
        *,
        workers: int = 2,
        max_inflight: int = 64,
        inline_max_tokens: int = 0,
        socket_defaults: dict[int, int] | None = None,
        **ingest_kw: Any,
    ) -> Service:
        """``inline_max_tokens > 0``: small requests run inline, and no gate is
        installed (a ``before_run`` hook turns inline runs off). ``socket_defaults``:
        options for the sockets the ingest makes with ``ctx.socket()`` (its PUSH; the
        ROUTER is made otherwise), on a context of its own. The output: ``forward=
        ADDRESS`` (with ``max_pending_forwards``) makes it a ``Forward``, else a
        ``Reply`` (``send_timeout_s``); ``sent_hook`` goes to either."""
        if socket_defaults:
            ctx = zmq.asyncio.Context()
            contexts.append(ctx)
            for opt, value in socket_defaults.items():
                ctx.setsockopt(opt, value)
            ingest_kw["context"] = ctx
        gate = Gate()
        pool = MaterializerPool(
            Materializer(load_profile(str(config_for_family(family)))),
            workers=workers,
            max_inflight=max_inflight,
            before_run=None if inline_max_tokens else gate,
            inline_max_tokens=inline_max_tokens,
        )
        ingest_kw.setdefault("max_message_bytes", 64 << 20)
        ingest_kw.setdefault("watchdog_s", None)  # a lost wake-up must fail the test
        # stop() waits for this much silence on the socket (0.2 s in service): the
        # peers here are in process, and tests/test_drain.py holds the real value
        ingest_kw.setdefault("quiet_s", 0.02)
        output = _output(ingest_kw)
        ingest = ZmqIngest(pool, output, listen="tcp://127.0.0.1:0", **ingest_kw)
        svc = Service(pool, ingest, "", gate)
        made.append(svc)
        svc.endpoint = await ingest.start()
        return svc

    yield make
    for svc in made:
        svc.gate.open()  # never leave a worker thread blocked behind
        await svc.ingest.stop(0.5)
        svc.pool.close()
    for ctx in contexts:
        ctx.term()
    timed_out = [rid for svc in made for rid in svc.gate.timed_out]
    assert not timed_out, f"held requests were never released: {timed_out}"


def requests_total(m: dict[str, float], **labels: str) -> float:
    """The sum of a parsed scrape's ``mmadmit_requests_total`` samples (every
    transport) whose labels include ``labels``, e.g. ``outcome="materialized"``."""
    total = 0.0
    for key, value in m.items():
        name, _, rest = key.partition("{")
        if name == "mmadmit_requests_total" and all(
            f'{k}="{v}"' in rest for k, v in labels.items()
        ):
            total += value
    return total


OutcomeSeries = tuple[str, str, str]  # (transport, outcome, code) of mmadmit_requests_total


def outcome_counts(registry: Any) -> dict[OutcomeSeries, float]:
    """Every ``mmadmit_requests_total`` sample of ``registry`` (a ``Telemetry``'s)."""
    out: dict[OutcomeSeries, float] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name == "mmadmit_requests_total":
                out[(s.labels["transport"], s.labels["outcome"], s.labels["code"])] = s.value
    return out


def grown(before: dict[OutcomeSeries, float], after: dict[OutcomeSeries, float]) -> dict:
    """The samples that changed between two :func:`outcome_counts`, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
