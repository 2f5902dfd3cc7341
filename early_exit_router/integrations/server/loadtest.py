"""`early-exit-router loadtest`: concurrent streaming clients (the official `openai` client) against the server,
started in-process on loopback, with routing on (the router's config), routing off (no exit, no n-gram tier), and
routing on without batching (each request decoded on its own, one step each in turn).

Every request is greedy, so each response must equal the same request run alone (`router.generate`, after the
load): the report counts responses that differ, requests that failed, and duplicated response ids, and gives
throughput and p50/p99 latency and time to first token for each arm.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from early_exit_router.integrations.server.app import ServerSettings, create_app

ROUTING_OFF = {"active_exit_layers": [], "ngram_tier": False}  # every token at full depth, plainly


@dataclass
class LoadtestConfig:
    clients: int = 8  # concurrent streaming clients
    requests_per_client: int = 2
    max_tokens: int = 32


@dataclass
class ArmReport:
    arm: str
    requests: int
    failed: int
    differing: int  # responses that differ from the same request run alone
    duplicate_ids: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    errors: list[str] = field(default_factory=list)


@dataclass
class LoadtestResult:
    meta: dict[str, Any]
    arms: list[ArmReport]

    @property
    def passed(self) -> bool:
        return all(a.failed == 0 and a.differing == 0 and a.duplicate_ids == 0 for a in self.arms)

    def markdown(self) -> str:
        m = self.meta
        lines = [
            f"model: {m['model']}",
            f"{m['clients']} concurrent streaming clients x {m['requests_per_client']} chat requests, "
            f"{m['max_tokens']} tokens max, greedy; the server on loopback, up to {m['clients']} requests running at "
            "once (continuous batching)",
            "",
            "| arm | requests | failed | differ from alone | duplicate ids | tokens/s | latency p50 / p99 s "
            "| TTFT p50 s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for a in self.arms:
            lines.append(
                f"| {a.arm} | {a.requests} | {a.failed} | {a.differing} | {a.duplicate_ids} | {a.tokens_per_s:.1f} | "
                f"{a.latency_p50_s:.2f} / {a.latency_p99_s:.2f} | {a.ttft_p50_s:.2f} |"
            )
        lines.append("")
        lines.append("PASS: every response equals its request run alone" if self.passed else "FAIL: see the table")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "arms": [asdict(a) for a in self.arms], "passed": self.passed}


@contextmanager
def running_server(app: Any) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port, in a thread; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("The server did not start.")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)


def run_loadtest(router: Any, prompts: Sequence[str], cfg: LoadtestConfig | None = None) -> LoadtestResult:
    """Both arms, one after the other, on the same prompts (see the module docstring)."""
    cfg = cfg or LoadtestConfig()
    if cfg.clients < 1 or cfg.requests_per_client < 1 or cfg.max_tokens < 1:
        raise ValueError("clients, requests_per_client and max_tokens must be >= 1.")
    if not prompts:
        raise ValueError("No prompts to send.")
    name = "model"
    arms = []
    for arm, overrides, batching in (
        ("routing on (router config)", {}, True),
        ("routing off (plain decoding)", ROUTING_OFF, True),
        ("routing on, no batching (one step per request in turn)", {}, False),
    ):
        settings = ServerSettings(
            model_name=name, max_queue=cfg.clients * cfg.requests_per_client, max_running=cfg.clients,
            routing_overrides=overrides, default_max_tokens=cfg.max_tokens, batching=batching,
        )  # fmt: skip
        # Each arm starts with an empty n-gram store: the runs before it (and the checks) hold the same answers.
        router.clear_ngram_store()
        with running_server(create_app(router, settings)) as url:
            arms.append(_load(router, url, name, arm, prompts, cfg, overrides))
    meta = {"model": router.describe(), **asdict(cfg)}
    return LoadtestResult(meta, arms)


def _load(
    router: Any, url: str, name: str, arm: str, prompts: Sequence[str], cfg: LoadtestConfig, overrides
) -> ArmReport:
    import openai

    total = cfg.clients * cfg.requests_per_client
    jobs = [prompts[k % len(prompts)] for k in range(total)]
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="loadtest", max_retries=0, timeout=600)
        for k in range(c, total, cfg.clients):
            start = time.perf_counter()
            first = None
            try:
                stream = client.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": jobs[k]}],
                    max_tokens=cfg.max_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                pieces, ids, usage = [], set(), 0
                for chunk in stream:
                    ids.add(chunk.id)
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        pieces.append(chunk.choices[0].delta.content)
                end = time.perf_counter()
                results[k] = dict(text="".join(pieces), ids=ids, tokens=usage, latency=end - start,
                                  ttft=(first or end) - start)  # fmt: skip
            except Exception as error:  # counted and reported: a load test must not stop at the first failure
                errors.append(f"request {k}: {type(error).__name__}: {error}")

    warm = openai.OpenAI(base_url=f"{url}/v1", api_key="loadtest", max_retries=0, timeout=600)
    warm.chat.completions.create(  # first-call costs stay out of the numbers (and the store is cleared after)
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    router.clear_ngram_store()
    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(cfg.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    differing = 0
    router.clear_ngram_store()  # the check runs alone: it must not copy the answers the load just produced
    for k, r in results.items():  # each response against the same request run alone
        ids = router.encode(jobs[k], chat=True)
        out = router.generate(ids, cfg.max_tokens, config=overrides or None, do_sample=False)  # as the load asks
        alone = router.tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
        differing += int(r["text"] != alone)
    all_ids = [i for r in results.values() for i in r["ids"]]
    latencies = sorted(r["latency"] for r in results.values()) or [0.0]
    tokens = sum(r["tokens"] for r in results.values())
    return ArmReport(
        arm=arm,
        requests=total,
        failed=total - len(results),
        differing=differing,
        duplicate_ids=len(all_ids) - len(set(all_ids)),
        completion_tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        latency_p50_s=statistics.median(latencies),
        latency_p99_s=latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        ttft_p50_s=statistics.median(r["ttft"] for r in results.values()) if results else 0.0,
        errors=errors,
    )
