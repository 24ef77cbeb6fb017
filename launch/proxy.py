"""A small OpenAI-compatible proxy in front of prefill (producer) and decode (consumer) vLLM instances.

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it first sends the request to a
prefill instance with ``max_tokens=1`` (no streaming), which computes the prompt's KV and hands it
to kvbridge; then it sends the original request, plus the ``kv_transfer_params`` the prefill
instance returned (they name where the KV waits), to a decode instance and relays its answer (JSON
or a server-sent event stream) unchanged. Any prefill instance may be paired with any decode
instance. The client's headers (``Authorization`` included, for ``vllm serve --api-key``) go to
both instances, with one ``X-Request-Id`` (the client's, or a new one).

Routing: each kind of instance has a policy, ``round_robin`` or ``least_outstanding`` (fewest
requests in flight through this proxy). Every instance's ``/health`` is checked every few seconds;
an instance that fails a check or a request is tried only after the healthy ones until a check
passes again.

Routes: those two, ``GET /v1/models`` (relayed to a decode instance) and ``GET /health`` (200 when
at least one instance of each kind answers its ``/health`` with 200 now, else 503; the body lists
every instance). Anything else is answered 404.

Timeouts: ``connect`` bounds connecting to an instance; ``read`` bounds how long an instance may
stay silent, before its answer starts or between two chunks of a stream. There is no bound on a
whole request: a long generation that keeps streaming is never cut.

Failures: a prefill answer of 4xx (a bad request) is returned to the client as is. A prefill
instance that is unreachable, fails (5xx) or times out is replaced by the next one; if every one
fails, the request still goes to a decode instance, told that nothing was saved, so it computes the
prompt itself instead of waiting for KV that will not come. A decode instance that cannot be
connected to is replaced by the next one (nothing was sent to it). If the last one fails before its
answer starts, the client gets a 502 (504 on a timeout) in OpenAI's error format. If it fails after
a stream started, the stream ends with an event ``data: {"error": {...}}`` and ``data: [DONE]`` (as
vLLM ends a failed stream); a plain JSON answer cut short has its connection closed, so the client
sees an incomplete response.

Run: ``python -m launch.proxy --prefill http://HOST:8100 [--prefill ...] --decode http://HOST:8200
[--decode ...] --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from connector.transfer_plan import PARAMS_KEY
from launch.extras import needs_extra

with needs_extra("serve"):
    import aiohttp
    from aiohttp import web

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
#: How a request picks among the instances of one kind (see :class:`Pool`).
POLICIES = ("round_robin", "least_outstanding")
#: Sent to the decode instance when the prefill failed: it then claims no KV (see transfer_plan).
NOTHING_SAVED = {PARAMS_KEY: {"prefix_tokens": 0}}
#: Headers that describe one connection or one encoding of a body, not the request: never relayed.
_HOP_HEADERS = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "content-encoding",
}
#: asyncio.TimeoutError is TimeoutError from Python 3.11 on, a class of its own before.
_TIMEOUTS = (asyncio.TimeoutError, TimeoutError)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds to connect to an instance, and seconds an instance may stay silent (see the module)."""

    connect: float = 10.0
    read: float = 600.0
    #: How long an idle upstream connection stays pooled. vLLM's API server closes connections idle
    #: for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` seconds (5 by default); a request sent on one just as the
    #: server closes it fails before the server reads it ("Can not write request body"), so the pool
    #: lets them go well before.
    keepalive: float = 2.0

    def client_timeout(self) -> aiohttp.ClientTimeout:
        """aiohttp's form: no bound on a whole request, only on connecting and on silence."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.connect, sock_read=self.read)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for the prefill instance: one token, no streaming, one choice."""
    prefill = copy.deepcopy(body)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill["n"] = 1
    prefill.pop("stream_options", None)
    return prefill


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    decode = dict(body)
    if kv_transfer_params is not None:
        decode["kv_transfer_params"] = kv_transfer_params
    return decode


def forwarded_headers(headers: Mapping[str, str], json_body: bool) -> dict[str, str]:
    """The client's headers as sent on to an instance (``json_body``: the proxy re-encodes the body)."""
    dropped = _HOP_HEADERS | ({"content-type"} if json_body else set())
    return {name: value for name, value in headers.items() if name.lower() not in dropped}


class Instance:
    """One vLLM instance behind the proxy: its URL, its health as last seen, its requests in flight."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = True  # until a check or a request says otherwise
        self.problem = ""  # why it was last marked down
        self.outstanding = 0

    def mark_down(self, problem: str) -> None:
        if self.healthy:
            logger.warning("instance %s marked down: %s", self.url, problem)
        self.healthy, self.problem = False, problem

    def mark_up(self) -> None:
        if not self.healthy:
            logger.info("instance %s is healthy again", self.url)
        self.healthy, self.problem = True, ""

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "outstanding": self.outstanding, "problem": self.problem}


class Pool:
    """The instances of one kind and the order in which a request tries them.

    ``round_robin`` starts each request one instance further; ``least_outstanding`` prefers the
    instance with the fewest requests in flight (ties broken round robin). Healthy instances come
    first; instances marked down are still tried last, so that stale health never refuses a request.
    """

    def __init__(self, kind: str, urls: Sequence[str], policy: str) -> None:
        if not urls:
            raise ValueError(f"at least one {kind} instance is needed")
        if policy not in POLICIES:
            raise ValueError(f"unknown {kind} policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.kind = kind
        self.instances = [Instance(url) for url in urls]
        self.policy = policy
        self._turn = 0

    def order(self) -> list[Instance]:
        start, self._turn = self._turn, self._turn + 1
        count = len(self.instances)
        rotated = [self.instances[(start + index) % count] for index in range(count)]
        if self.policy == "least_outstanding":
            rotated.sort(key=lambda instance: instance.outstanding)  # stable: ties keep the rotation
        return [i for i in rotated if i.healthy] + [i for i in rotated if not i.healthy]


@contextlib.contextmanager
def _in_flight(instance: Instance) -> Iterator[None]:
    instance.outstanding += 1
    try:
        yield
    finally:
        instance.outstanding -= 1


class Proxy:
    """The aiohttp application over the prefill and decode instances at the given base URLs."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        timeouts: Timeouts | None = None,
        prefill_policy: str = "round_robin",
        decode_policy: str = "round_robin",
        health_interval: float = 5.0,
    ) -> None:
        self.prefill = Pool("prefill", prefill_urls, prefill_policy)
        self.decode = Pool("decode", decode_urls, decode_policy)
        self.timeouts = timeouts or Timeouts()
        self.health_interval = health_interval
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in GENERATION_ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        # No pool limit: every client request gets its upstream connection; vLLM queues requests itself.
        self._session = aiohttp.ClientSession(
            timeout=self.timeouts.client_timeout(),
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.timeouts.keepalive),
        )
        self._health_task = asyncio.create_task(self._check_health_forever())

    async def _stop(self, app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's HTTP session is not started")
        return self._session

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = forwarded_headers(request.headers, json_body=True)
        # One id for both legs, as vllm-router does, so that the instances' logs can be joined.
        if not any(name.lower() == "x-request-id" for name in headers):
            headers["X-Request-Id"] = uuid.uuid4().hex
        params, failure = await self._prefill(request.path, body, headers)
        if failure is not None:
            return failure
        return await self._relay(request, self.decode, request.path, headers, body=decode_body(body, params))

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        """The kv_transfer_params of the first prefill instance that answers, or the client error to
        return instead; NOTHING_SAVED when every prefill instance failed."""
        for instance in self.prefill.order():
            try:
                with _in_flight(instance):
                    async with self._client().post(
                        instance.url + path, json=prefill_body(body), headers=headers
                    ) as response:
                        payload = await response.read()
                        if 400 <= response.status < 500:
                            return None, web.Response(
                                status=response.status, body=payload, content_type=response.content_type
                            )
                        if response.status != 200:
                            instance.mark_down(f"answered {response.status}")
                            continue
                        answer = json.loads(payload)
            except (*_TIMEOUTS, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
                instance.mark_down(_describe(exc))
                logger.warning("prefill instance %s failed (%s); trying the next one", instance.url, _describe(exc))
                continue
            logger.debug("prefill served by %s", instance.url)
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            return (params if isinstance(params, dict) else None), None
        logger.warning("every prefill instance failed; the decode instance computes the prompt")
        return NOTHING_SAVED, None

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(
            request,
            self.decode,
            request.rel_url.path_qs,
            forwarded_headers(request.headers, json_body=False),
            method="GET",
        )

    async def health(self, request: web.Request) -> web.Response:
        """200 when at least one instance of each kind passes a check made now, else 503; the body
        lists every instance."""
        await self._check_health()
        pools = (self.prefill, self.decode)
        state = {pool.kind: [instance.describe() for instance in pool.instances] for pool in pools}
        missing = [pool for pool in pools if not any(i.healthy for i in pool.instances)]
        if not missing:
            return web.json_response(state)
        message = "; ".join(
            f"no healthy {pool.kind} instance (" + ", ".join(f"{i.url} {i.problem}" for i in pool.instances) + ")"
            for pool in missing
        )
        return web.json_response(
            {**state, "error": {"message": message, "type": "proxy_error", "code": 503}}, status=503
        )

    async def _check_health_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self._check_health()

    async def _check_health(self) -> None:
        instances = self.prefill.instances + self.decode.instances
        await asyncio.gather(*(self._check(instance) for instance in instances))

    async def _check(self, instance: Instance) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeouts.connect)
        try:
            async with self._client().get(instance.url + "/health", timeout=timeout) as response:
                if response.status == 200:
                    instance.mark_up()
                else:
                    instance.mark_down(f"answered {response.status}")
        except (*_TIMEOUTS, aiohttp.ClientError) as exc:
            instance.mark_down(_describe(exc))

    async def not_found(self, request: web.Request) -> web.Response:
        return _error(
            404,
            f"{request.method} {request.path} is not served here; routes: "
            f"POST {', POST '.join(GENERATION_ROUTES)}, GET /v1/models, GET /health",
        )

    async def _relay(
        self,
        request: web.Request,
        pool: Pool,
        path: str,
        headers: dict[str, str],
        method: str = "POST",
        body: dict[str, Any] | None = None,
    ) -> web.StreamResponse:
        """Send ``body`` (as JSON) to an instance of ``pool`` and stream its answer back chunk by chunk
        (SSE stays live). An instance that cannot be connected to is marked down and the next one is
        tried: nothing was sent to it yet."""
        candidates = pool.order()
        for index, instance in enumerate(candidates):
            try:
                with _in_flight(instance):
                    return await self._relay_to(request, instance.url + path, headers, method, body)
            except _NotConnected as exc:
                instance.mark_down(_describe(exc.cause))
                if index + 1 < len(candidates):
                    logger.warning(
                        "%s instance %s unreachable (%s); trying the next one",
                        pool.kind,
                        instance.url,
                        _describe(exc.cause),
                    )
                    continue
                message = f"the {pool.kind} instance failed: {_describe(exc.cause)}"
                logger.error("%s (%s)", message, instance.url)
                return _error(504 if isinstance(exc.cause, _TIMEOUTS) else 502, message)
        raise AssertionError("a pool is never empty")

    async def _relay_to(
        self, request: web.Request, url: str, headers: dict[str, str], method: str, body: dict[str, Any] | None
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        try:
            try:
                upstream = await self._client().request(method, url, headers=headers, json=body)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise _NotConnected(exc) from exc
            async with upstream:
                logger.debug("relaying to %s", url)
                response = web.StreamResponse(
                    status=upstream.status,
                    headers={k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS},
                )
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    try:
                        await response.write(chunk)
                    except ConnectionError:
                        logger.info("the client of %s went away; its request is dropped", url)
                        return response
                await response.write_eof()
                return response
        except (*_TIMEOUTS, aiohttp.ClientError) as exc:
            message = f"the decode instance failed: {_describe(exc)}"
            logger.error("%s (%s)", message, url)
            if response is None:
                return _error(504 if isinstance(exc, _TIMEOUTS) else 502, message)
            return await _end_started_answer(request, response, message)


class _NotConnected(Exception):
    """No connection to the instance could be made: nothing was sent, another instance may serve."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


async def _end_started_answer(request: web.Request, response: web.StreamResponse, message: str) -> web.StreamResponse:
    """End an answer whose status and headers are already sent: never a second response."""
    if response.content_type != "text/event-stream":
        if request.transport is not None:  # the client must not take a truncated body for a whole one
            request.transport.close()
        return response
    event = {"error": {"message": message, "type": "proxy_error", "code": 502}}
    try:
        await response.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
    except ConnectionError:
        logger.info("the client went away before the error event")
    return response


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _TIMEOUTS):
        return "no answer within the timeout"
    return str(exc) or type(exc).__name__


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)


def run(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    host: str,
    port: int,
    timeouts: Timeouts | None = None,
    prefill_policy: str = "round_robin",
    decode_policy: str = "round_robin",
) -> None:
    """Serve until interrupted (SIGINT / SIGTERM)."""
    app = Proxy(prefill_urls, decode_urls, timeouts, prefill_policy, decode_policy).app()
    web.run_app(app, host=host, port=port, print=None, handle_signals=True)


def add_routing_options(parser: argparse.ArgumentParser) -> None:
    """``--prefill-policy`` and ``--decode-policy``, and the timeouts (see :class:`Timeouts`)."""
    for kind in ("prefill", "decode"):
        parser.add_argument(
            f"--{kind}-policy",
            choices=POLICIES,
            default="round_robin",
            help=f"proxy: how a request picks its {kind} instance",
        )
    defaults = Timeouts()
    parser.add_argument(
        "--connect-timeout", type=float, default=defaults.connect, help="proxy: seconds to connect to an instance"
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=defaults.read,
        help="proxy: seconds an instance may stay silent (before its answer, between stream chunks)",
    )


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.proxy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a prefill (kv_producer) vLLM; repeat for several",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a decode (kv_consumer) vLLM; repeat for several",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_routing_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(
        args.prefill,
        args.decode,
        args.host,
        args.port,
        Timeouts(args.connect_timeout, args.read_timeout),
        args.prefill_policy,
        args.decode_policy,
    )


if __name__ == "__main__":
    main()
