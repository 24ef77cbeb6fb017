"""The OpenAI proxy (launch.proxy) against small aiohttp fake instances: no vLLM needed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from launch import proxy

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PREFILL_PARAMS = {"kvbridge": {"prefix_tokens": 32}}
SSE = {"Content-Type": "text/event-stream"}


class FakeInstance:
    """An aiohttp server that records every request and answers through ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[dict[str, Any]] = []
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self.server = TestServer(app)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "path": request.rel_url.path_qs,
                "headers": request.headers.copy(),
                "json": json.loads(body) if body else None,
            }
        )
        return await self.handler(request)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")


async def prefill_answer(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PREFILL_PARAMS})


async def decode_answer(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": "decoded"}]})


async def never_answer(request: web.Request) -> web.Response:
    await asyncio.Event().wait()  # until the proxy gives up and the server is closed
    raise AssertionError("unreachable")


async def stream_then_fail(request: web.Request) -> web.StreamResponse:
    """Starts a server-sent event stream, sends one event, then drops the connection."""
    response = web.StreamResponse(headers=SSE)
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"text": "first"}]}\n\n')
    request.transport.abort()
    return response


async def stream_then_stall(request: web.Request) -> web.StreamResponse:
    """Sends one event, then stays silent."""
    response = web.StreamResponse(headers=SSE)
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"text": "first"}]}\n\n')
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def json_then_fail(request: web.Request) -> web.StreamResponse:
    """Starts a JSON answer (chunked) and drops the connection halfway through it."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(b'{"choices": [{"te')
    request.transport.abort()
    return response


def unanswered(status: int) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": "down"}, status=status)

    return handler


@contextlib.asynccontextmanager
async def proxied(
    prefill: Handler | str, decode: Handler | str, timeouts: proxy.Timeouts | None = None
) -> AsyncIterator[tuple[str, FakeInstance | None, FakeInstance | None]]:
    """The proxy in front of fake instances (a handler) or of a given URL; yields its URL and the fakes."""
    fakes: list[FakeInstance | None] = []
    urls = []
    for spec in (prefill, decode):
        if isinstance(spec, str):
            fakes.append(None)
            urls.append(spec)
        else:
            fake = FakeInstance(spec)
            await fake.server.start_server()
            fakes.append(fake)
            urls.append(fake.url)
    # No background health checks here: they would add requests to the ones the tests count.
    server = TestServer(proxy.Proxy([urls[0]], [urls[1]], timeouts, health_interval=3600).app())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), fakes[0], fakes[1]
    finally:
        await server.close()
        for fake in fakes:
            if fake is not None:
                await fake.server.close()


def completion(stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "stream": stream}


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as client, client.post(url, json=body, headers=headers) as response:
        return response.status, await response.read()


def run(coroutine: Awaitable[None]) -> None:
    asyncio.run(coroutine)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- headers


def test_client_headers_reach_both_instances() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, decode_answer) as (url, prefill, decode):
            headers = {"Authorization": "Bearer sk-test", "X-Request-Id": "req-7"}
            status, body = await post(url + "/v1/completions", completion(), headers)
        assert status == 200 and json.loads(body) == {"choices": [{"text": "decoded"}]}
        [to_prefill], [to_decode] = prefill.requests, decode.requests
        for sent in (to_prefill, to_decode):
            assert sent["headers"]["Authorization"] == "Bearer sk-test"
            assert sent["headers"]["X-Request-Id"] == "req-7"
        assert to_prefill["json"]["max_tokens"] == 1
        assert to_decode["json"] == {**completion(), "kv_transfer_params": PREFILL_PARAMS}

    run(scenario())


def test_forwarded_headers_leave_out_connection_and_body_encoding() -> None:
    headers = {
        "Authorization": "Bearer k",
        "Host": "proxy:8000",
        "Connection": "keep-alive",
        "Content-Length": "9",
        "Content-Type": "application/json",
        "Transfer-Encoding": "chunked",
        "Accept": "text/event-stream",
    }
    assert proxy.forwarded_headers(headers, json_body=True) == {
        "Authorization": "Bearer k",
        "Accept": "text/event-stream",
    }
    assert proxy.forwarded_headers(headers, json_body=False)["Content-Type"] == "application/json"


# ---------------------------------------------------------------------------------------------- failures


def test_stream_failing_after_it_started_ends_with_an_sse_error_event() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, stream_then_fail) as (url, _, _):
            status, body = await post(url + "/v1/completions", completion(stream=True))
        assert status == 200  # the stream had started: its status stays
        events = [line for line in body.decode().split("\n\n") if line]
        assert events[0] == 'data: {"choices": [{"text": "first"}]}'
        error = json.loads(events[1].removeprefix("data: "))["error"]
        assert error["type"] == "proxy_error" and "the decode instance failed" in error["message"]
        assert events[2:] == ["data: [DONE]"]

    run(scenario())


def test_json_answer_cut_short_is_not_passed_off_as_whole() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, json_then_fail) as (url, _, _):
            with pytest.raises(aiohttp.ClientPayloadError):
                await post(url + "/v1/completions", completion())

    run(scenario())


def test_decode_instance_down_is_a_502() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, f"http://127.0.0.1:{closed_port()}") as (url, _, _):
            status, body = await post(url + "/v1/completions", completion())
        assert status == 502
        assert "the decode instance failed" in json.loads(body)["error"]["message"]

    run(scenario())


@pytest.mark.parametrize("prefill", [unanswered(503), "closed"])
def test_prefill_failure_sends_the_request_to_decode_with_nothing_saved(prefill: Handler | str) -> None:
    async def scenario() -> None:
        target = f"http://127.0.0.1:{closed_port()}" if prefill == "closed" else prefill
        async with proxied(target, decode_answer) as (url, _, decode):
            status, _ = await post(url + "/v1/completions", completion())
        assert status == 200
        assert decode.requests[0]["json"]["kv_transfer_params"] == proxy.NOTHING_SAVED

    run(scenario())


def test_prefill_client_error_is_returned_as_is() -> None:
    async def scenario() -> None:
        async with proxied(unanswered(400), decode_answer) as (url, _, decode):
            status, body = await post(url + "/v1/completions", completion())
        assert (status, json.loads(body)) == (400, {"error": "down"})
        assert decode.requests == []

    run(scenario())


# ---------------------------------------------------------------------------------------------- timeouts


SHORT = proxy.Timeouts(connect=0.5, read=0.5)


def test_silent_decode_instance_is_a_504_after_the_read_timeout() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, never_answer, SHORT) as (url, _, _):
            status, body = await post(url + "/v1/completions", completion())
        assert status == 504
        assert "no answer within the timeout" in json.loads(body)["error"]["message"]

    run(scenario())


def test_silent_prefill_instance_falls_back_to_decode_after_the_read_timeout() -> None:
    async def scenario() -> None:
        async with proxied(never_answer, decode_answer, SHORT) as (url, _, decode):
            status, _ = await post(url + "/v1/completions", completion())
        assert status == 200
        assert decode.requests[0]["json"]["kv_transfer_params"] == proxy.NOTHING_SAVED

    run(scenario())


def test_stream_stalling_after_it_started_ends_with_an_sse_error_event() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, stream_then_stall, SHORT) as (url, _, _):
            status, body = await post(url + "/v1/completions", completion(stream=True))
        events = [line for line in body.decode().split("\n\n") if line]
        assert status == 200 and len(events) == 3 and events[2] == "data: [DONE]"
        assert "no answer within the timeout" in json.loads(events[1].removeprefix("data: "))["error"]["message"]

    run(scenario())


def test_unreachable_decode_instance_is_a_504_after_the_connect_timeout() -> None:
    with full_listener() as port:

        async def scenario() -> None:
            async with proxied(prefill_answer, f"http://127.0.0.1:{port}", SHORT) as (url, _, _):
                status, body = await post(url + "/v1/completions", completion())
            assert status == 504, body

        run(scenario())


def test_a_whole_request_has_no_time_limit() -> None:
    timeout = SHORT.client_timeout()
    assert (timeout.total, timeout.sock_connect, timeout.sock_read) == (None, 0.5, 0.5)


# ---------------------------------------------------------------------------------------------- routes


def test_only_the_openai_routes_and_health_are_served() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, decode_answer) as (url, prefill, decode), aiohttp.ClientSession() as client:
            async with client.get(url + "/v1/models?limit=2", headers={"Authorization": "Bearer k"}) as response:
                assert response.status == 200
            for method, path in (
                ("GET", "/metrics"),
                ("POST", "/v1/embeddings"),
                ("GET", "/v1/completions"),
                ("POST", "/reset_prefix_cache"),
                ("GET", "/"),
            ):
                async with client.request(method, url + path) as response:
                    assert response.status == 404, (method, path)
                    assert path in (await response.json())["error"]["message"]
            async with client.get(url + "/health") as response:
                assert response.status == 200
        assert [(r["method"], r["path"]) for r in decode.requests] == [
            ("GET", "/v1/models?limit=2"),
            ("GET", "/health"),
        ]
        assert decode.requests[0]["headers"]["Authorization"] == "Bearer k"
        assert [(r["method"], r["path"]) for r in prefill.requests] == [("GET", "/health")]

    run(scenario())


def test_health_names_the_instance_that_is_not_healthy() -> None:
    async def scenario() -> None:
        async with proxied(unanswered(503), decode_answer) as (url, _, _), aiohttp.ClientSession() as client:
            async with client.get(url + "/health") as response:
                assert response.status == 503
                answer = await response.json()
        assert answer["error"]["message"] == f"no healthy prefill instance ({answer['prefill'][0]['url']} answered 503)"
        assert [i["healthy"] for i in answer["prefill"] + answer["decode"]] == [False, True]

    run(scenario())


# ---------------------------------------------------------------------------------------------- many instances


def prefill_named(index: int) -> Handler:
    """A prefill instance whose kv_transfer_params name it."""

    async def handler(request: web.Request) -> web.Response:
        params = {"kvbridge": {"prefix_tokens": 32, "host": f"p{index}", "port": 14579}}
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    return handler


def decode_named(index: int, gate: asyncio.Event | None = None) -> Handler:
    """A decode instance that says who it is and which params it got; it waits for ``gate`` first."""

    async def handler(request: web.Request) -> web.Response:
        if gate is not None:
            await gate.wait()
        body = await request.json()
        return web.json_response({"decode": index, "params": body.get("kv_transfer_params")})

    return handler


@contextlib.asynccontextmanager
async def cluster(
    prefills: list[Handler | str], decodes: list[Handler | str], **options: Any
) -> AsyncIterator[tuple[str, proxy.Proxy, list[FakeInstance | None]]]:
    """The proxy over several instances (handlers become fakes; strings are URLs as they are)."""
    fakes: list[FakeInstance | None] = []
    for spec in (*prefills, *decodes):
        fake = None if isinstance(spec, str) else FakeInstance(spec)
        if fake is not None:
            await fake.server.start_server()
        fakes.append(fake)
    urls = [spec if fake is None else fake.url for spec, fake in zip((*prefills, *decodes), fakes, strict=True)]
    front = proxy.Proxy(urls[: len(prefills)], urls[len(prefills) :], **{"health_interval": 3600, **options})
    server = TestServer(front.app())
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), front, fakes
    finally:
        await server.close()
        for fake in fakes:
            if fake is not None:
                await fake.server.close()


def test_each_decode_request_carries_the_params_of_the_prefill_that_served_it() -> None:
    async def scenario() -> None:
        async with cluster(
            [prefill_named(0), prefill_named(1)], [decode_named(0), decode_named(1)], decode_policy="least_outstanding"
        ) as (url, _, fakes):
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(4)]
        assert [a["params"]["kvbridge"]["host"] for a in answers] == ["p0", "p1", "p0", "p1"]
        assert [len(fake.requests) for fake in fakes] == [2, 2, 2, 2]

    run(scenario())


def test_every_prefill_meets_every_decode_when_the_policies_turn_at_different_rates() -> None:
    async def scenario() -> None:
        async with cluster(
            [prefill_named(0), prefill_named(1)], [decode_named(0), decode_named(1), decode_named(2)]
        ) as (url, _, _):
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(6)]
        pairs = {(a["params"]["kvbridge"]["host"], a["decode"]) for a in answers}
        assert pairs == {(f"p{p}", d) for p in range(2) for d in range(3)}

    run(scenario())


def test_least_outstanding_sends_new_requests_to_the_idle_decode_instance() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()
        async with cluster(
            [prefill_answer], [decode_named(0, gate), decode_named(1)], decode_policy="least_outstanding"
        ) as (url, front, _):
            held = asyncio.create_task(post(url + "/v1/completions", completion()))
            while front.decode.instances[0].outstanding == 0:  # the first request waits at decode 0
                await asyncio.sleep(0.01)
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(3)]
            gate.set()
            status, body = await held
        assert [a["decode"] for a in answers] == [1, 1, 1]
        assert status == 200 and json.loads(body)["decode"] == 0

    run(scenario())


@pytest.mark.parametrize("failing", [unanswered(500), never_answer, "closed"])
def test_a_failing_prefill_instance_is_replaced_by_the_next_one(failing: Handler | str) -> None:
    async def scenario() -> None:
        target = f"http://127.0.0.1:{closed_port()}" if failing == "closed" else failing
        async with cluster([target, prefill_named(1)], [decode_named(0)], timeouts=SHORT) as (url, front, _):
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(3)]
            assert not front.prefill.instances[0].healthy  # skipped from then on
        assert [a["params"]["kvbridge"]["host"] for a in answers] == ["p1"] * 3

    run(scenario())


def test_every_prefill_instance_failing_sends_nothing_saved_to_decode() -> None:
    async def scenario() -> None:
        dead = [f"http://127.0.0.1:{closed_port()}" for _ in range(2)]
        async with cluster(dead, [decode_named(0)]) as (url, _, _):
            status, body = await post(url + "/v1/completions", completion())
        assert status == 200 and json.loads(body)["params"] == proxy.NOTHING_SAVED

    run(scenario())


def test_a_decode_instance_that_refuses_connections_is_replaced_by_the_next_one() -> None:
    async def scenario() -> None:
        async with cluster([prefill_named(0)], [f"http://127.0.0.1:{closed_port()}", decode_named(1)]) as (url, _, _):
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(3)]
        assert [(a["decode"], a["params"]["kvbridge"]["host"]) for a in answers] == [(1, "p0")] * 3

    run(scenario())


def test_an_instance_marked_down_comes_back_after_a_passing_check() -> None:
    async def scenario() -> None:
        failing = True

        async def flaky(request: web.Request) -> web.Response:
            if failing:
                return web.json_response({"error": "down"}, status=503)
            return await prefill_named(0)(request)

        async with cluster([flaky, prefill_named(1)], [decode_named(0)], health_interval=0.05) as (url, front, _):
            while front.prefill.instances[0].healthy:  # the background check marks it down
                await asyncio.sleep(0.01)
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(2)]
            assert [a["params"]["kvbridge"]["host"] for a in answers] == ["p1", "p1"]
            failing = False
            while not front.prefill.instances[0].healthy:
                await asyncio.sleep(0.01)
            answers = [json.loads((await post(url + "/v1/completions", completion()))[1]) for _ in range(2)]
        assert sorted(a["params"]["kvbridge"]["host"] for a in answers) == ["p0", "p1"]

    run(scenario())


def test_health_is_served_while_one_instance_of_each_kind_is_healthy() -> None:
    async def scenario() -> None:
        dead = f"http://127.0.0.1:{closed_port()}"
        async with (
            cluster([dead, prefill_answer], [decode_answer, dead]) as (url, _, _),
            aiohttp.ClientSession() as client,
            client.get(url + "/health") as response,
        ):
            assert response.status == 200
            state = await response.json()
        assert [i["healthy"] for i in state["prefill"]] == [False, True]
        assert [i["healthy"] for i in state["decode"]] == [True, False]
        assert state["prefill"][0]["url"] == dead and state["prefill"][0]["problem"]

    run(scenario())


def test_a_request_id_is_made_when_the_client_sends_none_and_both_legs_share_it() -> None:
    async def scenario() -> None:
        async with proxied(prefill_answer, decode_answer) as (url, prefill, decode):
            await post(url + "/v1/completions", completion())
        [to_prefill], [to_decode] = prefill.requests, decode.requests
        assert to_prefill["headers"]["X-Request-Id"] == to_decode["headers"]["X-Request-Id"] != ""

    run(scenario())


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", "http://a"],
        ["--decode", "http://b"],
        ["--prefill", "http://a", "--decode", "http://b", "--decode-policy", "random"],
    ],
)
def test_the_command_line_needs_both_kinds_and_known_policies(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        proxy.parser().parse_args(argv)


def test_the_command_line_takes_several_instances_of_each_kind() -> None:
    args = proxy.parser().parse_args(
        [
            "--prefill",
            "http://a",
            "--prefill",
            "http://b",
            "--decode",
            "http://c",
            "--prefill-policy",
            "least_outstanding",
        ]
    )
    assert (args.prefill, args.decode, args.prefill_policy, args.decode_policy) == (
        ["http://a", "http://b"],
        ["http://c"],
        "least_outstanding",
        "round_robin",
    )


# ---------------------------------------------------------------------------------------------- helpers


def closed_port() -> int:
    """A port nothing listens on (connections are refused at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def full_listener() -> Any:
    """A port whose listener never accepts and whose backlog is full: new connections get no answer."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        try:
            for _ in range(3):
                filler = socket.socket()
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(("127.0.0.1", port))
                fillers.append(filler)
            yield port
        finally:
            for filler in fillers:
                filler.close()


def test_pooled_connections_leave_before_vllm_closes_idle_ones() -> None:
    """A pooled connection that vLLM's API server closes while the proxy sends on it is a 502: the
    pool must let idle connections go before the server's keep-alive ends."""
    import vllm.envs

    async def scenario() -> None:
        instance = proxy.Proxy(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], health_interval=3600)
        server = TestServer(instance.app())
        await server.start_server()
        try:
            connector = instance._client().connector
            assert connector is not None
            assert connector._keepalive_timeout == instance.timeouts.keepalive
        finally:
            await server.close()

    assert proxy.Timeouts().keepalive < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    run(scenario())
