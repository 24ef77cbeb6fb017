"""A small OpenAI-compatible proxy in front of a prefill (producer) and a decode (consumer) vLLM.

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it first sends the request to the
prefill instance with ``max_tokens=1`` (no streaming), which computes the prompt's KV and hands it
to kvbridge; then it sends the original request, plus the ``kv_transfer_params`` the prefill
instance returned, to the decode instance and relays its answer (JSON or a server-sent event
stream) unchanged. The client's headers (``Authorization`` included, for ``vllm serve --api-key``)
go to both instances.

Routes: those two, ``GET /v1/models`` (relayed to the decode instance) and ``GET /health`` (200
when both instances answer their ``/health`` with 200 within the connect timeout, 503 naming the
one that does not). Anything else is answered 404.

Timeouts: ``connect`` bounds connecting to an instance; ``read`` bounds how long an instance may
stay silent, before its answer starts or between two chunks of a stream. There is no bound on a
whole request: a long generation that keeps streaming is never cut.

Failures: a prefill answer of 4xx (a bad request) is returned to the client as is. If the prefill
instance is unreachable, fails (5xx) or times out, the request still goes to the decode instance,
told that nothing was saved, so it computes the prompt itself instead of waiting for KV that will
not come. If the decode instance fails before its answer starts, the client gets a 502 (504 on a
timeout) in OpenAI's error format. If it fails after a stream started, the stream ends with an
event ``data: {"error": {...}}`` and ``data: [DONE]`` (as vLLM ends a failed stream); a plain
JSON answer cut short has its connection closed, so the client sees an incomplete response.

Run: ``python -m launch.proxy --prefill http://HOST:8100 --decode http://HOST:8200 --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from connector.transfer_plan import PARAMS_KEY
from launch.extras import needs_extra

with needs_extra("serve"):
    import aiohttp
    from aiohttp import web

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Sent to the decode instance when the prefill failed: it then claims no KV (see transfer_plan).
NOTHING_SAVED = {PARAMS_KEY: {"prefix_tokens": 0}}
#: Headers that describe one connection or one encoding of a body, not the request: never relayed.
_HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                "transfer-encoding", "upgrade", "host", "content-length", "content-encoding"}
#: asyncio.TimeoutError is TimeoutError from Python 3.11 on, a class of its own before.
_TIMEOUTS = (asyncio.TimeoutError, TimeoutError)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds to connect to an instance, and seconds an instance may stay silent (see the module)."""

    connect: float = 10.0
    read: float = 600.0

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


class Proxy:
    """The aiohttp application; ``prefill_url`` / ``decode_url`` are the instances' base URLs."""

    def __init__(self, prefill_url: str, decode_url: str, timeouts: Timeouts | None = None) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeouts = timeouts or Timeouts()
        self._session: aiohttp.ClientSession | None = None

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
        self._session = aiohttp.ClientSession(timeout=self.timeouts.client_timeout(),
                                              connector=aiohttp.TCPConnector(limit=0))

    async def _stop(self, app: web.Application) -> None:
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
        params, failure = await self._prefill(request.path, body, headers)
        if failure is not None:
            return failure
        return await self._relay(request, self.decode_url + request.path, headers, body=decode_body(body, params))

    async def _prefill(self, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> tuple[dict[str, Any] | None, web.Response | None]:
        """The prefill instance's kv_transfer_params, or the client error to return instead."""
        try:
            async with self._client().post(self.prefill_url + path, json=prefill_body(body),
                                           headers=headers) as response:
                payload = await response.read()
                if 400 <= response.status < 500:
                    return None, web.Response(status=response.status, body=payload,
                                              content_type=response.content_type)
                if response.status != 200:
                    logger.warning("prefill instance answered %d; the decode instance computes the prompt",
                                   response.status)
                    return NOTHING_SAVED, None
                answer = json.loads(payload)
        except (*_TIMEOUTS, aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            logger.warning("prefill instance failed (%s); the decode instance computes the prompt", _describe(exc))
            return NOTHING_SAVED, None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return (params if isinstance(params, dict) else None), None

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._relay(request, self.decode_url + request.rel_url.path_qs,
                                 forwarded_headers(request.headers, json_body=False), method="GET")

    async def health(self, request: web.Request) -> web.Response:
        timeout = aiohttp.ClientTimeout(total=self.timeouts.connect)
        failing = []
        for name, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                async with self._client().get(url + "/health", timeout=timeout) as response:
                    if response.status != 200:
                        failing.append(f"the {name} instance answered {response.status}")
            except (*_TIMEOUTS, aiohttp.ClientError) as exc:
                failing.append(f"the {name} instance failed: {_describe(exc)}")
        return _error(503, "; ".join(failing)) if failing else web.Response(status=200)

    async def not_found(self, request: web.Request) -> web.Response:
        return _error(404, f"{request.method} {request.path} is not served here; routes: "
                      f"POST {', POST '.join(GENERATION_ROUTES)}, GET /v1/models, GET /health")

    async def _relay(self, request: web.Request, url: str, headers: dict[str, str], method: str = "POST",
                     body: dict[str, Any] | None = None) -> web.StreamResponse:
        """Send ``body`` (as JSON) to ``url`` and stream the answer back chunk by chunk (SSE stays live)."""
        response: web.StreamResponse | None = None
        try:
            async with self._client().request(method, url, headers=headers, json=body) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
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


async def _end_started_answer(request: web.Request, response: web.StreamResponse,
                              message: str) -> web.StreamResponse:
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


def run(prefill_url: str, decode_url: str, host: str, port: int, timeouts: Timeouts | None = None) -> None:
    """Serve until interrupted (SIGINT / SIGTERM)."""
    web.run_app(Proxy(prefill_url, decode_url, timeouts).app(), host=host, port=port, print=None,
                handle_signals=True)


def add_timeout_options(parser: argparse.ArgumentParser) -> None:
    """``--connect-timeout`` and ``--read-timeout`` (see :class:`Timeouts`)."""
    defaults = Timeouts()
    parser.add_argument("--connect-timeout", type=float, default=defaults.connect,
                        help="proxy: seconds to connect to an instance")
    parser.add_argument("--read-timeout", type=float, default=defaults.read,
                        help="proxy: seconds an instance may stay silent (before its answer, between stream chunks)")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", required=True, help="base URL of the prefill (kv_producer) vLLM")
    parser.add_argument("--decode", required=True, help="base URL of the decode (kv_consumer) vLLM")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_timeout_options(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(args.prefill, args.decode, args.host, args.port, Timeouts(args.connect_timeout, args.read_timeout))


if __name__ == "__main__":
    main()
