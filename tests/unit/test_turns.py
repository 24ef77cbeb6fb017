"""Who sends and receives on each kind of channel (:mod:`kv_pipe.turns`), on a clock of the test's own."""

from __future__ import annotations

import pytest
import torch

from kv_pipe import turns
from kv_pipe.protocol import SHARED_MIN_BYTES
from kv_pipe.turns import (
    CALLERS_RETURN_SECONDS,
    RECEIVER_PARK_SECONDS,
    SPIN_SECONDS,
    GroupTurns,
    SocketTurns,
    ThreadTurns,
)

KEEPALIVE = 0.25
INLINE = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(turns.time, "monotonic", clock)
    return clock


def test_on_a_split_channel_only_the_threads_send_and_receive(clock: Clock):
    only_threads = ThreadTurns()
    assert not only_threads.may_send_here([torch.ones(1)], None)
    assert not only_threads.may_send_here([], None)
    assert not only_threads.may_receive_here(None)
    only_threads.caller_waits(for_role=False)
    assert only_threads.receiver_pause() == 0.0  # the thread receives at once, whoever waits
    assert not only_threads.receiver_yields() and not only_threads.receiver_left_role()
    assert only_threads.frame_waited(0.5) == 0.0


def test_on_the_groups_only_callers_with_time_to_spare_use_the_channel(clock: Clock):
    group = GroupTurns(KEEPALIVE, INLINE)
    small, large = torch.ones(INLINE // 4), torch.ones(INLINE // 4 + 1)
    assert group.may_send_here([small, small], None) and group.may_receive_here(None)
    assert group.may_send_here([small], clock.now + 2 * KEEPALIVE)
    assert group.may_receive_here(clock.now + 2 * KEEPALIVE)
    # Less than twice the keepalive interval: an operation on the groups could outlast it.
    assert not group.may_send_here([small], clock.now + 2 * KEEPALIVE - 0.001)
    assert not group.may_receive_here(clock.now + 2 * KEEPALIVE - 0.001)
    # More than a frame's worth of wire: the sender thread sends it.
    assert not group.may_send_here([small, large], None)


def test_on_the_groups_the_thread_leaves_the_role_to_callers_for_a_moment(clock: Clock):
    group = GroupTurns(KEEPALIVE, INLINE)
    assert group.receiver_pause() == 0.0  # no caller has received yet
    group.caller_took_role()
    assert group.receiving == 1 and group.receiver_pause() == RECEIVER_PARK_SECONDS
    assert not group.caller_left_role()  # nobody waits for the thread: nothing to wake
    assert group.receiving == 0 and group.receiver_pause() == pytest.approx(CALLERS_RETURN_SECONDS)
    clock.now += CALLERS_RETURN_SECONDS / 2
    assert group.receiver_pause() == pytest.approx(CALLERS_RETURN_SECONDS / 2)
    clock.now += CALLERS_RETURN_SECONDS
    assert group.receiver_pause() == 0.0


def test_on_the_groups_a_caller_in_a_hurry_calls_the_thread_back_at_once(clock: Clock):
    group = GroupTurns(KEEPALIVE, INLINE)
    group.caller_took_role()
    group.caller_waits(for_role=False)
    assert group.caller_left_role()  # the waiting caller's thread is to be woken
    assert group.receiver_pause() == 0.0
    group.caller_stops_waiting(for_role=False)
    assert group.receiver_pause() == pytest.approx(CALLERS_RETURN_SECONDS)


def test_on_the_groups_the_thread_hands_the_role_to_a_caller_that_wants_it(clock: Clock):
    group = GroupTurns(KEEPALIVE, INLINE)
    assert not group.receiver_yields()
    group.caller_waits(for_role=True)
    assert group.receiver_yields()  # after the frame it is in, the thread gives the role up
    assert group.receiver_left_role()  # and wakes the caller
    assert not group.receiver_yields() and not group.receiver_left_role()
    assert group.receiver_pause() == pytest.approx(CALLERS_RETURN_SECONDS)


def test_on_a_socket_callers_always_receive_and_send_what_shared_memory_takes(clock: Clock):
    asked: list[list[int]] = []
    room = [True]

    def room_for(payloads: list[torch.Tensor]) -> bool:
        asked.append([payload.nbytes for payload in payloads])
        return room[0]

    socket = SocketTurns(room_for)
    soon = clock.now + 0.001
    assert socket.may_receive_here(soon) and socket.may_receive_here(None)
    small, shared = torch.ones(16), torch.ones(SHARED_MIN_BYTES // 4)
    assert socket.may_send_here([small, small], soon) and asked == []  # frames leave at once
    assert socket.may_send_here([small, shared], soon) and asked == [[SHARED_MIN_BYTES]]
    room[0] = False  # a payload that would wait for the wire goes to the sender thread
    assert not socket.may_send_here([shared], None)


def test_on_a_socket_the_thread_parks_while_callers_receive_and_never_yields(clock: Clock):
    socket = SocketTurns(lambda payloads: True)
    assert socket.receiver_pause() == 0.0
    socket.caller_took_role()
    assert socket.receiver_pause() == RECEIVER_PARK_SECONDS
    socket.caller_waits(for_role=True)
    assert not socket.receiver_yields()  # a socket receive ends at a deadline: no need to
    assert not socket.caller_left_role()
    assert socket.receiver_pause() == 0.0  # no return window on a socket
    assert socket.receiver_left_role() and not socket.receiver_left_role()


def test_on_a_socket_the_spin_follows_the_last_wait_for_a_frame(clock: Clock):
    socket = SocketTurns(lambda payloads: True)
    shortest, longest = SPIN_SECONDS
    assert socket.spin == shortest
    assert socket.frame_waited(shortest) == shortest * 1.5 == socket.spin
    assert socket.frame_waited(longest / 2) == pytest.approx(longest * 0.75)
    assert socket.frame_waited(longest) == shortest  # a long wait: a large copy on the peer's side
    assert socket.frame_waited(0.0) == shortest
