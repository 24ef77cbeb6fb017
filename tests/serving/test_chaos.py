"""A short chaos soak (``benchmarks/bench_chaos.py``, same code): 2 prefill + 2 decode real ``vllm serve``
instances behind kvbridge's proxy, prefill instances under memory pressure, load from 6 clients (at
least 90 s, until 20 s after the second restart: about 2 min) while a prefill and then a decode
instance are SIGKILLed and restarted on the same ports and prefill-only requests are abandoned.

Every answer must equal one plain server's, none may hang, an error is allowed only for a request
in flight at the instance that was killed (everything after a restart succeeds), and once the load
stops every kvbridge gauge of every instance must come back to idle. The faults must really have
happened: kills, preemptions on the prefill instances, abandoned entries.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_chaos as chaos

#: A prefill instance killed at 25 s, a decode instance once the prefill is back (a restart takes 20-40 s
#: here), then load for 20 s more (at least 90 s of load in all). Half of the requests are long
#: prefills, which is where vLLM preempts (a few times a minute here). Abandoned entries expire after
#: 20 s, so that the gauges are idle soon after the load.
SETTINGS = chaos.Settings(
    duration=90,
    kill_every=25,
    clients=6,
    seed=1,
    abandon_every=8,
    long_share=0.5,
    kill_roles=("prefill", "decode"),
    max_kills=2,
    after_restart=20,
    entry_timeout=20,
)


@pytest.mark.timeout(1200)  # about 5 min alone; more when the cores are shared
def test_kills_restarts_and_abandoned_prefills_never_give_a_wrong_answer_a_hang_or_a_leak(tmp_path: Path) -> None:
    # run_chaos stops every process it started (process groups) on its way out, whatever happens.
    report = chaos.run_chaos(SETTINGS, tmp_path, progress=False)
    table = chaos.format_report(report)
    print(table)  # shown with -s
    requests, faults = report["requests"], report["faults"]
    assert report["failure"] is None, table
    # The faults happened.
    killed = {kill["role"] for kill in faults["kills"] if kill["ready"] is not None}
    assert killed == {"prefill", "decode"}, table
    assert faults["abandoned"] > 0, table
    assert report["prefill"]["preemptions"] > 0, f"no preemption on the prefill instances: proves nothing\n{table}"
    # The load was served, right, with no hang.
    assert requests["served"] > 0 and requests["by_flow"]["long"]["served"] > 0, table
    assert requests["wrong"] == 0, f"{report['wrong_details']}\n{table}"
    assert requests["hangs"] == 0, f"{report['error_details']}\n{table}"
    # Errors only for requests in flight at the instance killed.
    unexpected = [e for e in report["error_details"] if not e["expected"]]
    assert requests["unexpected_errors"] == 0, f"{unexpected}\n{table}"
    # The restarted instances were used again: the restarted prefill saved, the restarted decode loaded.
    for kill in faults["kills"]:
        life = report["counters_last_life"][kill["victim"]]
        used = life["saved_requests"] if kill["role"] == "prefill" else life["load_hits"]
        assert used > 0, f"{kill['victim']} was not used after its restart: {life}\n{table}"
    # Nothing leaked: every gauge of every instance is back at idle.
    assert report["settle"]["not_live"] == [], table
    assert report["settle"]["idle"], table
