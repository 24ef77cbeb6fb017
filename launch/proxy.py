"""A small OpenAI-compatible proxy in front of a prefill (producer) and a decode (consumer) vLLM.

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it first sends the request to the
prefill instance with ``max_tokens=1`` (no streaming), which computes the prompt's KV and hands it
to kvbridge; then it sends the original request, plus the ``kv_transfer_params`` the prefill
instance returned, to the decode instance and relays its answer (JSON or a server-sent event
stream) unchanged. Other routes (``/v1/models``, ``/health``, ...) go to the decode instance.

Failures: a prefill answer of 4xx (a bad request) is returned to the client as is. If the prefill
instance is unreachable or fails (5xx), the request still goes to the decode instance, told that
nothing was saved, so it computes the prompt itself instead of waiting for KV that will not come.

Run: ``python -m launch.proxy --prefill http://HOST:8100 --decode http://HOST:8200 --port 8000``.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from connector.transfer_plan import PARAMS_KEY

logger = logging.getLogger(__name__)

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Sent to the decode instance when the prefill failed: it then claims no KV (see transfer_plan).
NOTHING_SAVED = {PARAMS_KEY: {"prefix_tokens": 0}}
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "content-encoding"}


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


class Proxy:
    """The aiohttp application; ``prefill_url`` / ``decode_url`` are the instances' base URLs."""

    def __init__(self, prefill_url: str, decode_url: str, timeout: float = 600.0) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        for route in GENERATION_ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=self.timeout)

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
        params, failure = await self._prefill(request.path, body)
        if failure is not None:
            return failure
        return await self._relay(request, self.decode_url + request.path, decode_body(body, params))

    async def _prefill(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, web.Response | None]:
        """The prefill instance's kv_transfer_params, or the client error to return instead."""
        try:
            async with self._client().post(self.prefill_url + path, json=prefill_body(body)) as response:
                payload = await response.read()
                if 400 <= response.status < 500:
                    return None, web.Response(status=response.status, body=payload,
                                              content_type=response.content_type)
                if response.status != 200:
                    logger.warning("prefill instance answered %d; the decode instance computes the prompt",
                                   response.status)
                    return NOTHING_SAVED, None
                answer = json.loads(payload)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            logger.warning("prefill instance failed (%s); the decode instance computes the prompt", exc)
            return NOTHING_SAVED, None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return (params if isinstance(params, dict) else None), None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return await self._relay(request, self.decode_url + request.rel_url.path_qs, body or None,
                                 method=request.method)

    async def _relay(self, request: web.Request, url: str, body: dict[str, Any] | bytes | None,
                     method: str = "POST") -> web.StreamResponse:
        """Send ``body`` to ``url`` and stream the answer back chunk by chunk (SSE stays live)."""
        dropped = _HOP_HEADERS | ({"content-type"} if isinstance(body, dict) else set())  # json= sets it
        headers = {k: v for k, v in request.headers.items() if k.lower() not in dropped}
        kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"data": body}
        try:
            async with self._client().request(method, url, headers=headers, **kwargs) as upstream:
                response = web.StreamResponse(status=upstream.status, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS})
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.error("decode instance at %s failed: %s", url, exc)
            return _error(502, f"the decode instance failed: {exc}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "proxy_error", "code": status}}, status=status)


def run(prefill_url: str, decode_url: str, host: str, port: int, timeout: float = 600.0) -> None:
    """Serve until interrupted (SIGINT / SIGTERM)."""
    web.run_app(Proxy(prefill_url, decode_url, timeout).app(), host=host, port=port, print=None,
                handle_signals=True)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", required=True, help="base URL of the prefill (kv_producer) vLLM")
    parser.add_argument("--decode", required=True, help="base URL of the decode (kv_consumer) vLLM")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run(args.prefill, args.decode, args.host, args.port, args.timeout)


if __name__ == "__main__":
    main()
