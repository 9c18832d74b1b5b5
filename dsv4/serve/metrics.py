"""Prometheus metrics of the server (``GET /metrics``), through ``prometheus-client``.

Each server has its own registry (several apps can live in one process, e.g. in tests). Names
follow Prometheus conventions with a ``dsv4_`` prefix:

- gauges ``dsv4_num_requests_running``, ``dsv4_num_requests_waiting``, ``dsv4_slots_used``,
  ``dsv4_slots_total``, ``dsv4_slot_usage_ratio`` (written by the engine thread after each step);
- counters ``dsv4_prompt_tokens_total``, ``dsv4_generation_tokens_total``,
  ``dsv4_requests_finished_total{finish_reason}``, ``dsv4_http_requests_total{endpoint,status}``;
- prefix cache: counters ``dsv4_prefix_cache_queries_total`` (prompt tokens looked up),
  ``dsv4_prefix_cache_hits_total`` (prompt tokens served from it), ``dsv4_prefix_cache_evictions_total``
  (tails and blocks evicted), gauges ``dsv4_prefix_cache_bytes`` (in use) and
  ``dsv4_prefix_cache_capacity_bytes`` (its budget; absent with caching off);
- histograms ``dsv4_time_to_first_token_seconds``, ``dsv4_inter_token_latency_seconds``,
  ``dsv4_e2e_request_latency_seconds``;
- speculative decoding (vLLM's ``spec_decode`` set): counters ``dsv4_spec_decode_num_drafts_total``
  (verify rows), ``dsv4_spec_decode_num_draft_tokens_total``, ``dsv4_spec_decode_num_accepted_tokens_total``,
  ``dsv4_spec_decode_num_accepted_tokens_per_pos_total{position}``,
  ``dsv4_spec_decode_num_policy_plain_rows_total`` (decode rows the policy ran plainly), and the gauge
  ``dsv4_spec_decode_mean_accepted_length`` (tokens per verify row, accepted drafts + 1).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5)
_E2E = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class Metrics:
    """The server's metrics in their own registry."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}
        self.running = Gauge("dsv4_num_requests_running", "Requests holding a slot", ["model_name"],
                             registry=r).labels(**label)
        self.waiting = Gauge("dsv4_num_requests_waiting", "Requests waiting for a slot", ["model_name"],
                             registry=r).labels(**label)
        self.slots_used = Gauge("dsv4_slots_used", "Generation slots in use", ["model_name"], registry=r).labels(**label)
        self.slots_total = Gauge("dsv4_slots_total", "Generation slots (max_num_seqs)", ["model_name"],
                                 registry=r).labels(**label)
        self.slot_usage = Gauge("dsv4_slot_usage_ratio", "Fraction of the slots in use", ["model_name"],
                                registry=r).labels(**label)
        self.prompt_tokens = Counter("dsv4_prompt_tokens", "Prompt tokens admitted", ["model_name"],
                                     registry=r).labels(**label)
        self.generation_tokens = Counter("dsv4_generation_tokens", "Tokens generated", ["model_name"],
                                         registry=r).labels(**label)
        self._finished = Counter("dsv4_requests_finished", "Engine requests finished, by finish reason (stop, "
                                 "length, abort, error)", ["model_name", "finish_reason"], registry=r)
        self._http = Counter("dsv4_http_requests", "HTTP responses by endpoint and status", ["endpoint", "status"],
                             registry=r)
        self.ttft = Histogram("dsv4_time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_TTFT, registry=r).labels(**label)
        self.itl = Histogram("dsv4_inter_token_latency_seconds", "Time between output tokens", ["model_name"],
                             buckets=_ITL, registry=r).labels(**label)
        self.e2e = Histogram("dsv4_e2e_request_latency_seconds", "Arrival to last token", ["model_name"],
                             buckets=_E2E, registry=r).labels(**label)
        self.model_name = model_name
        self._cache_counters = {
            name: Counter(f"dsv4_prefix_cache_{name}", doc, ["model_name"], registry=r).labels(**label)
            for name, doc in (("queries", "Prompt tokens looked up in the prefix cache"),
                              ("hits", "Prompt tokens served from the prefix cache"),
                              ("evictions", "Prefix-cache tails and blocks evicted"))}
        self._cache_bytes = Gauge("dsv4_prefix_cache_bytes", "Prefix-cache memory in use", ["model_name"],
                                  registry=r).labels(**label)
        self._cache_capacity = Gauge("dsv4_prefix_cache_capacity_bytes", "Prefix-cache memory budget",
                                     ["model_name"], registry=r).labels(**label)
        self._cache_seen = {"queries": 0, "hits": 0, "evictions": 0}
        spec = lambda name, doc: Counter(f"dsv4_spec_decode_{name}", doc, ["model_name"], registry=r).labels(**label)  # noqa: E731
        self.spec_drafts = spec("num_drafts", "Speculative verify rows run")
        self.spec_draft_tokens = spec("num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted = spec("num_accepted_tokens", "Draft tokens accepted")
        self.spec_policy_plain = spec("num_policy_plain_rows", "Decode rows run plainly by the speculation "
                                      "policy (acceptance below the verify step's cost, or disable_by_batch_size)")
        self._spec_per_pos = Counter("dsv4_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                                     "draft position (0 = the first draft)", ["model_name", "position"], registry=r)
        self.spec_mean_length = Gauge("dsv4_spec_decode_mean_accepted_length", "Tokens emitted per verify row "
                                      "(accepted drafts + 1)", ["model_name"], registry=r).labels(**label)
        self._spec_seen = None

    # engine thread
    def engine_state(self, stats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.slots_used.set(stats.slots_used)
        self.slots_total.set(stats.slots_total)
        self.slot_usage.set(stats.slots_used / stats.slots_total if stats.slots_total else 0.0)
        cache = getattr(stats, "prefix_cache", None)
        if cache is not None:
            for name, counter in self._cache_counters.items():
                now = getattr(cache, name)
                counter.inc(max(now - self._cache_seen[name], 0))
                self._cache_seen[name] = now
            self._cache_bytes.set(cache.used_bytes)
            self._cache_capacity.set(cache.capacity_bytes)
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:        # the engine's totals: the counters advance by what is new
            seen = self._spec_seen or type(spec)()
            self.spec_drafts.inc(spec.num_drafts - seen.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
            self.spec_accepted.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
            self.spec_policy_plain.inc(spec.num_policy_plain_rows - seen.num_policy_plain_rows)
            old = seen.accepted_per_pos or []
            for i, n in enumerate(spec.accepted_per_pos or []):
                self._spec_per_pos.labels(self.model_name, str(i)).inc(n - (old[i] if i < len(old) else 0))
            self.spec_mean_length.set(spec.mean_accepted_length)
            self._spec_seen = spec

    # event loop
    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def generated(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def request_done(self, prompt_tokens: int, output_tokens: int, seconds: float, finish_reason: str | None) -> None:
        self.e2e.observe(seconds)
        self._finished.labels(self.model_name, finish_reason or "unknown").inc()

    def http(self, endpoint: str, status: int) -> None:
        self._http.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
